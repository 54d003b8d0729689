"""The one durable-commit function: every file the store publishes goes through it.

Stages, in order (each has a named fault point, see :data:`FAULT_POINTS`):

    write payload to STORE/tmp/<unique>   (the caller's ``write`` callback)
    fsync(file)  -> close                 an fsync error is final, never retried
    renameat2(RENAME_NOREPLACE) into place  (link()+unlink() where EINVAL)
    fsync(destination directory)

A crash at any point leaves either nothing visible or the complete file: the
temporary name is never published, and NOREPLACE means a published name is
never overwritten.

Each stage calls :func:`alpha_ckpt.runtime.hooks.fault_point` with the file's kind (``object``,
``ref``, ``output``, ``export``, ``lease``, ``pin``); the default hooks do nothing. Test support
installs hooks that SIGKILL the process there (:mod:`alpha_ckpt.runtime.faults`, also from
the environment). Publishers add ``publish:before-completion``: an owner dies
holding the durable-completion acknowledgment, before passing it on or reporting the update
committed.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Sequence

from alpha_ckpt.errors import DurableWriteError
from alpha_ckpt.runtime.hooks import fault_point

FAULT_POINTS = (
    "before-data-fsync",
    "after-data-fsync",
    "before-rename",
    "after-rename",
    "before-dir-fsync",
    "after-dir-fsync",
)
_RENAME_NOREPLACE = 1

_fault = fault_point


_libc = ctypes.CDLL(None, use_errno=True)


class _Renamer:
    """renameat2(RENAME_NOREPLACE) through libc, with the link()+unlink() fallback."""

    def __init__(self) -> None:
        self._renameat2 = getattr(_libc, "renameat2", None)
        if self._renameat2 is not None:
            self._renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            self._renameat2.restype = ctypes.c_int

    def renameat2_noreplace(self, src_dir: int, src: str, dst_dir: int, dst: str) -> None:
        if self._renameat2 is None:
            raise OSError(errno.EINVAL, "renameat2 not available in libc")
        rc = self._renameat2(src_dir, os.fsencode(src), dst_dir, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def rename_noreplace(self, src_dir: int, src: str, dst_dir: int, dst: str) -> str:
        """Move ``src`` to ``dst`` unless ``dst`` exists (FileExistsError). Returns the method used."""
        try:
            self.renameat2_noreplace(src_dir, src, dst_dir, dst)
            return "renameat2"
        except OSError as exc:
            # EINVAL: the file system (NFS, Lustre, Ceph, FUSE) has no RENAME_NOREPLACE.
            # ENOSYS: the kernel has no renameat2. Anything else is a real error.
            if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
        os.link(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
        try:
            # On NFS a lost reply can make link() report failure after success
            # and vice versa; the link count is the truth.
            if os.stat(dst, dir_fd=dst_dir, follow_symlinks=False).st_nlink < 2:
                raise OSError(errno.EIO, f"link to {dst} did not take")
        finally:
            os.unlink(src, dir_fd=src_dir)
        return "link"


_renamer = _Renamer()

_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range back now (no wait, no durability promise).

    The final fsync then has little left to do, so disk writes overlap the
    remaining encoding and hashing. Only a hint: errors surface at fsync.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def rename_noreplace(src_dir: int, src: str, dst_dir: int, dst: str) -> str:
    return _renamer.rename_noreplace(src_dir, src, dst_dir, dst)


def fsync_dir(dir_fd: int) -> None:
    os.fsync(dir_fd)


@dataclass(frozen=True)
class Commit:
    """One file for :func:`durable_commit_all`: as the arguments of :func:`durable_commit`."""
    write: Callable[[int], str | None]
    dest_dir: int | Callable[[str], int]
    name: str | None = None
    kind: str = "object"


def durable_commit(
    *,
    tmp_dir: int,
    dest_dir: int | Callable[[str], int],
    write: Callable[[int], str | None],
    name: str | None = None,
    kind: str = "object",
) -> str:
    """Durably publish one file and return its final name.

    ``write(fd)`` writes the whole content to a fresh temporary file and may
    return the final name (content-addressed objects learn their name while
    writing); otherwise ``name`` is used. ``dest_dir`` may be a callable that
    maps the final name to a directory descriptor. Raises ``FileExistsError`` when the
    name is taken (callers decide: dedup for objects, conflict for refs) and
    :class:`DurableWriteError` for any I/O failure. The temporary file never
    outlives a failure of this process.
    """
    (outcome,) = durable_commit_all(tmp_dir, [Commit(write, dest_dir, name, kind)])
    if isinstance(outcome, FileExistsError):
        raise outcome
    return outcome


def durable_commit_all(tmp_dir: int, commits: Sequence[Commit],
                       write_threads: int = 1) -> list[str | FileExistsError]:
    """Durably publish several files, each as :func:`durable_commit` does, with the stages batched.

    Every file is written, then every file fsynced and closed, then every one renamed
    into place, then each destination directory fsynced once. A file's fsync thus
    waits only for what is still unwritten when all are written: the disk streams
    the whole batch (as one large file would), and renames of many files in one
    directory cost one directory fsync. Returns each file's final name, or the
    ``FileExistsError`` of one whose name was taken (its temporary file removed; the
    others still published). Any other failure raises :class:`DurableWriteError`
    with no temporary file left; files renamed before it stay published, none is
    half-written. Every descriptor stays open from its write to its fsync, so a
    writeback error is reported to the fsync that must see it. ``write_threads``:
    how many files are written at once (each ``write`` callback must then be safe to
    run beside the others); after a failed write none not yet started is begun, the
    lowest-numbered failure is raised, and nothing is fsynced or renamed.
    """
    files: list[list | None] = [None] * len(commits)  # [temporary name, fd or -1 once closed, final name, published]
    outcomes: list[str | FileExistsError] = []
    try:
        stage = "write"
        try:
            def write_one(i: int) -> None:
                tmp_name = f"{os.getpid()}-{secrets.token_hex(8)}.tmp"
                # Read-only once published: nothing is meant to modify an object or a ref in place.
                fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444,
                             dir_fd=tmp_dir)
                files[i] = file = [tmp_name, fd, None, False]
                final = commits[i].write(fd) or commits[i].name
                if not final:
                    raise ValueError("durable_commit needs a name from write() or the name argument")
                file[2] = final

            threads = min(write_threads, len(commits))
            if threads <= 1:
                for i in range(len(commits)):
                    write_one(i)
            else:
                with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="alpha-ckpt-write") as pool:
                    futures = [pool.submit(write_one, i) for i in range(len(commits))]
                    wait(futures, return_when=FIRST_EXCEPTION)
                    for f in futures:  # after a failure, the writes not yet started never start
                        f.cancel()
                # (the pool has joined: every started write has ended before any temporary file is removed)
                for f in futures:
                    if not f.cancelled():
                        f.result()
            stage = "data-fsync"
            for commit, file in zip(commits, files):
                _fault(commit.kind, "before-data-fsync")
                fd, file[1] = file[1], -1
                try:
                    os.fsync(fd)  # never retried: see DurableWriteError
                finally:
                    os.close(fd)
                _fault(commit.kind, "after-data-fsync")
        except OSError as exc:
            raise DurableWriteError(stage, exc.errno or errno.EIO, str(exc)) from exc
        synced: dict[int, str] = {}  # destination directories to fsync, with a kind for their fault points
        for commit, file in zip(commits, files):
            dest_dir = commit.dest_dir(file[2]) if callable(commit.dest_dir) else commit.dest_dir
            _fault(commit.kind, "before-rename")
            try:
                rename_noreplace(tmp_dir, file[0], dest_dir, file[2])
            except FileExistsError as exc:
                outcomes.append(exc)
                continue
            except OSError as exc:
                raise DurableWriteError("rename", exc.errno or errno.EIO, str(exc)) from exc
            file[3] = True
            outcomes.append(file[2])
            _fault(commit.kind, "after-rename")
            synced.setdefault(dest_dir, commit.kind)
        for dest_dir, kind in synced.items():
            _fault(kind, "before-dir-fsync")
            try:
                fsync_dir(dest_dir)
            except OSError as exc:
                raise DurableWriteError("dir-fsync", exc.errno or errno.EIO, str(exc)) from exc
            _fault(kind, "after-dir-fsync")
        return outcomes
    finally:
        for tmp_name, fd, _, published in filter(None, files):
            if fd >= 0:
                os.close(fd)
            if not published:
                try:
                    os.unlink(tmp_name, dir_fd=tmp_dir)
                except FileNotFoundError:
                    pass


def make_dir_durable(parent_fd: int, name: str) -> int:
    """mkdir ``name`` under ``parent_fd`` (if missing), fsync the parent, return an fd of it.

    The parent is fsynced even when the directory already exists: an earlier
    process may have died between its mkdir and its fsync.
    """
    make_dirs_durable(parent_fd, [name])
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)


def make_dirs_durable(parent_fd: int, names: Sequence[str]) -> None:
    """mkdir each of ``names`` under ``parent_fd`` (if missing), then fsync the parent once.

    One fsync makes every entry of the parent durable, so creating many directories costs
    one journal commit, not one each (as for :func:`make_dir_durable`, existing ones are
    covered too: an earlier process may have died before its fsync).
    """
    for name in names:
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        os.fsync(parent_fd)
    except OSError as exc:
        raise DurableWriteError("dir-fsync", exc.errno or errno.EIO,
                                f"making {', '.join(map(repr, names))} durable: {exc}") from exc


def entry_exists(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is an entry of the directory ``dir_fd`` (a symlink is not followed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def file_kind(mode: int) -> str:
    """What a directory entry of this mode is, in words (for messages about entries that are not ours)."""
    for test, kind in ((stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISREG, "regular file")):
        if test(mode):
            return kind
    return "special file"
