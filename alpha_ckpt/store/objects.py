"""An object of the store opened for reading, mapped into memory."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
from typing import Callable

import numpy as np

from alpha_ckpt.errors import Refusal, RefusalCode

FAN_NAME_RE = re.compile(r"\A[0-9a-f]{2}\Z")
_MADV_POPULATE_READ = 22  # Linux 5.14+; not exported by Python's mmap module
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

    def __init__(self, fd: int, size: int, digest: str):
        self.fd, self.size, self.digest = fd, size, digest
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
        # The map's address, for madvise through ctypes (which, unlike mmap.madvise,
        # releases the GIL while the kernel reads: verifiers hash meanwhile).
        self._address = np.frombuffer(self._map, dtype=np.uint8).ctypes.data if size else 0

    def view(self) -> memoryview:
        return memoryview(self._map) if self._map is not None else memoryview(b"")

    def populate(self, offset: int, length: int) -> None:
        """Read [offset, offset + length) in and map it now (one call, not one fault per page)."""
        if length <= 0 or self._map is None:
            return
        start = offset - offset % mmap.PAGESIZE
        err = _madvise(self._address + start, offset + length - start, _MADV_POPULATE_READ)
        if err == errno.EINVAL:  # kernels before 5.14: start readahead, faults do the rest
            err = _madvise(self._address + start, offset + length - start, mmap.MADV_WILLNEED)
        if err == errno.EFAULT:  # the file shrank under us; touching it would SIGBUS
            raise Refusal(RefusalCode.CORRUPT_SHARD, f"object {self.digest[:16]}... shrank while being read")
        if err:
            raise Refusal(RefusalCode.CORRUPT_SHARD, f"object {self.digest[:16]}... cannot be read: {os.strerror(err)}")

    def read_at(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def close(self) -> None:
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


# Checks an existing object file's content against its name (a Refusal if it does not match).
Validate = Callable[[ObjectFile, str], object]
