"""The POSIX file system as a storage backend (:class:`~alpha_ckpt.store.backend.StorageBackend`).

Every write goes through :func:`alpha_ckpt.store.durable.durable_commit` (or its batched form). Every read
opens relative to the store's directory descriptors with O_NOFOLLOW and requires a regular file, so
a name can never escape the store. Where things lie: :mod:`alpha_ckpt.store.layout`.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import threading
import time
from typing import Callable, Iterator, Sequence

from alpha_ckpt.store import durable
from alpha_ckpt.errors import DurableWriteError, Refusal, RefusalCode, StoreUsageError
from alpha_ckpt.store._posix import _DIR_FLAGS, _check_plain_dir, _entry_kind, _file_key, _log, _plain_subdirs, write_all
from alpha_ckpt.store import layout as L
from alpha_ckpt.store.backend import PutResult, RefDir, RefUnreadable, open_each
from alpha_ckpt.store.layout import StoreLayout, fan_of, ref_name
from alpha_ckpt.store.objects import FAN_NAME_RE, ObjectFile, Validate
from alpha_ckpt.store.refs import MAX_REF_BYTES, REF_NAME_RE
from alpha_ckpt.format.records import is_digest

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
INSTANCE_BYTES = 16
INSTANCE_RE = re.compile(r"\A[0-9a-f]{%d}\Z" % (2 * INSTANCE_BYTES))


def _store_not_a_directory(root: str) -> StoreUsageError:
    try:
        kind = durable.file_kind(os.stat(root).st_mode)
    except OSError:  # a file where a directory above it belongs
        return StoreUsageError(f"store {root!r} lies under a path that is not a directory")
    return StoreUsageError(f"store {root!r} is a {kind}, not a directory")


class PosixBackend:
    """The directories of one store on a POSIX file system, held open as descriptors."""

    def __init__(self, layout: StoreLayout, create: bool):
        self.layout = layout
        root = layout.root
        try:
            if create:
                os.makedirs(root, exist_ok=True)
            # The root is the user's path and may be a symlink; nothing below it may.
            self.root_fd = layout.open_root()
        except FileNotFoundError:
            raise StoreUsageError(f"store {root!r} does not exist") from None
        except (FileExistsError, NotADirectoryError):  # the path, or a directory on it, is a file
            raise _store_not_a_directory(root) from None
        self._objects_fd = self._tmp_fd = self._quarantine_fd = -1
        self._fan_fds: dict[str, int] = {}
        try:
            if create:
                durable.make_dirs_durable(self.root_fd, L.CREATED)
                for name in (L.REFS, L.OUTPUTS, L.PENDING):  # objects/ and tmp/ are opened just below
                    _check_plain_dir(self.root_fd, name)
            self._objects_fd = self._open_dir(L.OBJECTS)
            self._tmp_fd = self._open_dir(L.TMP) if create or self._exists(L.TMP) else -1
        except BaseException:
            self.close()
            raise
        self._fan_lock = threading.Lock()
        self._fans_to_sync = False
        self._pending_fd = -1
        # (st_dev, st_ino, st_size) of objects this handle committed or read back in full: an existing
        # object that matches is reused without reading it again (its file is read-only since its commit).
        self._known_intact: set[tuple[int, int, int]] = set()

    @property
    def tmp_fd(self) -> int:
        return self._tmp_fd

    @property
    def location(self) -> str:
        """The store's path, as the user gave it (messages name the store by it)."""
        return self.layout.root

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _open_dir(self, name: str) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=self.root_fd)
        except FileNotFoundError:
            raise StoreUsageError(f"{self.layout.root!r} is not an alpha_ckpt store (no {name}/)") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Refusal(RefusalCode.FORMAT, f"store entry {name!r} is not a plain directory") from None
            raise

    def close(self) -> None:
        for fd in [self.root_fd, self._objects_fd, self._tmp_fd, self._quarantine_fd, getattr(self, "_pending_fd", -1),
                   *self._fan_fds.values()]:
            if fd >= 0:
                os.close(fd)
        self._fan_fds.clear()
        self.root_fd = self._objects_fd = self._tmp_fd = self._quarantine_fd = self._pending_fd = -1

    def probe_write(self) -> None:
        """Create and remove a file in tmp/, where every write starts (OSError if that fails). A real
        write, not a look at permission bits; named like a live writer's temporary file (PID-RANDOM.tmp),
        so a gc meanwhile leaves it."""
        name = f"{os.getpid()}-{secrets.token_hex(8)}.tmp"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444,
                     dir_fd=self._tmp_fd)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=self._tmp_fd)

    def read_instance(self) -> str | None:
        """The store's instance id, or None when it has none (an older store, or one never opened writable)."""
        try:
            fd = os.open(L.INSTANCE, _READ_FLAGS, dir_fd=self.root_fd)
        except FileNotFoundError:
            return None
        try:
            data = os.read(fd, 2 * INSTANCE_BYTES + 2)
        finally:
            os.close(fd)
        value = data.decode("ascii", "replace").strip()
        if not INSTANCE_RE.match(value):
            raise Refusal(RefusalCode.FORMAT, f"store {self.layout.root!r}: its {L.INSTANCE} file is not an instance id")
        return value

    def make_instance(self) -> str:
        """The store's instance id, written once (NOREPLACE: of two first openers, one id stands)."""
        existing = self.read_instance()
        if existing is not None:
            return existing
        value = secrets.token_hex(INSTANCE_BYTES)
        try:
            durable.durable_commit(tmp_dir=self._tmp_fd, dest_dir=self.root_fd,
                                   write=lambda fd: write_all(fd, (value + "\n").encode("ascii")),
                                   name=L.INSTANCE, kind="instance")
        except FileExistsError:
            return self.read_instance() or value  # another opener's id stands
        return value

    def put_lease(self, name: str, body: bytes) -> None:
        """Write a pending-publish lease file ``pending/<name>`` durably (:mod:`alpha_ckpt.store.leases`)."""
        if self._pending_fd < 0:
            try:  # a store opened with create=True made it durable already
                self._pending_fd = os.open(L.PENDING, _DIR_FLAGS, dir_fd=self.root_fd)
            except FileNotFoundError:
                self._pending_fd = durable.make_dir_durable(self.root_fd, L.PENDING)
            except NotADirectoryError:
                _check_plain_dir(self.root_fd, L.PENDING)
                raise
        # Its temporary file lives in pending/ too: gc's sweep of tmp/ never meets a lease half-written.
        durable.durable_commit(tmp_dir=self._pending_fd, dest_dir=self._pending_fd,
                               write=lambda fd: write_all(fd, body), name=name, kind="lease")

    def remove_lease(self, name: str) -> None:
        """Remove lease ``name``. No directory fsync: a lease that reappears after a power cut names a dead
        process, so gc finds it stale. A failed unlink only delays collection."""
        try:
            os.unlink(name, dir_fd=self._pending_fd)
        except OSError:
            pass

    def put_output(self, run: str, step: str, name: str, data: bytes) -> str:
        """Publish ``data`` as ``outputs/<run>/<step>/<name>`` once, durably; a file of that name
        already there is kept (outputs are named by their content). Returns its absolute path."""
        out_fd = durable.make_dir_durable(self.root_fd, L.OUTPUTS)
        run_fd = durable.make_dir_durable(out_fd, run)
        step_fd = durable.make_dir_durable(run_fd, step)
        try:
            if not durable.entry_exists(step_fd, name):
                durable.durable_commit(tmp_dir=self._tmp_fd, dest_dir=step_fd, write=lambda fd: write_all(fd, data),
                                       name=name, kind="output")
        except FileExistsError:
            pass  # published meanwhile: same name, same content
        finally:
            for fd in (step_fd, run_fd, out_fd):
                os.close(fd)
        return os.path.abspath(self.layout.output_path(run, step, name))

    # ------------------------------------------------------------ objects

    def _fan_dir(self, digest: str, create: bool) -> int:
        fan = fan_of(digest)
        with self._fan_lock:
            fd = self._fan_fds.get(fan)
            if fd is None:
                if create:
                    try:
                        os.mkdir(fan, 0o755, dir_fd=self._objects_fd)
                    except FileExistsError:
                        pass
                    # objects/ is fsynced once for every fan this handle first used in a batch
                    # (see _sync_new_fans), not once per fan; even for one that existed, as an
                    # earlier process may have died between its mkdir and its fsync.
                    self._fans_to_sync = True
                fd = os.open(fan, _DIR_FLAGS, dir_fd=self._objects_fd)
                self._fan_fds[fan] = fd
            return fd

    def _sync_new_fans(self) -> None:
        """fsync objects/ if a fan directory was first used since the last time: before an object in
        it is reported durable, its fan's own name is."""
        with self._fan_lock:
            if self._fans_to_sync:
                try:
                    os.fsync(self._objects_fd)
                except OSError as exc:
                    raise DurableWriteError("dir-fsync", exc.errno or errno.EIO, f"objects/: {exc}") from exc
                self._fans_to_sync = False

    def put_objects(self, writes: Sequence[Callable[[int], str]], threads: int) -> list[PutResult]:
        """One batched durable commit of ``writes`` (see :func:`alpha_ckpt.store.durable.durable_commit_all`)."""
        names: dict[int, str] = {}
        files: dict[int, os.stat_result] = {}

        def named(i: int) -> Callable[[int], str]:
            def write_named(fd: int) -> str:
                name = writes[i](fd)
                if not is_digest(name):  # it becomes a path under objects/: never anything but a digest
                    raise Refusal(RefusalCode.FORMAT, f"object name {name!r} is not a plain 64-hex digest")
                names[i] = name
                files[i] = os.fstat(fd)  # the same inode once renamed into place
                return names[i]
            return write_named

        # The fan directory depends on the digest, known only once written.
        outcomes = durable.durable_commit_all(self._tmp_fd, [
            durable.Commit(named(i), lambda name: self._fan_dir(name, create=True)) for i in range(len(writes))],
            threads)
        out = []
        for i, outcome in enumerate(outcomes):
            created = not isinstance(outcome, FileExistsError)
            if created:
                self._known_intact.add(_file_key(files[i]))
            out.append(PutResult(names[i], files[i].st_size, created))
        self._sync_new_fans()
        return out

    def reuse_object(self, digest: str, size: int | None, validate: Validate) -> bool:
        """Whether the entry named ``digest`` may stand for the object being written; renews it if so.

        It may when it is a regular file (never followed through a symlink,
        never opened blocking) of the object's size (``size``, where known)
        whose content validates against its name: the head hashes to the name
        and every slice to the digest the head records, so it holds exactly the
        bytes being written. Anything else is set aside into quarantine/ and
        False returned (False too when the name is gone), so the caller commits
        its own copy. An object this handle committed or checked before is
        trusted on its (device, inode, size).
        """
        fan = self._fan_dir(digest, create=True)
        try:
            st = os.stat(digest, dir_fd=fan, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size) and _file_key(st) in self._known_intact:
            return self._renewed(digest)
        problem = self._damage(fan, digest, st, size, validate)
        if problem is None:
            self._known_intact.add(_file_key(st))
            return self._renewed(digest)
        if problem:
            self._quarantine(fan, digest, st, problem)
        return False

    def _renewed(self, digest: str) -> bool:
        if not self.renew_object(digest):
            return False
        self._sync_new_fans()
        return True

    def _damage(self, fan: int, digest: str, st: os.stat_result, size: int | None, validate: Validate) -> str | None:
        """What is wrong with the entry ``st`` found under ``digest``: None if intact, "" if it changed meanwhile."""
        if not stat.S_ISREG(st.st_mode):
            return f"a {durable.file_kind(st.st_mode)}, not a regular file"
        if size is not None and st.st_size != size:
            return f"{st.st_size} bytes where the object has {size}"
        try:
            fd = os.open(digest, _READ_FLAGS, dir_fd=fan)
        except FileNotFoundError:
            return ""
        except OSError as exc:
            return f"cannot be opened ({exc.strerror})"
        try:
            opened = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(opened.st_mode):
            os.close(fd)
            return ""
        with ObjectFile(fd, opened.st_size, digest) as obj:
            try:
                validate(obj, f"existing object {digest[:16]}...")
            except Refusal as refusal:
                return refusal.message
        return None

    def _quarantine(self, fan: int, digest: str, st: os.stat_result, problem: str) -> None:
        """Durably rename a damaged or hostile entry aside (never delete it: it is evidence); gc sweeps it later."""
        try:  # another writer may have set it aside and committed a good copy meanwhile: leave that one
            now = os.stat(digest, dir_fd=fan, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return
        name = f"{digest}-{int(time.time())}-{secrets.token_hex(4)}"
        if not self.move_to_quarantine(fan, digest, name, f"object {digest}"):
            return
        _log(f"alpha_ckpt: store {self.layout.root}: object {digest} was not reused: {problem}; "
             f"set aside as {L.QUARANTINE}/{name}, written again\n")

    def move_to_quarantine(self, dir_fd: int, name: str, aside: str, what: str) -> bool:
        """Durably rename ``name`` in ``dir_fd`` to ``quarantine/aside`` (False: it was gone already).

        A fresh random name: a plain rename cannot replace anything, and it moves a directory too.
        """
        if self._quarantine_fd < 0:
            self._quarantine_fd = durable.make_dir_durable(self.root_fd, L.QUARANTINE)
        try:
            os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=self._quarantine_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise DurableWriteError("quarantine", exc.errno or errno.EIO, f"setting aside {what}: {exc}") from exc
        try:
            durable.fsync_dir(self._quarantine_fd)
            durable.fsync_dir(dir_fd)
        except OSError as exc:
            raise DurableWriteError("dir-fsync", exc.errno or errno.EIO, f"setting aside {what}: {exc}") from exc
        return True

    def has_object(self, digest: str) -> bool:
        try:
            st = os.stat(f"{fan_of(digest)}/{digest}", dir_fd=self._objects_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode)

    def renew_object(self, digest: str) -> bool:
        """Touch a reused object (False if it is gone): gc spares objects younger than its grace period."""
        try:
            os.utime(f"{fan_of(digest)}/{digest}", dir_fd=self._objects_fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def open_objects(self, wanted: Sequence[tuple[str, int]], what: str) -> list[ObjectFile]:
        return open_each(self, wanted, what)  # an open is a local system call: nothing to overlap

    def open_object(self, digest: str, what: str) -> ObjectFile:
        """Open an object for reading: a regular file, never through a symlink."""
        try:
            fan = self._fan_dir(digest, create=False)
            fd = os.open(digest, _READ_FLAGS, dir_fd=fan)
        except FileNotFoundError:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {digest} is missing from the store") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Refusal(RefusalCode.FORMAT, f"{what} {digest} is a symlink or not a regular file") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise Refusal(RefusalCode.FORMAT, f"{what} {digest} is not a regular file")
        return ObjectFile(fd, st.st_size, digest)

    def read_object(self, digest: str, offset: int, length: int) -> bytes:
        with self.open_object(digest, "object") as obj:
            return obj.read_at(offset, length)

    def delete_object(self, digest: str) -> bool:
        try:
            fan = self._fan_dir(digest, create=False)
            os.unlink(digest, dir_fd=fan)
        except FileNotFoundError:
            return False
        durable.fsync_dir(fan)
        return True

    def list_objects(self, on_hostile: Callable[[str, str], None] | None = None) -> Iterator[str]:
        """Every object's name, in order: regular files named by their digest in their fan directory.

        Anything else under objects/ (a fan that is a symlink or a file, a
        FIFO, directory or symlink under an object's name, a foreign name) is
        no object of this store: it is skipped, and ``on_hostile(path, why)``
        hears of it. Nothing is followed through a symlink.
        """
        report = on_hostile or (lambda path, why: None)
        for fan in sorted(os.listdir(self._objects_fd)):
            kind = _entry_kind(self._objects_fd, fan)
            if kind is None:
                continue  # gone meanwhile
            if not (kind == "directory" and FAN_NAME_RE.match(fan)):
                report(f"{L.OBJECTS}/{fan}", f"a {kind}, not a fan directory of objects")
                continue
            try:
                fan_fd = os.open(fan, _DIR_FLAGS, dir_fd=self._objects_fd)
            except OSError:
                continue  # replaced meanwhile
            try:
                names = []
                for name in sorted(os.listdir(fan_fd)):
                    kind = _entry_kind(fan_fd, name)
                    if kind is None:
                        continue
                    if not (is_digest(name) and name.startswith(fan)):
                        report(f"{L.OBJECTS}/{fan}/{name}", f"a {kind} whose name is not an object's")
                    elif kind != "regular file":
                        report(f"{L.OBJECTS}/{fan}/{name}", f"a {kind}, not an object file")
                    else:
                        names.append(name)
            finally:
                os.close(fan_fd)
            yield from names

    # ------------------------------------------------------------ refs

    def _open_refs(self) -> int | None:
        """refs/ as a directory descriptor; None when the store has none."""
        try:
            return os.open(L.REFS, _DIR_FLAGS, dir_fd=self.root_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _not_a_directory(L.REFS, exc)

    def ref_dir(self, run: str, step: str, create: bool) -> "PosixRefDir | None":
        refs = self._open_refs()
        if refs is None:
            return None
        try:
            if create:
                run_fd = durable.make_dir_durable(refs, run)
                try:
                    return PosixRefDir(self, durable.make_dir_durable(run_fd, step))
                finally:
                    os.close(run_fd)
            try:
                run_fd = os.open(run, _DIR_FLAGS, dir_fd=refs)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise _not_a_directory(f"{L.REFS}/{run}", exc)
            try:
                return PosixRefDir(self, os.open(step, _DIR_FLAGS, dir_fd=run_fd))
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise _not_a_directory(f"{L.REFS}/{run}/{step}", exc)
            finally:
                os.close(run_fd)
        finally:
            os.close(refs)

    def runs(self) -> list[tuple[str, str]]:
        """Every (run, step) with a refs directory; symlinks and odd names are skipped."""
        out = []
        refs = self._open_refs()
        if refs is None:
            return out
        try:
            for run in sorted(_plain_subdirs(refs)):
                run_fd = os.open(run, _DIR_FLAGS, dir_fd=refs)
                try:
                    out.extend((run, step) for step in sorted(_plain_subdirs(run_fd)))
                finally:
                    os.close(run_fd)
        finally:
            os.close(refs)
        return out


class PosixRefDir(RefDir):
    """refs/RUN/STEP held open: one file per generation, named by :func:`~alpha_ckpt.store.layout.ref_name`."""

    def __init__(self, backend: PosixBackend, dir_fd: int):
        self._backend, self.fd = backend, dir_fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def numbers(self) -> list[int]:
        return sorted(int(name) for name in os.listdir(self.fd) if REF_NAME_RE.match(name))

    def read(self, generation: int) -> bytes | None:
        """The entry's type is read first (lstat), so a FIFO is never opened, a symlink never followed,
        a directory never read."""
        name = ref_name(generation)
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RefUnreadable(f"cannot be examined ({exc.strerror})", False) from None
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REF_BYTES:
            raise RefUnreadable(f"a {durable.file_kind(st.st_mode)} of {st.st_size} bytes, not a ref file "
                                f"(a regular file of at most {MAX_REF_BYTES} bytes)", True)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RefUnreadable(f"cannot open ({exc.strerror})", exc.errno == errno.ELOOP) from None
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or opened.st_size > MAX_REF_BYTES:  # replaced since the lstat
                raise RefUnreadable(f"not a regular file of at most {MAX_REF_BYTES} bytes", True)
            return os.pread(fd, MAX_REF_BYTES, 0)
        except OSError as exc:
            raise RefUnreadable(f"cannot be read ({exc.strerror})", False) from None
        finally:
            os.close(fd)

    def put(self, generation: int, body: bytes) -> None:
        durable.durable_commit(tmp_dir=self._backend.tmp_fd, dest_dir=self.fd, write=lambda fd: write_all(fd, body),
                               name=ref_name(generation), kind="ref")

    def delete(self, generation: int) -> bool:
        try:
            os.unlink(ref_name(generation), dir_fd=self.fd)
        except FileNotFoundError:
            return False
        durable.fsync_dir(self.fd)
        return True

    def set_aside(self, generation: int, aside: str, what: str) -> bool:
        """Move ref ``generation`` to ``quarantine/aside`` (a POSIX backend's own: gc's evidence)."""
        return self._backend.move_to_quarantine(self.fd, ref_name(generation), aside, what)


def _not_a_directory(path: str, exc: OSError) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return Refusal(RefusalCode.FORMAT, f"store entry {path} is a symlink or not a directory")
    return exc
