"""What gc does to a store's files: find what may be swept, set objects and refs aside, put them back,
remove. :mod:`alpha_ckpt.upkeep.gc` decides what goes (retention, pins, reachability, leases); these functions
are the file operations, and the one place outside the Store that touches a store's files for it.

    STORE/tmp/aside-<digest>-<pid>-<random>              an object being removed, set aside first
    STORE/refs/RUN/STEP/aside-<generation>-<pid>-<random>  a ref being removed, set aside in its own directory

Entries alpha_ckpt never writes where they are are never removed: ``skip(path, why)`` hears of each.
"""
from __future__ import annotations

import errno
import math
import os
import secrets
import shutil
import stat
import time
from typing import Callable

from alpha_ckpt.store import durable
from alpha_ckpt.errors import Refusal, RefusalCode, StoreUsageError
from alpha_ckpt.format.records import is_digest
from alpha_ckpt.store import layout as L
from alpha_ckpt.store.layout import (  # noqa: F401 (the names gc gives: re-exported from here)
    ASIDE_PREFIX, OUTPUT_SUFFIX, QUARANTINED_RE, REF_ASIDE_RE, fan_of, quarantined_names, ref_name,
)
from alpha_ckpt.store.leases import read_leases, writer_alive
from alpha_ckpt.store.refs import RefRecord
from alpha_ckpt.store.store import Store

Skip = Callable[[str, str], None]  # (path under the store, why it is left as it is)


def _mtime(path: str) -> float:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return math.inf  # gone: nothing to remove


def object_mtime(store: Store, digest: str) -> float:
    """When the object was last written or renewed (infinity where it is gone: nothing to remove)."""
    return _mtime(store.object_path(digest))


