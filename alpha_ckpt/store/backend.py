"""The storage interface under a :class:`~alpha_ckpt.store.Store`: the few operations it needs.

A backend holds two kinds of things: **objects**, immutable byte strings named
by their digest (64 hex), and **refs**, small records numbered 1, 2, 3... per
(run, step), the newest of which is the run's *head*. Everything else a store
knows (what a name means, which refs make a history, when an existing object
may be reused, fencing) lives above it, in the Store.

Call order of a publish, as :class:`~alpha_ckpt.store.Store` makes it::

    put_objects([...shards...])          durable when it returns; a name taken is reported, not overwritten
    reuse_object(name, size, validate)   for each name taken: may the object there stand for ours?
    put_objects([...manifests...])       the same, for what names the shards
    with ref_dir(run, step, create=True) as refs:
        refs.numbers(); refs.read(n)     the history, newest first
        refs.cas_head(top, body)         the next generation, only if no one took it meanwhile

A restore reads: ``ref_dir(...).read(n)`` then ``open_objects`` / ``open_object`` / ``read_object``.

Guarantees every backend gives:

- ``put_objects``: each object is durable under its name before the call
  returns, written whole or not at all (the POSIX backend's one
  :func:`alpha_ckpt.store.durable.durable_commit_all`: write to tmp, fsync,
  rename without replacing, fsync the directory). A name already present is
  never overwritten: its slot says so (``created=False``).
- Objects are never modified once put: a reader of a name reads the bytes it
  was put with, or the name is gone (deleted), never other bytes.
- ``RefDir.put`` publishes a ref only if its number is free
  (``RENAME_NOREPLACE``; on an object store, a conditional put such as
  ``If-None-Match: *``): of two publishers of one number exactly one wins,
  and the other gets FileExistsError. ``RefDir.cas_head(expected, body)`` is
  the compare-and-swap of the run's head built on it: the head moves from
  ``expected`` to ``expected + 1`` only if no one took ``expected + 1``.
- ``list_objects`` and ``RefDir.numbers`` list what was durably put and not
  deleted; what is not an object or a ref of this backend is skipped (and
  reported where the caller asks).
- ``delete_object`` / ``RefDir.delete`` remove durably; deleting what is gone
  is not an error (False).

An object is written through a file descriptor its backend hands the writer
(``write(fd)`` writes the bytes and returns the name): a file under tmp/ for
the POSIX backend; an anonymous memory file (``os.memfd_create``) for a
backend that keeps bytes in memory. A writer that can also describe its
object as :class:`ObjectContent` (``write.content()``: the name, the size,
and the bytes as memory segments, e.g. a shard's tensors) lets a backend read
it where it lies: an object store uploads parts straight from tensor memory,
with no copy of the whole object (:func:`content_of`). Implementations: :class:`PosixBackend <alpha_ckpt.store.posix.PosixBackend>`
(the file system) and :class:`InMemoryBackend <alpha_ckpt.store.in_memory.InMemoryBackend>`
(everything in this process's memory, no file touched);
:class:`S3Backend <alpha_ckpt.store.s3.S3Backend>` (an S3-compatible object store, with conditional writes);
:class:`ReadThroughBackend <alpha_ckpt.store.read_through.ReadThroughBackend>`
reads what one backend lacks from others (the memory tier's view of a node).
``tests/unit/test_store_backend.py`` runs one contract against each.
"""
from __future__ import annotations

import io
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.store.objects import ObjectFile, Validate


@dataclass(frozen=True)
class ObjectContent:
    """An object described where its bytes lie: ``segments`` are (offset, bytes) in ascending, non-overlapping
    order; what no segment covers up to ``size`` is zero (alignment padding)."""

    name: str
    size: int
    segments: tuple[tuple[int, memoryview], ...]

    def reader(self, start: int = 0, end: int | None = None) -> "ContentReader":
        """A seekable binary stream of bytes [start, end) (an HTTP body), read from the segments, not copied."""
        return ContentReader(self, start, self.size if end is None else end)


