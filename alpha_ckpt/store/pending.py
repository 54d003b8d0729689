"""This process's pending-publish leases on one store (the lease file format: :mod:`.leases`)."""
from __future__ import annotations

import os
import secrets
import socket
import threading
import time

from alpha_ckpt.store import durable
from alpha_ckpt.store._posix import _DIR_FLAGS, _check_plain_dir, write_all
from alpha_ckpt.store.leases import PENDING_DIR, Lease, process_start


class PublishLease:
    """A held pending-publish lease: :meth:`release` it (or use it as a context manager)."""

    def __init__(self, book: "_LeaseBook", key: tuple[str, str]):
        self._book, self._key, self._held = book, key, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._book.release(self._key)

    def __enter__(self) -> "PublishLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _LeaseBook:
    """This process's lease files on one store: one per (run, step), shared by overlapping publishes."""

    def __init__(self, root_fd: int):
        self._root_fd, self._dir_fd = root_fd, -1
        self._held: dict[tuple[str, str], list] = {}  # (run, step) -> [file name, holders]
        self._lock = threading.Lock()

    def acquire(self, run: str, step: str) -> PublishLease:
        with self._lock:
            entry = self._held.get((run, step))
            if entry is None:
                entry = self._held[(run, step)] = [self._write(run, step), 0]
            entry[1] += 1
        return PublishLease(self, (run, step))

    def _write(self, run: str, step: str) -> str:
        if self._dir_fd < 0:
            try:  # a store opened with create=True made it durable already
                self._dir_fd = os.open(PENDING_DIR, _DIR_FLAGS, dir_fd=self._root_fd)
            except FileNotFoundError:
                self._dir_fd = durable.make_dir_durable(self._root_fd, PENDING_DIR)
            except NotADirectoryError:
                _check_plain_dir(self._root_fd, PENDING_DIR)
                raise
        pid = os.getpid()
        lease = Lease(f"{pid}-{secrets.token_hex(8)}", run, step, pid, process_start(pid), socket.gethostname(),
                      time.time())
        body = lease.to_bytes()
        # Its temporary file lives in pending/ too: gc's sweep of tmp/ never meets a lease half-written.
        durable.durable_commit(tmp_dir=self._dir_fd, dest_dir=self._dir_fd, write=lambda fd: write_all(fd, body),
                               name=lease.name, kind="lease")
        return lease.name

    def release(self, key: tuple[str, str]) -> None:
        with self._lock:
            entry = self._held[key]
            entry[1] -= 1
            if entry[1]:
                return
            del self._held[key]
            try:
                # No directory fsync: a lease that reappears after a power cut names a dead
                # process, so gc finds it stale. A failed unlink only delays collection.
                os.unlink(entry[0], dir_fd=self._dir_fd)
            except OSError:
                pass

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

