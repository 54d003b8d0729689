"""File-system helpers of the POSIX store: directory descriptors, entry kinds, plain writes."""
from __future__ import annotations

import os
import stat

from alpha_ckpt.store import durable
from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import check_name
from alpha_ckpt.store.layout import DIR_FLAGS

_DIR_FLAGS = DIR_FLAGS


def _check_plain_dir(dir_fd: int, name: str) -> None:
    """A store's own subdirectory must be one (not a file, a FIFO or a symlink): a Refusal naming it."""
    kind = _entry_kind(dir_fd, name)
    if kind not in (None, "directory"):
        raise Refusal(RefusalCode.FORMAT, f"store entry {name!r} is not a plain directory (a {kind})")


def _file_key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_dev, st.st_ino, st.st_size


def _entry_kind(dir_fd: int, name: str) -> str | None:
    """What the directory entry ``name`` is (never followed through a symlink), or None if it is gone."""
    try:
        return durable.file_kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return None


def _log(line: str) -> None:
    """One line on stderr in one write(2), so lines of concurrent writers do not interleave."""
    try:
        os.write(2, line.encode("utf-8", "replace"))
    except OSError:
        pass


def _plain_subdirs(dir_fd: int) -> list[str]:
    names = []
    for name in os.listdir(dir_fd):
        try:
            check_name(name, "name")
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except (Refusal, OSError):
            continue
        if stat.S_ISDIR(st.st_mode):
            names.append(name)
    return names


def write_all(fd: int, data) -> None:
    """os.write until every byte is written (a short write is not an error)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]

