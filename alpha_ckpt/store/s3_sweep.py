"""gc's and pins' operations on an S3 store: what :mod:`alpha_ckpt.store.sweep` and
:mod:`alpha_ckpt.store.pinfiles` do with renames and modification times on a file system, done with
conditional writes and the server's clock (the same functions, for :func:`alpha_ckpt.store.sweep.for_store`).

    PREFIX/doomed/<digest>                          gc is about to delete the object (see below)
    PREFIX/refs/RUN/STEP/aside-<gen>-<pid>-<random> a ref gc is removing, kept until the pins are read again
    PREFIX/pins/<root>                              pins, put only if absent

Times are the server's: an object's or a marker's ``LastModified``, and ``now`` is the ``Date`` of a
reply, so no node's clock decides what is old.

An object a save reuses is never deleted under it. A save reusing an object writes ``renewed/<digest>``,
then looks for ``doomed/<digest>``; gc writes ``doomed/<digest>``, then reads ``renewed/<digest>``, and
deletes (``If-Match`` on the ETag it examined) only if the renewal is older than what it protects.
Each writes before it reads, so at least one sees the other: gc spares the object, or the save waits
for gc to finish and puts its own copy if the object went (:meth:`S3Backend.renew_object`). A gc that
takes longer than :data:`DOOM_BOUND_S` between its marker and its delete deletes nothing; a save
treats a marker older than that (a killed gc's) as gone.
"""
from __future__ import annotations

import dataclasses
import email.utils
import os
import secrets
import time
from typing import Callable

from alpha_ckpt.errors import Refusal
from alpha_ckpt.format.records import is_digest
from alpha_ckpt.store import layout as L
from alpha_ckpt.store.layout import ASIDE_PREFIX, OUTPUT_SUFFIX, REF_ASIDE_RE, REF_DIGITS, quarantined_names, ref_name
from alpha_ckpt.store.leases import MAX_LEASE_BYTES, Lease
from alpha_ckpt.store.refs import RefRecord
from alpha_ckpt.store.s3 import DOOMED, DOOM_BOUND_S, PROBE, RENEWED, S3Backend, S3RefDir
from alpha_ckpt.store.store import Store

Skip = Callable[[str, str], None]
UPLOAD_SEPARATOR = "?uploadId="  # what gc names an abandoned multipart upload by: KEY?uploadId=ID


def _backend(store: Store) -> S3Backend:
    return store.backend  # type: ignore[return-value]


def _timestamp(value) -> float:
    return value.timestamp()


def _listing(store: Store, *names: str) -> dict[str, dict]:
    """Every key under ``names`` (relative to that folder) with its listing entry (LastModified, ETag, Size)."""
    b = _backend(store)
    base = b.key(*names) + "/"
    return {entry["Key"][len(base):]: entry for page in b._list(base) for entry in page.get("Contents", ())}