class ContentReader(io.RawIOBase):
    """Bytes [start, end) of an :class:`ObjectContent`, as a seekable stream: each read copies only what it
    returns, from the segments (tensor memory), zeros between them."""

    def __init__(self, content: ObjectContent, start: int, end: int):
        super().__init__()
        self._segments, self._start, self._end, self._pos = content.segments, start, end, start
        self._at = 0  # index of the first segment that may hold _pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return self._end - self._start

    def tell(self) -> int:
        return self._pos - self._start

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self._start, io.SEEK_CUR: self._pos, io.SEEK_END: self._end}[whence]
        pos = min(max(self._start, base + offset), self._end)
        if pos < self._pos:
            self._at = 0
        self._pos = pos
        return pos - self._start

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        want = min(len(out), self._end - self._pos)
        done = 0
        segments = self._segments
        while done < want:
            pos = self._pos + done
            while self._at < len(segments) and segments[self._at][0] + len(segments[self._at][1]) <= pos:
                self._at += 1
            if self._at == len(segments) or segments[self._at][0] > pos:  # a gap: zeros up to the next segment
                stop = segments[self._at][0] if self._at < len(segments) else self._end
                n = min(want - done, stop - pos)
                out[done:done + n] = bytes(n)
            else:
                offset, view = segments[self._at]
                n = min(want - done, offset + len(view) - pos)
                out[done:done + n] = view[pos - offset:pos - offset + n]
            done += n
        self._pos += done
        return done


def content_of(write: Callable[[int], str]) -> tuple[ObjectContent, Callable[[], None]]:
    """The object ``write`` makes, as :class:`ObjectContent`, and what releases it once used: ``write.content()``
    where the writer has it (no copy), else the bytes written into an anonymous memory file and mapped."""
    describe = getattr(write, "content", None)
    if describe is not None:
        return describe(), lambda: None
    fd = os.memfd_create("alpha-ckpt-object", os.MFD_CLOEXEC)
    try:
        name = write(fd)
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
    view = memoryview(mapped) if mapped is not None else memoryview(b"")

    def release() -> None:
        view.release()
        if mapped is not None:
            mapped.close()
    return ObjectContent(name, size, ((0, view),) if size else ()), release


class ObjectWriter:
    """A writer of one object that is both ``write(fd) -> name`` and ``content() -> ObjectContent``."""

    def __init__(self, write: Callable[[int], str], content: Callable[[], ObjectContent]):
        self._write, self.content = write, content

    def __call__(self, fd: int) -> str:
        return self._write(fd)


@dataclass(frozen=True)
class PutResult:
    """One object of :meth:`StorageBackend.put_objects`: its name, size, and whether this call created it
    (False: the name was taken already, and what is there was left as it is)."""

    name: str
    size: int
    created: bool


class RefUnreadable(Exception):
    """A ref whose number is taken but whose record cannot be read: ``why``; ``damaged``: never will be
    (not a record at all), as opposed to a refusal of the medium (EACCES, EIO) that may pass."""

    def __init__(self, why: str, damaged: bool):
        super().__init__(why)
        self.why, self.damaged = why, damaged


