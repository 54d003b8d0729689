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

A restore reads: ``ref_dir(...).read(n)`` then ``open_object`` / ``read_object``.

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
the POSIX backend; an anonymous memory file (``os.memfd_create``) that a
backend of another kind uploads or keeps, for an object store or a peer's
memory. Two implementations: :class:`PosixBackend <alpha_ckpt.store.posix.PosixBackend>`
(the file system) and :class:`InMemoryBackend <alpha_ckpt.store.in_memory.InMemoryBackend>`
(everything in this process's memory, no file touched);
:class:`ReadThroughBackend <alpha_ckpt.store.read_through.ReadThroughBackend>`
reads what one backend lacks from others (the memory tier's view of a node).
``tests/unit/test_store_backend.py`` runs one contract against each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

from alpha_ckpt.store.objects import ObjectFile, Validate


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