class S3Sweep:
    """gc's operations on one S3 store, for one gc (it lists the objects' times once)."""

    def __init__(self, store: Store):
        self.store, self.b = store, _backend(store)
        self._put: dict[str, dict] | None = None
        self._renewed: dict[str, dict] = {}

    def now(self) -> float:
        """The server's time, from the Date of a reply."""
        reply = self.b.client.head_bucket(Bucket=self.b.bucket)
        date = reply["ResponseMetadata"]["HTTPHeaders"].get("date")
        return email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()

    def read_leases(self, on_hostile: Skip | None = None) -> list[tuple[str, Lease | None, float]]:
        """Every lease: (name, the lease, its start the server's time of its put, or None where unreadable,
        that time)."""
        out = []
        for name, entry in sorted(_listing(self.store, L.PENDING).items()):
            written = _timestamp(entry["LastModified"])
            got = self.b._get(self.b.key(L.PENDING, name))
            if got is None:
                continue  # released meanwhile
            data = got["Body"].read(MAX_LEASE_BYTES + 1)
            lease = None
            if len(data) <= MAX_LEASE_BYTES:
                try:
                    lease = dataclasses.replace(Lease.from_bytes(name, data), started_at=written)
                except Refusal:
                    pass
            out.append((name, lease, written))
        return out

    def object_mtime(self, digest: str) -> float:
        """When the object was put or last renewed (the later), by the server's clock; infinity where it is gone."""
        if self._put is None:
            self._put, self._renewed = _listing(self.store, L.OBJECTS), _listing(self.store, RENEWED)
        entry = self._put.get(f"{digest[:2]}/{digest}")
        if entry is None:
            return float("inf")
        renewed = self._renewed.get(digest)
        return max(_timestamp(entry["LastModified"]), _timestamp(renewed["LastModified"]) if renewed else 0.0)

    def output_time(self, run: str, step: str) -> float | None:
        times = [_timestamp(e["LastModified"]) for name, e in _listing(self.store, L.OUTPUTS, run, step).items()
                 if name.endswith(OUTPUT_SUFFIX) and "/" not in name]
        return max(times, default=None)

    def old_tmp_files(self, before: float, skip: Skip) -> list[str]:
        """What killed writers left, begun before ``before`` (later ones may be a save's in flight: ``before``
        accounts for leases): multipart uploads never completed, as ``KEY?uploadId=ID``, under objects/ and
        probe/ (a conditional-write probe's), and probe keys."""
        b, out = self.b, []
        for folder in (L.OBJECTS, PROBE):
            pages = b.client.get_paginator("list_multipart_uploads").paginate(Bucket=b.bucket,
                                                                             Prefix=b.key(folder) + "/")
            out += [f"{u['Key']}{UPLOAD_SEPARATOR}{u['UploadId']}" for page in pages
                    for u in page.get("Uploads", ()) if _timestamp(u["Initiated"]) < before]
        out += [b.key(PROBE, name) for name, entry in _listing(self.store, PROBE).items()
                if _timestamp(entry["LastModified"]) < before]
        return sorted(out)

    def remove_tmp_files(self, names: list[str]) -> None:
        for name in names:
            key, _, upload = name.partition(UPLOAD_SEPARATOR)
            if upload:
                self.b._abort(key, upload)
            else:
                self.b._delete_if_unchanged(key)

    def remove_verified_records(self, roots: list[str]) -> None:
        """An object store keeps no verified records: nothing to remove."""

    def remove_leases(self, names: list[str]) -> None:
        for name in names:
            self.b.remove_lease(name)

    def quarantined_before(self, before: float, skip: Skip) -> list[str]:
        return quarantined_names(_listing(self.store, L.QUARANTINE), before, skip)

    def remove_quarantined(self, names: list[str]) -> None:
        for name in names:
            self.b._delete_if_unchanged(self.b.key(L.QUARANTINE, name))

    def refs_aside(self, run: str, step: str) -> list[tuple[str, str, str]]:
        return [(run, step, n) for n in sorted(_listing(self.store, L.REFS, run, step)) if REF_ASIDE_RE.match(n)]

    def put_back_refs(self, entries: list[tuple[str, str, str]]) -> None:
        """Refs a killed gc had set aside go back first: a pin may have been taken meanwhile."""
        for run, step, name in entries:
            _put_back_ref(self.store, run, step, name, int(name[len(ASIDE_PREFIX):len(ASIDE_PREFIX) + REF_DIGITS]))

    def object_sweep(self) -> "ObjectSweep":
        return ObjectSweep(self.store)

    def refs_set_aside(self, refs: list[RefRecord]) -> "RefsAside":
        return RefsAside(self.store, refs)


def _put_back_ref(store: Store, run: str, step: str, aside: str, generation: int) -> bool:
    """Put the ref set aside as ``aside`` back under its number (if absent), then drop the copy: True if the
    ref is in place."""
    b = _backend(store)
    got = b._get(b.key(L.REFS, run, step, aside))
    if got is None:
        return b._head(b.key(L.REFS, run, step, ref_name(generation))) is not None
    b._put_if_absent(b.key(L.REFS, run, step, ref_name(generation)), got["Body"].read())
    b._delete_if_unchanged(b.key(L.REFS, run, step, aside))
    return True


