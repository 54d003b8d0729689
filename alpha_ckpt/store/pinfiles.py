"""The pins directory's files: STORE/pins/<root digest>, one per pinned generation.

What a pin means and when one may be taken is :mod:`alpha_ckpt.upkeep.pins`; this module only lists, reads,
writes (through the one durable commit) and removes the files, never through a symlink and never
opening what is not a regular file.
"""
from __future__ import annotations

import errno
import os
import stat
from typing import Callable

from alpha_ckpt.store import durable
from alpha_ckpt.store.durable import file_kind
from alpha_ckpt.errors import Refusal, RefusalCode, StoreUsageError
from alpha_ckpt.format.records import is_digest
from alpha_ckpt.store._posix import write_all
from alpha_ckpt.store.layout import DIR_FLAGS, PINS, TMP
from alpha_ckpt.store.store import Store


def _not_a_directory(exc: OSError) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return Refusal(RefusalCode.FORMAT, f"store entry {PINS} is a symlink or not a directory")
    return exc


def _refuse_object_store(store: Store) -> None:
    if store.layout is None:  # an object store's pins: alpha_ckpt.store.s3_sweep
        raise StoreUsageError(f"store {store.root}: its pins are not files")


def _open_pins_dir(store: Store) -> int | None:
    """The pins directory (never through a symlink), or None where there is none."""
    _refuse_object_store(store)
    try:
        return store.layout.open_dir(PINS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _not_a_directory(exc) from None


def pin_names(store: Store, on_hostile: Callable[[str, str], None] | None = None) -> set[str]:
    """Every digest-named entry of STORE/pins; ``on_hostile(path, why)`` hears of those that are not regular
    files (their names still count)."""
    dir_fd = _open_pins_dir(store)
    if dir_fd is None:
        return set()
    try:
        roots = set()
        for name in os.listdir(dir_fd):
            if not is_digest(name):
                continue
            roots.add(name)
            if on_hostile is not None:
                try:
                    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(mode):
                    on_hostile(f"{PINS}/{name}", f"a {file_kind(mode)}, not a pin file (its root stays pinned)")
        return roots
    finally:
        os.close(dir_fd)


def read_pin_file(store: Store, root: str, max_bytes: int) -> bytes | Refusal | None:
    """Up to ``max_bytes + 1`` bytes of the pin file of ``root``; a refusal where it cannot be read as one
    (never opened blocking, a FIFO or a directory never read); None where there is none."""
    dir_fd = _open_pins_dir(store)
    if dir_fd is None:
        return None
    try:
        try:
            fd = os.open(root, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return Refusal(RefusalCode.FORMAT, f"pin {root}: cannot open ({exc.strerror})")
    finally:
        os.close(dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # a FIFO or a directory: never read (it could block or fail)
            return Refusal(RefusalCode.FORMAT, f"pin {root}: a {file_kind(mode)}, not a pin file")
        return os.pread(fd, max_bytes + 1, 0)
    finally:
        os.close(fd)


class PinFiles:
    """The pins directory held open for changes (made durable if new); with ``commits``, tmp/ too, for
    :meth:`commit`."""

    def __init__(self, store: Store, commits: bool = False):
        self._fd = self._tmp_fd = -1
        _refuse_object_store(store)
        self._root_fd = store.layout.open_root()
        try:
            try:
                self._fd = durable.make_dir_durable(self._root_fd, PINS)
            except OSError as exc:
                raise _not_a_directory(exc) from None
            if commits:
                self._tmp_fd = os.open(TMP, DIR_FLAGS, dir_fd=self._root_fd)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in (self._tmp_fd, self._fd, self._root_fd):
            if fd >= 0:
                os.close(fd)
        self._tmp_fd = self._fd = self._root_fd = -1

    def __enter__(self) -> "PinFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def refuse_unless_pin_file(self, root: str, doing: str) -> None:
        """Only a regular file is a pin file of ours: anything else under a pin's name is left as it is."""
        try:
            mode = os.stat(root, dir_fd=self._fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISREG(mode):
            raise Refusal(RefusalCode.FORMAT, f"{PINS}/{root} is a {file_kind(mode)}, not a pin file: it is left as "
                          f"it is, and the generation cannot be {doing} until it is removed by hand")

    def remove(self, root: str) -> bool:
        """Unlink the pin file, then fsync the directory; False where there was none."""
        try:
            os.unlink(root, dir_fd=self._fd)
        except FileNotFoundError:
            return False
        os.fsync(self._fd)
        return True

    def commit(self, root: str, body: bytes) -> None:
        """Durably write the pin file of ``root`` (FileExistsError if one appeared meanwhile)."""
        durable.durable_commit(tmp_dir=self._tmp_fd, dest_dir=self._fd, write=lambda fd: write_all(fd, body),
                               name=root, kind="pin")
