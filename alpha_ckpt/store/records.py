"""The verified directory's files: STORE/verified/<root>, what a completeness check validated.

What a record holds and when it is trusted is :mod:`alpha_ckpt.upkeep.complete`; this module only reads,
writes (through the one durable commit) and lists the files, and takes an object file's identity.
"""
from __future__ import annotations

import os
import stat

from alpha_ckpt.store import durable
from alpha_ckpt.format.records import is_digest
from alpha_ckpt.store._posix import write_all
from alpha_ckpt.store.layout import DIR_FLAGS, TMP, VERIFIED
from alpha_ckpt.store.store import Store

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def object_identity(store: Store, digest: str) -> list[int] | None:
    """[st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns] of the object's file (lstat), or None where it
    is not a regular file: a write into it, a replacement, a chmod or a renewal changes it."""
    if store.layout is None:
        return None  # objects that are not files: no identity to record, so no record is trusted
    try:
        st = os.stat(store.object_path(digest), follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _verified_dir(store: Store) -> int | None:
    """The records' directory, never through a symlink; None where there is none (or something else)."""
    if store.layout is None:
        return None
    try:
        return store.layout.open_dir(VERIFIED)
    except OSError:
        return None


def read_record_file(store: Store, root: str, max_bytes: int) -> bytes | None:
    """The bytes of ``root``'s record, or None (absent, not a regular file, larger than ``max_bytes``)."""
    dir_fd = _verified_dir(store)
    if dir_fd is None:
        return None
    try:
        fd = os.open(root, _FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        return os.pread(fd, st.st_size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_record_file(store: Store, root: str, data: bytes) -> None:
    """Replace ``root``'s record with ``data``, durably (best effort: a record that cannot be written only
    costs a later validation)."""
    if store.layout is None:
        return
    try:
        root_fd = store.layout.open_root()
        try:
            tmp_fd = os.open(TMP, DIR_FLAGS, dir_fd=root_fd)
            try:
                dir_fd = durable.make_dir_durable(root_fd, VERIFIED)
            except BaseException:
                os.close(tmp_fd)
                raise
        finally:
            os.close(root_fd)
        try:
            try:
                os.unlink(root, dir_fd=dir_fd)  # an outdated record: replaced, never trusted again
            except FileNotFoundError:
                pass
            durable.durable_commit(tmp_dir=tmp_fd, dest_dir=dir_fd, write=lambda fd: write_all(fd, data),
                                   name=root, kind="verified")
        finally:
            os.close(tmp_fd)
            os.close(dir_fd)
    except (OSError, FileExistsError):
        pass


def record_names(store: Store) -> list[str]:
    """The roots with a record (plain digest names only; no directory, or a hostile one: none)."""
    dir_fd = _verified_dir(store)
    if dir_fd is None:
        return []
    try:
        return sorted(n for n in os.listdir(dir_fd) if is_digest(n))
    finally:
        os.close(dir_fd)