class ObjectSweep:
    """Removes objects, sparing any a save renewed since planning (see the module's docstring)."""

    def __init__(self, store: Store):
        self.store, self.b = store, _backend(store)

    def __enter__(self) -> "ObjectSweep":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def put_back_set_aside(self, skip: Skip) -> None:
        """Nothing is set aside on S3 (a doomed marker a killed gc left expires by time)."""

    def remove_objects(self, digests: list[str], protect_before: float) -> None:
        b = self.b
        for digest in digests:
            key, doomed, renewed = b._object_key(digest), b.key(DOOMED, digest), b.key(RENEWED, digest)
            head = b._head(key)
            if head is None:
                continue
            marked = time.monotonic()
            b.client.put_object(Bucket=b.bucket, Key=doomed, Body=b"")
            try:
                mark = b._head(renewed)
                young = mark is not None and _timestamp(mark["LastModified"]) >= protect_before
                if young or time.monotonic() - marked > DOOM_BOUND_S / 2:
                    continue  # a save reused it since planning (or this gc is too slow to be sure it did not)
                try:
                    b.client.delete_object(Bucket=b.bucket, Key=key, IfMatch=head["ETag"])
                except b._errors:
                    continue  # replaced or gone since it was examined
                if mark is not None:
                    b._delete_if_unchanged(renewed)
            finally:
                b.client.delete_object(Bucket=b.bucket, Key=doomed)


class RefsAside:
    """Refs of dropped generations copied aside and removed (invisible to a pin, which then rescues them
    from the copy: :func:`rescue_ref`); :meth:`finish` puts back those pinned by then and drops the copies."""

    def __init__(self, store: Store, refs: list[RefRecord]):
        self.store, self.b = store, _backend(store)
        self.entries: list[tuple[RefRecord, str]] = []
        for r in refs:
            aside = f"{ASIDE_PREFIX}{ref_name(r.generation)}-{os.getpid()}-{secrets.token_hex(4)}"
            source = self.b.key(L.REFS, r.run, r.step, ref_name(r.generation))
            try:
                self.b.client.copy_object(Bucket=self.b.bucket, Key=self.b.key(L.REFS, r.run, r.step, aside),
                                          CopySource={"Bucket": self.b.bucket, "Key": source})
            except self.b._errors:
                continue  # gone since planning
            if self.b._delete_if_unchanged(source):
                self.entries.append((r, aside))
            else:
                self.b._delete_if_unchanged(self.b.key(L.REFS, r.run, r.step, aside))

    def finish(self, pins: set[str]) -> set[str]:
        spared = set()
        for r, aside in self.entries:
            if r.root in pins:
                spared.add(r.root)
                _put_back_ref(self.store, r.run, r.step, aside, r.generation)
                continue
            self.b._delete_if_unchanged(self.b.key(L.REFS, r.run, r.step, aside))
            if self.b._head(self.b.key(L.REFS, r.run, r.step, ref_name(r.generation))) is not None:
                spared.add(r.root)  # a pin put it back meanwhile
        for run, step in {(r.run, r.step) for r, _ in self.entries}:
            S3RefDir(self.b, run, step).raise_floor()
        return spared

    def close(self) -> None:
        pass

    def __enter__(self) -> "RefsAside":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def rescue_ref(store: Store, run: str, step: str, generation: int) -> bool:
    """Put ref ``generation`` back from a copy gc set aside: True once it is in place, False where it is
    gone for good."""
    b = _backend(store)
    if b._head(b.key(L.REFS, run, step, ref_name(generation))) is not None:
        return True
    for aside in sorted(n for n in _listing(store, L.REFS, run, step)
                        if n.startswith(f"{ASIDE_PREFIX}{ref_name(generation)}-")):
        if _put_back_ref(store, run, step, aside, generation):
            return True
    return b._head(b.key(L.REFS, run, step, ref_name(generation))) is not None


# ---------------------------------------------------------------- pins


def pin_names(store: Store, on_hostile: Skip | None = None) -> set[str]:
    return {name for name in _listing(store, L.PINS) if is_digest(name)}


def read_pin_file(store: Store, root: str, max_bytes: int) -> bytes | Refusal | None:
    b = _backend(store)
    got = b._get(b.key(L.PINS, root))
    return None if got is None else got["Body"].read(max_bytes + 1)


class PinFiles:
    """The pins of an S3 store (each put only if absent)."""

    def __init__(self, store: Store, commits: bool = False):
        self.b = _backend(store)

    def __enter__(self) -> "PinFiles":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass

    def refuse_unless_pin_file(self, root: str, doing: str) -> None:
        """Every key is a plain object: nothing but a pin can stand under a pin's name."""

    def remove(self, root: str) -> bool:
        return self.b._delete_if_unchanged(self.b.key(L.PINS, root))

    def commit(self, root: str, body: bytes) -> None:
        if not self.b._put_if_absent(self.b.key(L.PINS, root), body):
            raise FileExistsError(f"pin {root}")

