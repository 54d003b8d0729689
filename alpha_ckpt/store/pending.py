"""This process's pending-publish leases on one store (the lease file format: :mod:`.leases`)."""
from __future__ import annotations

import functools
import os
import secrets
import socket
import threading
import time

from typing import TYPE_CHECKING

from alpha_ckpt.store.leases import Lease, process_start

if TYPE_CHECKING:
    from alpha_ckpt.store.backend import StorageBackend


@functools.lru_cache(maxsize=4)
def _own_start(pid: int) -> int | None:
    """This process's start time, read once per process (a fork has another pid): not once per publish."""
    return process_start(pid)


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
    """This process's lease files on one store: one per (run, step), shared by overlapping publishes.
    The book says what a lease is; the store's backend keeps it (:meth:`StorageBackend.put_lease`)."""

    def __init__(self, backend: "StorageBackend"):
        self._backend = backend
        self._held: dict[tuple[str, str], list] = {}  # (run, step) -> [lease name, holders]
        self._lock = threading.Lock()

    def acquire(self, run: str, step: str) -> PublishLease:
        with self._lock:
            entry = self._held.get((run, step))
            if entry is None:
                entry = self._held[(run, step)] = [self._write(run, step), 0]
            entry[1] += 1
        return PublishLease(self, (run, step))

    def _write(self, run: str, step: str) -> str:
        pid = os.getpid()
        lease = Lease(f"{pid}-{secrets.token_hex(8)}", run, step, pid, _own_start(pid), socket.gethostname(),
                      time.time())
        self._backend.put_lease(lease.name, lease.to_bytes())
        return lease.name

    def release(self, key: tuple[str, str]) -> None:
        with self._lock:
            entry = self._held[key]
            entry[1] -= 1
            if entry[1]:
                return
            del self._held[key]
            self._backend.remove_lease(entry[0])
