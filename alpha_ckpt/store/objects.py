"""An object of the store opened for reading, mapped into memory."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
from typing import Callable, Protocol

import numpy as np

from alpha_ckpt.errors import Refusal, RefusalCode

FAN_NAME_RE = re.compile(r"\A[0-9a-f]{2}\Z")
_MADV_POPULATE_READ = 22  # Linux 5.14+; not exported by Python's mmap module
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def _madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) with the GIL released; returns 0 or the errno."""
    return 0 if _libc.madvise(address, length, advice) == 0 else ctypes.get_errno()


class ObjectFile:
    """A read-only, validated-to-be-regular object file, mapped into memory.

    The map is shared and read-only: the page-cache pages themselves, no copy
    (a private writable mapping would be copied page by page when populated).
    Pages are brought in by :meth:`populate`, range by range, so verifying one
    range overlaps reading the next.
    """

    # True once every slice of the object was validated whole by the rank of this node that read it from the
    # store (alpha_ckpt.collective.node_reads): a restore then skips hashing its bytes again.
    checked = False

    def __init__(self, fd: int, size: int, digest: str):
        self.fd, self.size, self.digest = fd, size, digest
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
        # The map's address, for madvise through ctypes (which, unlike mmap.madvise,
        # releases the GIL while the kernel reads: verifiers hash meanwhile).
        self._address = np.frombuffer(self._map, dtype=np.uint8).ctypes.data if size else 0
        self._arrival: Arrival | None = None

    @classmethod
    def in_memory(cls, size: int, digest: str) -> "ObjectFile":
        """An object to be filled in this process's memory (what an object store's read lands in): anonymous
        pages, allocated ahead of each copy by :meth:`prepare_fill`. Filling and freeing a file in memory
        (memfd) cost about twice as much (shared pages, faulted one by one under the GIL). Transparent huge
        pages are not asked for: filling 1 GiB on them took 0.65 s or 1.4 s from run to run, 0.8 s on 4 KiB
        pages every time. Fill it through :meth:`fill_view`, and hand what fills it to :meth:`arriving`."""
        obj = cls.__new__(cls)
        obj.fd, obj.size, obj.digest = -1, size, digest
        obj._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) if size else None
        obj._address = np.frombuffer(obj._map, dtype=np.uint8).ctypes.data if size else 0
        obj._arrival = None
        return obj

    def fill_view(self) -> memoryview:
        """A writable view of an :meth:`in_memory` object, for what fills it (never waits for the fill)."""
        return memoryview(self._map) if self._map is not None else memoryview(b"")

    def arriving(self, arrival: "Arrival") -> None:
        """The object's bytes are still arriving: every read of it first waits for them (:meth:`view` for all
        of them, :meth:`populate` and :meth:`read_at` for their range) and raises the refusal, every time, if
        they cannot arrive."""
        self._arrival = arrival

    def _arrived(self, offset: int = 0, length: int | None = None) -> None:
        if self._arrival is not None:
            self._arrival.wait(offset, length)

    def view(self) -> memoryview:
        self._arrived()
        return memoryview(self._map) if self._map is not None else memoryview(b"")

    def populate(self, offset: int, length: int) -> None:
        """Read [offset, offset + length) in and map it now (one call, not one fault per page)."""
        self._arrived(offset, length)
        if length <= 0 or self._map is None or self.fd < 0:  # an object in memory is in place already
            return
        start = offset - offset % mmap.PAGESIZE
        err = _madvise(self._address + start, offset + length - start, _MADV_POPULATE_READ)
        if err == errno.EINVAL:  # kernels before 5.14: start readahead, faults do the rest
            err = _madvise(self._address + start, offset + length - start, mmap.MADV_WILLNEED)
        if err == errno.EFAULT:  # the file shrank under us; touching it would SIGBUS
            raise Refusal(RefusalCode.CORRUPT_SHARD, f"object {self.digest[:16]}... shrank while being read")
        if err:
            raise Refusal(RefusalCode.CORRUPT_SHARD, f"object {self.digest[:16]}... cannot be read: {os.strerror(err)}")

    def prepare_fill(self, offset: int, length: int) -> None:
        """Allocate the pages of [offset, offset + length) of an :meth:`in_memory` object now, with the GIL
        released: faulted in by the copy that fills them instead, each fault would hold the GIL and stall
        every other thread's download. Best effort: the copy faults in what this leaves."""
        if length > 0 and self._map is not None and self.fd < 0:
            start = offset - offset % mmap.PAGESIZE
            _madvise(self._address + start, offset + length - start, _MADV_POPULATE_WRITE)

    def read_at(self, offset: int, length: int) -> bytes:
        self._arrived(offset, length)
        if self.fd < 0:
            return bytes(self._map[offset:offset + length]) if self._map is not None else b""
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
        if self._arrival is not None:
            self._arrival.abandon()  # nothing may still be writing into the memory about to be unmapped
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere; the GC will unmap it
                pass
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "ObjectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Arrival(Protocol):
    """What is still filling an :meth:`ObjectFile.in_memory` object (an object store's reads)."""

    def wait(self, offset: int = 0, length: int | None = None) -> None:
        """Until bytes [offset, offset + length) (every byte, for None) are in place; a Refusal (the same each
        call) if they cannot all be."""

    def abandon(self) -> None:
        """Stop filling: cancel what has not started, wait for what has."""


# Checks an existing object file's content against its name (a Refusal if it does not match).
Validate = Callable[[ObjectFile, str], object]