class RefDir(Protocol):
    """The refs of one (run, step), held open for one sequence of calls (a publish, a history read)."""

    def numbers(self) -> list[int]:
        """Every generation number taken, ascending."""

    def newest_first(self, whole: bool = False) -> tuple[int, Iterator[int]]:
        """The highest number taken, and the numbers to read for the history, newest first (every one taken,
        though some may be gone by when they are read). From :meth:`numbers` here; an object store finds them
        without a listing, and with ``whole`` may fetch the refs ahead of their reads."""
        numbers = self.numbers()
        return (numbers[-1] if numbers else 0), reversed(numbers)

    def read(self, generation: int) -> bytes | None:
        """The ref's bytes; None where the number is free (or was deleted); RefUnreadable where it cannot be read."""

    def put(self, generation: int, body: bytes) -> None:
        """Publish ``body`` as ref ``generation`` if that number is free, durably; FileExistsError if not."""

    def cas_head(self, expected: int, body: bytes) -> bool:
        """Publish ``body`` as generation ``expected + 1`` if no one took it: True, else False.
        (Implementations subclassing RefDir get this from :meth:`put`'s if-absent publish.)"""
        try:
            self.put(expected + 1, body)
            return True
        except FileExistsError:
            return False

    def delete(self, generation: int) -> bool:
        """Remove ref ``generation`` durably (False: it was gone)."""

    def set_aside(self, generation: int, aside: str, what: str) -> bool:
        """Move ref ``generation`` out of the history under the name ``aside``, kept as evidence, durably
        (False: it was gone); its number stays taken only while a newer one is."""

    def close(self) -> None: ...

    def __enter__(self) -> "RefDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StorageBackend(Protocol):
    """The operations a Store needs of its storage (see the module's docstring for order and guarantees)."""

    location: str
    """What messages name the store by (a path, a URL): never a credential."""

    deadline: float | None
    """Set by :meth:`Store.deadline`: the monotonic time the writes in progress must end by. A backend whose
    requests can stall (an object store) abandons what is in flight then; others may ignore it (the Store
    checks it between batches)."""

    def read_instance(self) -> str | None:
        """The store's instance id (random, written once), or None where it has none."""

    def make_instance(self) -> str:
        """The store's instance id, written once if absent (of two first writers, one id stands)."""

    def put_lease(self, name: str, body: bytes) -> None:
        """Keep a pending-publish lease (:mod:`alpha_ckpt.store.leases`) durably under ``name``."""

    def remove_lease(self, name: str) -> None:
        """Drop lease ``name`` (best effort: a stale lease only delays gc)."""

    def put_output(self, run: str, step: str, name: str, data: bytes) -> str:
        """Publish a step's declared output once (named by its content); return where it lies."""

    def put_objects(self, writes: Sequence[Callable[[int], str]], threads: int) -> list[PutResult]:
        """Put each object if its name is absent, durably; ``threads`` of them written at once."""

    def reuse_object(self, name: str, size: int | None, validate: Validate) -> bool:
        """Whether the object already under ``name`` may stand for one of ``size`` bytes being put: True if
        it passes ``validate`` (it is then renewed, see :meth:`renew_object`); anything else found under the
        name is removed from the way (set aside) and False returned, so the caller puts its own."""

    def has_object(self, name: str) -> bool: ...

    def open_object(self, name: str, what: str) -> ObjectFile:
        """The object, for reading (a Refusal ``missing-shard`` where it is absent)."""

    def open_objects(self, wanted: Sequence[tuple[str, int]], what: str) -> list[ObjectFile]:
        """Each (name, expected size) of ``wanted`` opened, in order, as :meth:`open_object` would (a Refusal
        ``format`` for an object of another size). A backend whose reads cost round trips (an object store)
        returns the objects while their bytes arrive: a read of one waits for it, and a missing object or
        one of another size is refused by every read of it, before any of its bytes is seen. Others open one
        by one (:func:`open_each`); where that fails, none is left open."""

    def read_object(self, name: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the object (fewer at its end)."""

    def list_objects(self, on_hostile: Callable[[str, str], None] | None = None) -> Iterator[str]:
        """Every object's name, in order."""

    def renew_object(self, name: str) -> bool:
        """Mark the object used now (gc's grace period counts from here); False if it is gone."""

    def delete_object(self, name: str) -> bool: ...

    def ref_dir(self, run: str, step: str, create: bool) -> RefDir | None:
        """The refs of (run, step); None where there are none and ``create`` is False."""

    def runs(self) -> list[tuple[str, str]]:
        """Every (run, step) that has refs."""

    def probe_write(self) -> None:
        """Write and remove something where writes start (OSError if the storage refuses writes)."""

    def close(self) -> None: ...


def check_opened_size(obj: ObjectFile, expected: int | None, what: str) -> None:
    """Refuse (``format``) an opened object whose size is not the one its record gives."""
    if expected is not None and obj.size != expected:
        raise Refusal(RefusalCode.FORMAT, f"{what} has {obj.size} bytes, its record says {expected} "
                                          "(truncated or extended)")


def open_each(backend: StorageBackend, wanted: Sequence[tuple[str, int]], what: str) -> list[ObjectFile]:
    """:meth:`StorageBackend.open_objects` one object at a time: for backends whose open is local."""
    opened: list[ObjectFile] = []
    try:
        for name, size in wanted:
            opened.append(backend.open_object(name, what))
            check_opened_size(opened[-1], size, f"{what} {name[:16]}...")
    except BaseException:
        for obj in opened:
            obj.close()
        raise
    return opened