def output_time(store: Store, run: str, step: str) -> float | None:
    """When the newest declared output of run/step was published, or None where there is none."""
    directory = store.layout.outputs_dir(run, step)
    try:
        if not stat.S_ISDIR(os.stat(directory, follow_symlinks=False).st_mode):
            return None
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    times = []
    for name in names:
        if name.endswith(OUTPUT_SUFFIX):
            try:
                st = os.stat(os.path.join(directory, name), follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                times.append(st.st_mtime)
    return max(times, default=None)


def old_tmp_files(store: Store, before: float, skip: Skip) -> list[str]:
    """Temporary files modified before ``before`` whose writer is gone (not what gc set aside itself)."""
    tmp_dir = store.layout.tmp_dir()
    if not os.path.isdir(tmp_dir):
        return []
    return sorted(n for n in _regular_files(tmp_dir, L.TMP, skip)
                  if not n.startswith(ASIDE_PREFIX) and _mtime(os.path.join(tmp_dir, n)) < before
                  and not writer_alive(n))


def refs_aside(store: Store, run: str, step: str) -> list[tuple[str, str, str]]:
    """The refs of run/step a killed gc left set aside: (run, step, name) each."""
    try:
        dir_fd = _open_dir(store.layout.refs_dir(run, step))
    except OSError:
        return []
    try:
        return [(run, step, n) for n in sorted(os.listdir(dir_fd)) if REF_ASIDE_RE.match(n)]
    finally:
        os.close(dir_fd)


def remove_tmp_files(store: Store, names: list[str]) -> None:
    _remove(store.layout.tmp_dir(), names)


def remove_verified_records(store: Store, roots: list[str]) -> None:
    if roots:
        _remove(store.layout.verified_dir(), roots)


def remove_leases(store: Store, names: list[str]) -> None:
    _remove(store.layout.pending_dir(), names)


def _regular_files(directory: str, shown_as: str, skip: Skip) -> list[str]:
    """The regular files of ``directory``; every other entry is skipped (and ``skip`` hears of it)."""
    fd = _open_dir(directory)
    try:
        out = []
        for name in os.listdir(fd):
            try:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISREG(mode):
                out.append(name)
            else:
                skip(f"{shown_as}/{name}", f"a {durable.file_kind(mode)}, not a temporary file")
        return out
    finally:
        os.close(fd)


def quarantined_before(store: Store, before: float, skip: Skip) -> list[str]:
    """Entries a save set aside in quarantine/ before ``before`` (by the time in their names)."""
    try:
        fd = _open_dir(store.layout.quarantine_dir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            skip(L.QUARANTINE, "a symlink or not a directory, so not swept")
            return []
        raise
    try:
        names = sorted(os.listdir(fd))
    finally:
        os.close(fd)
    return quarantined_names(names, before, skip)


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _remove(directory: str, names: list[str]) -> None:
    if not names:
        return
    fd = _open_dir(directory)
    try:
        for name in names:
            try:
                os.unlink(name, dir_fd=fd)
            except (FileNotFoundError, IsADirectoryError):  # gone, or replaced by a directory since planning
                pass
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quarantined(store: Store, names: list[str]) -> None:
    """Remove what a save set aside, whatever it is (a directory with its content; a symlink, not its target)."""
    if not names:
        return
    fd = _open_dir(store.layout.quarantine_dir())
    try:
        for name in names:
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)  # walks by descriptors: never leaves the directory
                else:
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
        os.fsync(fd)
    finally:
        os.close(fd)


def _put_back(tmp_fd: int, aside: str, fan_fd: int, digest: str) -> None:
    try:
        durable.rename_noreplace(tmp_fd, aside, fan_fd, digest)
    except FileExistsError:  # written again meanwhile: the same bytes under the same name
        os.unlink(aside, dir_fd=tmp_fd)
    except FileNotFoundError:
        pass  # another gc put it back first


def _put_back_set_aside(tmp_fd: int, objects_fd: int, skip: Skip) -> None:
    """Objects a killed gc had set aside go back first: one may have been renewed by a publish."""
    for name in sorted(os.listdir(tmp_fd)):
        digest = name[len(ASIDE_PREFIX):len(ASIDE_PREFIX) + 64]
        if name.startswith(ASIDE_PREFIX) and is_digest(digest):
            try:
                mode = os.stat(name, dir_fd=tmp_fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):  # gc sets aside only object files
                skip(f"{L.TMP}/{name}", f"a {durable.file_kind(mode)}, not an object set aside")
                continue
            try:
                fan_fd = durable.make_dir_durable(objects_fd, fan_of(digest))
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                skip(f"{L.OBJECTS}/{fan_of(digest)}", "not a plain directory, so an object set aside cannot go back")
                continue
            try:
                _put_back(tmp_fd, name, fan_fd, digest)
                os.fsync(fan_fd)
            finally:
                os.close(fan_fd)


def _remove_objects(store: Store, digests: list[str], protect_before: float, tmp_fd: int, objects_fd: int) -> None:
    """Set each object aside, read its time again, and remove it only if nothing renewed it since planning."""
    fans: dict[str, int] = {}
    try:
        for digest in digests:
            fan = fan_of(digest)
            if fan not in fans:
                try:
                    fans[fan] = _open_dir(store.layout.fan_dir(fan))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except OSError as exc:
                    if exc.errno != errno.ELOOP:  # replaced by a symlink since planning: not followed
                        raise
                    continue
            aside = f"{ASIDE_PREFIX}{digest}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                durable.rename_noreplace(fans[fan], digest, tmp_fd, aside)
            except FileNotFoundError:
                continue
            try:
                renewed = os.stat(aside, dir_fd=tmp_fd, follow_symlinks=False).st_mtime >= protect_before
            except FileNotFoundError:
                continue  # another gc put it back
            if renewed:
                _put_back(tmp_fd, aside, fans[fan], digest)
            else:
                try:
                    os.unlink(aside, dir_fd=tmp_fd)
                except FileNotFoundError:
                    pass
        for fd in fans.values():
            os.fsync(fd)
    finally:
        for fd in fans.values():
            os.close(fd)


def _refs_dir_fd(store: Store, run: str, step: str) -> int | None:
    try:
        return _open_dir(store.layout.refs_dir(run, step))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # replaced by a symlink since planning: not followed
            raise
        return None


def _put_back_ref(dir_fd: int, aside: str, name: str) -> None:
    try:
        durable.rename_noreplace(dir_fd, aside, dir_fd, name)
    except (FileExistsError, FileNotFoundError):  # put back already (a pin, another gc); a taken name: left aside
        pass


def put_back_refs(store: Store, refs_aside: list[tuple[str, str, str]]) -> None:
    """Refs a killed gc had set aside go back first: a pin may have been taken meanwhile."""
    for run, step, name in refs_aside:
        dir_fd = _refs_dir_fd(store, run, step)
        if dir_fd is None:
            continue
        try:
            _put_back_ref(dir_fd, name, REF_ASIDE_RE.match(name).group(1))
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class ObjectSweep:
    """tmp/ and objects/ held open while gc puts back what a killed gc set aside and removes objects."""

    def __init__(self, store: Store):
        self.store = store
        root_fd = store.layout.open_root()
        try:
            self.tmp_fd = durable.make_dir_durable(root_fd, L.TMP)
        finally:
            os.close(root_fd)
        try:
            self.objects_fd = _open_dir(store.layout.objects_dir())
        except BaseException:
            os.close(self.tmp_fd)
            raise

    def __enter__(self) -> "ObjectSweep":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.objects_fd)
        os.close(self.tmp_fd)

    def put_back_set_aside(self, skip: Skip) -> None:
        """Objects a killed gc had set aside go back first: one may have been renewed by a publish."""
        _put_back_set_aside(self.tmp_fd, self.objects_fd, skip)

    def remove_objects(self, digests: list[str], protect_before: float) -> None:
        """Set each object aside, read its time again, and remove it only if nothing renewed it since planning."""
        _remove_objects(self.store, digests, protect_before, self.tmp_fd, self.objects_fd)
        os.fsync(self.tmp_fd)


