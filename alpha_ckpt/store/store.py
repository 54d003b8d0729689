"""The Store: a content-addressed store of objects and refs under one root (see :mod:`alpha_ckpt.store`).

The Store knows what names mean (digests, generations, histories, fencing, when an existing object
may be reused); its backend (:mod:`alpha_ckpt.store.backend`) keeps the bytes.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
from typing import Callable, Iterator, Sequence

from alpha_ckpt.errors import DurableWriteError, PublishConflict, Refusal, RefusalCode, StoreUsageError
from alpha_ckpt.format.records import CapturePrefix, check_name, is_digest
from alpha_ckpt.store._posix import _log
from alpha_ckpt.store import layout as L
from alpha_ckpt.store.backend import ObjectContent, ObjectWriter, RefDir, RefUnreadable, StorageBackend
from alpha_ckpt.store.layout import StoreLayout, ref_name
from alpha_ckpt.store.location import is_object_store, local_path
from alpha_ckpt.store.objects import ObjectFile, Validate
from alpha_ckpt.store.pending import PublishLease, _LeaseBook
from alpha_ckpt.store.posix import PosixBackend
from alpha_ckpt.store.refs import History, RefRecord, UnreadableRef, check_fence, decode_ref, encode_ref
from alpha_ckpt.store.write_mode import DEFAULT_WRITE_MODE, DEFAULT_WRITE_THREADS, WriteModes, check_write_threads

QUARANTINE_DIR = L.QUARANTINE
logger = logging.getLogger("alpha_ckpt")


class Store:
    """A store over ``root_or_backend``: a directory (created if missing, kept by a
    :class:`PosixBackend`) or any :class:`~alpha_ckpt.store.backend.StorageBackend`
    (:class:`~alpha_ckpt.store.in_memory.InMemoryBackend`, a read-through view, ...).

    ``write_mode``: how large objects are written, "buffered" (the default), "direct" (O_DIRECT) or
    "auto" (by measurement), or a :class:`WriteModes` learner to share with other stores on the same
    file system; the store's learner is :attr:`write_modes`. ``write_threads``: how many files of one
    batch (a save's shards) are written at once. Where things lie under ``root``: :attr:`layout`.
    """

    def __init__(self, root_or_backend: str | os.PathLike | StorageBackend, *, create: bool = True,
                 write_mode: str | WriteModes = DEFAULT_WRITE_MODE, write_threads: int = DEFAULT_WRITE_THREADS):
        self.objects_opened = 0  # objects opened for reading: tests prove a restore reads only its path
        self.bytes_written = 0   # bytes of objects this handle created (a deduplicated object adds none)
        # existing objects validated before reuse, and the seconds that took: what dedup's safety costs
        self.reuse_checks = 0
        self.reuse_check_seconds = 0.0
        self._reuse_lock = threading.Lock()  # an asynchronous save reuses on its own thread
        self._deadline: float | None = None  # monotonic time the writes of the save in progress must end by
        self.write_modes = write_mode if isinstance(write_mode, WriteModes) else WriteModes(write_mode)
        self.write_threads = check_write_threads(write_threads)
        if isinstance(root_or_backend, (str, os.PathLike)) and is_object_store(root_or_backend):
            from alpha_ckpt.store.s3 import S3Backend
            self.layout: StoreLayout | None = None
            self.backend: StorageBackend = S3Backend(os.fspath(root_or_backend), create)
        elif isinstance(root_or_backend, (str, os.PathLike)):
            self.layout = StoreLayout(local_path(root_or_backend))
            self.backend = PosixBackend(self.layout, create)
        else:
            self.backend = root_or_backend
            self.layout = getattr(root_or_backend, "layout", None)  # a file system's: gc and records read it
        self.root = self.backend.location  # what messages name the store by
        self._instance = self._first_writable_open() if create else None
        self._leases = _LeaseBook(self.backend)

    def _first_writable_open(self) -> str | None:
        """Give a writable store its instance id if it has none; a store that cannot be written keeps none."""
        try:
            return self.backend.make_instance()
        except (OSError, DurableWriteError) as exc:
            logger.debug("store %s: no instance id (%s); the memory tier stays off for it", self.root, exc)
            return None

    @property
    def instance(self) -> str | None:
        """This store's instance id: random, written once at its first writable open, kept by a copy of the
        store. A memory generation counts for this store only if it carries this id. None: the store has
        none (read-only, or older than instance ids, and not opened writable since)."""
        if self._instance is None:
            self._instance = self.backend.read_instance()
        return self._instance

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # A handle dropped without close() gives its directory descriptors back: a long job that
        # opens a store per save would otherwise run out of them.
        if hasattr(self, "_leases"):  # not when __init__ failed before opening everything
            self.close()

    @contextlib.contextmanager
    def deadline(self, seconds: float | None) -> Iterator[None]:
        """Within the block, the store's writes end ``seconds`` from now or fail (a DurableWriteError at stage
        ``deadline``, naming the object): checked before each batch of objects and the ref, and enforced within
        a request by a backend that can abandon one (:attr:`StorageBackend.deadline`). None: no bound."""
        at = None if seconds is None else time.monotonic() + seconds
        previous, self._deadline = self._deadline, at
        self.backend.deadline = at
        try:
            yield
        finally:
            self._deadline = previous
            self.backend.deadline = previous

    def _check_deadline(self, what: str) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise DurableWriteError("deadline", errno.ETIMEDOUT, f"the save's time ran out before {what} of store "
                                                                 f"{self.root} was written")

    def probe_write(self) -> None:
        """Write and remove a file where every publish starts (OSError if the store cannot be written)."""
        self.backend.probe_write()

    def put_output(self, run: str, step: str, name: str, data: bytes) -> str:
        """Publish a step's declared output (e.g. a fitted model) as ``name`` under the run/step, once
        and durably; return its absolute path. ``name`` should be derived from ``data`` (a digest), so
        the same output is never written twice."""
        for value, what in ((run, "run"), (step, "step"), (name, "output name")):
            check_name(value, what)
        return self.backend.put_output(run, step, name, data)

    # ------------------------------------------------------------ objects

    def has_object(self, digest: str) -> bool:
        return self.backend.has_object(self.check_digest(digest))

    def put_object(self, write: Callable[[int], str], digest_hint: str | None = None, *,
                   validate: Validate) -> tuple[str, bool]:
        """Durably write an object; ``write(fd)`` writes it and returns its digest.

        Returns (digest, written). An object that already exists is not written
        again (same name, same content): that is the dedup. It is reused only
        once it is known intact (see :meth:`PosixBackend.reuse_object`): ``validate(obj, what)``
        checks an existing file's content against its name, raising a Refusal
        if it does not match (the store knows names, not what objects hold:
        :func:`alpha_ckpt.generation.reader.validate_object_file` does). Anything else found
        under the name is set aside into ``quarantine/`` and the object
        committed anew. A reused object's modification time is renewed, so
        gc's grace period protects it until the publish reusing it has its ref.
        """
        if digest_hint is not None and self.backend.reuse_object(self.check_digest(digest_hint), None,
                                                                 self._counted(validate)):
            return digest_hint, False
        return self.put_objects([write], validate=validate)[0]

    def put_objects(self, writes: Sequence[Callable[[int], str]], *, validate: Validate) -> list[tuple[str, bool]]:
        """Durably write several objects as :meth:`put_object` does, in one batched durable commit.

        Every object is written before any is fsynced (see
        :func:`alpha_ckpt.store.durable.durable_commit_all`), so the disk streams the
        batch and each directory is fsynced once; :attr:`write_threads` of them are
        written at once. Returns (digest, written) per write, in order.
        """
        def checked(write: Callable[[int], str]) -> Callable[[int], str]:
            describe = getattr(write, "content", None)
            if describe is None:
                return lambda fd: self.check_digest(write(fd))

            def content() -> ObjectContent:
                described = describe()
                self.check_digest(described.name)
                return described
            return ObjectWriter(lambda fd: self.check_digest(write(fd)), content)

        validate = self._counted(validate)

        results: list[tuple[str, bool] | None] = [None] * len(writes)
        left = list(range(len(writes)))
        names: dict[int, str] = {}
        for _ in range(3):  # again only if the existing copy was set aside or removed (gc) in between
            self._check_deadline(f"{len(left)} objects")
            puts = self.backend.put_objects([checked(writes[i]) for i in left], self.write_threads)
            again = []
            for i, put in zip(left, puts):
                names[i] = put.name
                if not put.created:
                    if self.backend.reuse_object(put.name, put.size, validate):
                        results[i] = (put.name, False)
                    else:
                        again.append(i)
                    continue
                self.bytes_written += put.size
                results[i] = (put.name, True)
            left = again
            if not left:
                return results  # type: ignore[return-value]
        raise DurableWriteError("rename", errno.EEXIST, f"object {names[left[0]]} kept disappearing while being reused")

    def _counted(self, validate: Validate) -> Validate:
        """``validate``, adding to :attr:`reuse_checks` and :attr:`reuse_check_seconds`."""
        def counted(obj, what):
            started = time.perf_counter()
            try:
                return validate(obj, what)
            finally:
                with self._reuse_lock:
                    self.reuse_checks += 1
                    self.reuse_check_seconds += time.perf_counter() - started
        return counted

    def renew_object(self, digest: str) -> bool:
        """Renew an object's modification time (False if it is gone): gc then counts it as young."""
        return self.backend.renew_object(self.check_digest(digest))

    @staticmethod
    def check_digest(digest: object) -> str:
        if not is_digest(digest):
            raise Refusal(RefusalCode.FORMAT, f"object name {digest!r} is not a plain 64-hex digest")
        return digest  # type: ignore[return-value]

    def open_object(self, digest: str, what: str) -> ObjectFile:
        """Open an object for reading: a regular file, never through a symlink."""
        self.check_digest(digest)
        self.objects_opened += 1
        return self.backend.open_object(digest, what)

    def open_objects(self, wanted: Sequence[tuple[str, int]], what: str) -> list[ObjectFile]:
        """Open each (digest, expected size), all or none (see ``StorageBackend.open_objects``): an object
        store overlaps the round trips of a restore's objects."""
        for digest, _ in wanted:
            self.check_digest(digest)
        self.objects_opened += len(wanted)
        return self.backend.open_objects(wanted, what)

    def object_path(self, digest: str) -> str:
        """The object's file (a store on a file system only)."""
        self.check_digest(digest)
        if self.layout is None:
            raise StoreUsageError(f"store {self.root}: its objects are not files")
        return self.layout.object_path(digest)

    def delete_object(self, digest: str) -> bool:
        """Remove an object durably (False if it was gone). Only for a store whose every reader is its owner
        (a memory holder): in a shared store, gc removes objects, sparing what a publish in flight names."""
        return self.backend.delete_object(self.check_digest(digest))

    def object_size(self, digest: str) -> int:
        """An object's size in bytes (0 if it is gone)."""
        try:
            with self.backend.open_object(self.check_digest(digest), "object") as obj:
                return obj.size
        except (FileNotFoundError, Refusal):
            return 0

    def delete_ref(self, run: str, step: str, generation: int) -> bool:
        """Remove ref ``generation`` of (run, step) (False if gone): a memory holder's retention."""
        refs = self._refs_dir(run, step, create=False)
        if refs is None:
            return False
        with refs:
            return refs.delete(generation)

    def iter_objects(self, on_hostile: Callable[[str, str], None] | None = None) -> Iterator[str]:
        """Every object's name, in order (see :meth:`PosixBackend.list_objects`): anything under
        objects/ that is no object of this store is skipped, and ``on_hostile(path, why)`` hears of it."""
        return self.backend.list_objects(on_hostile)

    # ------------------------------------------------------------ pending publishes

    def pending_publish(self, run: str, step: str) -> "PublishLease":
        """Take a lease for a publish of (run, step) about to write objects; release it once the ref is out.

        ``with store.pending_publish(run, step): ...write objects, publish the ref...``. While it is held,
        gc removes no object modified after the lease started. Overlapping publishes of one process share
        one lease file.
        """
        check_name(run, "run")
        check_name(step, "step")
        return self._leases.acquire(run, step)

    # ------------------------------------------------------------ refs

    def _refs_dir(self, run: str, step: str, create: bool) -> RefDir | None:
        check_name(run, "run")
        check_name(step, "step")
        return self.backend.ref_dir(run, step, create)

    def publish_ref(self, prefix: CapturePrefix, root: str, root_size: int, total_bytes: int, owners: int, *,
                    follows: int | None = None) -> RefRecord:
        """Publish the next generation of (run, step): a NOREPLACE ref naming ``root``, if the history allows it.

        History fencing (:func:`check_fence`): the refs are read from the
        newest down to the newest readable one (:meth:`history`), and a publish
        whose epoch is older than the newest generation's is refused
        (``stale-epoch``); with ``follows`` (the highest generation number this
        publisher has seen in its history, 0 for an empty history), a history
        that has taken a number since is refused too (``fenced``) when that
        generation is of the same epoch or cannot be read. The ref then takes
        the number after the highest one taken (an unreadable ref's number is
        never reused) with NOREPLACE, so the check is race-free: a publisher
        that lost the number re-reads the newest ref and is fenced, or gets
        :class:`PublishConflict` (retryable) when the winner was not one to
        fence it. Publishing the root the newest ref already names returns that
        ref (a retried save is idempotent). Unreadable refs passed over are
        named on stderr.
        """
        self._check_deadline(f"the ref of {prefix.run}/{prefix.step}")
        with self._refs_dir_made(prefix.run, prefix.step) as refs:
            history = self._history(refs, prefix.run, prefix.step, whole=False)
            newest = history.newest
            if newest is not None and newest.generation == history.top \
                    and (newest.root, newest.prefix) == (root, prefix):
                return newest  # this very state is already the newest generation (a retried save): nothing to add
            check_fence(history, prefix, follows)
            generation = history.top + 1
            record = RefRecord(prefix.run, prefix.step, generation, root, root_size, prefix, time.time(), total_bytes,
                               owners)
            if not refs.cas_head(history.top, self._ref_body(record)):
                winner = self._read_ref(refs, prefix.run, prefix.step, generation)
                if isinstance(winner, RefRecord):  # it may fence this publish: say so precisely
                    check_fence(History(prefix.run, prefix.step, (winner,), generation), prefix, follows)
                raise PublishConflict(f"generation {generation} of {prefix.run}/{prefix.step} was published by "
                                      "another publisher")
            for bad in history.unreadable_above:
                _log(f"alpha_ckpt: store {self.root}: ref {bad.name} cannot be read and was passed over: "
                     f"{bad.refusal}; generation {generation} follows "
                     f"{'generation ' + str(newest.generation) if newest else 'no readable generation'}\n")
            return record

    def put_ref(self, record: RefRecord) -> None:
        """Durably write ``record`` as generation ``record.generation`` of its run and step if that number is
        free (FileExistsError if not). The storage step under :meth:`publish_ref`, with no history check:
        only :meth:`publish_ref` publishes a generation that follows its history."""
        with self._refs_dir_made(record.run, record.step) as refs:
            refs.put(record.generation, self._ref_body(record))

    def _refs_dir_made(self, run: str, step: str) -> RefDir:
        refs = self._refs_dir(run, step, create=True)
        if refs is None:
            raise StoreUsageError(f"{self.root!r} is not an alpha_ckpt store (no {L.REFS}/)")
        return refs

    @staticmethod
    def _ref_body(record: RefRecord) -> bytes:
        body = encode_ref(record)
        # The last line of defence: never write a ref that this store's readers would refuse (it
        # would stand as the newest generation and refuse every later publish and restore).
        decode_ref(body, f"ref {record.run}/{record.step}/{ref_name(record.generation)} (not written)")
        return body

    def history(self, run: str, step: str, *, whole: bool = True) -> History:
        """The refs of (run, step) (see :class:`History`): every one, or with ``whole=False`` only those from
        the newest readable one up (one listing, and usually one ref read)."""
        refs = self._refs_dir(run, step, create=False)
        if refs is None:
            return History(run, step, (), 0)
        with refs:
            return self._history(refs, run, step, whole)

    def _history(self, refs: RefDir, run: str, step: str, whole: bool) -> History:
        top, newest_first = refs.newest_first(whole)  # no listing where the backend needs none
        entries = []
        for generation in newest_first:
            entry = self._read_ref_entry(refs, run, step, generation)
            if entry is None:
                continue  # removed since the listing (gc): no generation, but its number was taken
            entries.append(entry)
            if not whole and isinstance(entry, RefRecord):
                break
        return History(run, step, tuple(reversed(entries)), top)

    def list_refs(self, run: str, step: str) -> list[RefRecord | Refusal]:
        """Every generation of (run, step), oldest first; unreadable refs are returned as refusals."""
        return self.history(run, step).listing()

    def _read_ref(self, refs: RefDir, run: str, step: str, generation: int) -> RefRecord | Refusal:
        entry = self._read_ref_entry(refs, run, step, generation)
        if entry is None:
            return Refusal(RefusalCode.FORMAT, f"ref {run}/{step}/{ref_name(generation)}: cannot open (gone)")
        return entry if isinstance(entry, RefRecord) else entry.refusal

    def _read_ref_entry(self, refs: RefDir, run: str, step: str, generation: int) -> RefRecord | UnreadableRef | None:
        """The ref ``generation``: its record, why it cannot be read, or None where it is gone."""
        what = f"ref {run}/{step}/{ref_name(generation)}"
        try:
            data = refs.read(generation)
        except RefUnreadable as exc:
            return UnreadableRef(run, step, generation, Refusal(RefusalCode.FORMAT, f"{what}: {exc.why}"), exc.damaged)
        if data is None:
            return None
        try:
            record = decode_ref(data, what)
        except Refusal as refusal:
            return UnreadableRef(run, step, generation, refusal, True)
        if (record.run, record.step, record.generation) != (run, step, generation):
            return UnreadableRef(run, step, generation, Refusal(
                RefusalCode.FORMAT, f"{what}: names generation {record.run}/{record.step}/{record.generation}"), True)
        return record

    def newest_ref(self, run: str, step: str) -> RefRecord | None:
        """The newest readable generation of (run, step) (see :meth:`history`), or None."""
        return self.history(run, step, whole=False).newest

    def set_aside_ref(self, run: str, step: str, generation: int) -> str | None:
        """Move the unreadable ref ``generation`` into ``quarantine/`` (gc): the name it got there, or None.

        Only a ref that is damaged for good (:attr:`UnreadableRef.damaged`,
        read again now) and not the newest number taken is moved: a newer ref
        keeps the numbering past it, so its number is never reused. Renamed,
        never deleted (it is evidence); gc sweeps it after the grace period.
        """
        refs = self._refs_dir(run, step, create=False)
        if refs is None:
            return None
        with refs:
            entry = self._read_ref_entry(refs, run, step, generation)
            numbers = refs.numbers()
            if not (isinstance(entry, UnreadableRef) and entry.damaged and numbers and numbers[-1] > generation):
                return None
            # Run and step names are long enough to overflow a name: the log line says where it came from.
            aside = f"ref-{ref_name(generation)}-{int(time.time())}-{secrets.token_hex(4)}"
            if not refs.set_aside(generation, aside, entry.name):
                return None
        _log(f"alpha_ckpt: store {self.root}: ref {entry.name} cannot be read: {entry.refusal}; "
             f"set aside as {QUARANTINE_DIR}/{aside}\n")
        return aside

    def find_ref(self, root: str, near: tuple[str, str] | None = None) -> RefRecord | None:
        """The first ref that names ``root``, or None: in the history of ``near`` (run, step) where given (no
        listing of the store), else of any run/step."""
        if near is not None:
            return next((r for r in self.list_refs(*near) if isinstance(r, RefRecord) and r.root == root), None)
        for run, step in self.runs():
            for record in self.list_refs(run, step):
                if isinstance(record, RefRecord) and record.root == root:
                    return record
        return None

    def runs(self) -> list[tuple[str, str]]:
        """Every (run, step) with a refs directory; symlinks and odd names are skipped."""
        return self.backend.runs()