class RefsAside:
    """Refs of dropped generations renamed aside in their own directories (invisible to a pin, which then
    refuses, or rescues them: see :func:`alpha_ckpt.upkeep.pins.pin_generation`); :meth:`finish` then puts back
    those pinned by then and unlinks the rest."""

    def __init__(self, store: Store, refs: list[RefRecord]):
        self._fds: dict[tuple[str, str], int | None] = {}
        self.entries: list[tuple[RefRecord, int, str]] = []
        try:
            for r in refs:
                key = (r.run, r.step)
                if key not in self._fds:
                    self._fds[key] = _refs_dir_fd(store, r.run, r.step)
                if self._fds[key] is None:
                    continue
                name = f"{ASIDE_PREFIX}{ref_name(r.generation)}-{os.getpid()}-{secrets.token_hex(4)}"
                try:
                    durable.rename_noreplace(self._fds[key], ref_name(r.generation), self._fds[key], name)
                except FileNotFoundError:
                    continue
                self.entries.append((r, self._fds[key], name))
        except BaseException:
            self.close()
            raise

    def finish(self, pins: set[str]) -> set[str]:
        """Put back the refs whose root is in ``pins``, unlink the rest; the roots spared by a pin."""
        spared = set()
        for r, dir_fd, name in self.entries:
            if r.root in pins:
                spared.add(r.root)
                _put_back_ref(dir_fd, name, ref_name(r.generation))
            else:
                try:
                    os.unlink(name, dir_fd=dir_fd)
                except FileNotFoundError:  # a pin put it back meanwhile
                    spared.add(r.root)
        for fd in self._fds.values():
            if fd is not None:
                os.fsync(fd)
        return spared

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "RefsAside":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rescue_ref(store: Store, run: str, step: str, generation: int) -> bool:
    """Put ref ``generation`` back where a gc set it aside (see :class:`RefsAside`): True once it is in place
    (it was, or is now), False where it is gone for good. A refs directory that is a symlink or not a
    directory is refused."""
    name = ref_name(generation)
    try:
        dir_fd = store.layout.open_dir(L.REFS, run, step)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise Refusal(RefusalCode.FORMAT, f"{L.REFS}/{run}/{step} is a symlink or not a directory") from exc
    try:
        if durable.entry_exists(dir_fd, name):
            return True
        for aside in sorted(n for n in os.listdir(dir_fd) if n.startswith(f"{ASIDE_PREFIX}{name}-")):
            try:
                durable.rename_noreplace(dir_fd, aside, dir_fd, name)
                os.fsync(dir_fd)
                return True
            except FileExistsError:  # put back meanwhile
                return True
            except FileNotFoundError:  # put back or removed meanwhile
                continue
        return durable.entry_exists(dir_fd, name)  # a gc may have put it back after the first look
    finally:
        os.close(dir_fd)


class PosixSweep:
    """gc's operations on a store on a file system (this module's functions, for one gc): the seam
    :func:`for_store` hands gc, beside :class:`alpha_ckpt.store.s3_sweep.S3Sweep`."""

    def __init__(self, store: Store):
        self.store = store

    def now(self) -> float:
        return time.time()

    def read_leases(self, on_hostile: Skip | None = None):
        return read_leases(self.store.layout, on_hostile)

    def object_mtime(self, digest: str) -> float:
        return object_mtime(self.store, digest)

    def output_time(self, run: str, step: str) -> float | None:
        return output_time(self.store, run, step)

    def old_tmp_files(self, before: float, skip: Skip) -> list[str]:
        return old_tmp_files(self.store, before, skip)

    def remove_tmp_files(self, names: list[str]) -> None:
        remove_tmp_files(self.store, names)

    def remove_verified_records(self, roots: list[str]) -> None:
        remove_verified_records(self.store, roots)

    def remove_leases(self, names: list[str]) -> None:
        remove_leases(self.store, names)

    def quarantined_before(self, before: float, skip: Skip) -> list[str]:
        return quarantined_before(self.store, before, skip)

    def remove_quarantined(self, names: list[str]) -> None:
        remove_quarantined(self.store, names)

    def refs_aside(self, run: str, step: str) -> list[tuple[str, str, str]]:
        return refs_aside(self.store, run, step)

    def put_back_refs(self, entries: list[tuple[str, str, str]]) -> None:
        put_back_refs(self.store, entries)

    def object_sweep(self) -> ObjectSweep:
        return ObjectSweep(self.store)

    def refs_set_aside(self, refs: list[RefRecord]) -> RefsAside:
        return RefsAside(self.store, refs)


def for_store(store: Store):
    """gc's operations on ``store``: on its file system, or on its object store; a StoreUsageError for a
    store gc cannot sweep (one kept in memory)."""
    if store.layout is not None:
        return PosixSweep(store)
    from alpha_ckpt.store.s3 import S3Backend
    if isinstance(store.backend, S3Backend):
        from alpha_ckpt.store.s3_sweep import S3Sweep
        return S3Sweep(store)
    raise StoreUsageError(f"store {store.root}: gc runs on a directory or an object store, not on this one")
