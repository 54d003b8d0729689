"""Which generations are complete, as gc's retention sees them, remembered so gc need not re-hash each run.

The definition is :func:`alpha_ckpt.generation.reader.check_complete` (ref intact, every
object validates fully), the same one ``latest`` and ``--resume latest`` use.
Retention counts only complete generations, so gc never removes the newest
generation that validates.

Validating a generation reads and hashes every byte of it. So that gc does
not do that on every run, it writes what it validated to
``STORE/verified/<root>``: one canonical JSON line and its BLAKE3 (like a ref)::

    {"kind": "verified", "root": ROOT, "verified_at": T,
     "objects": {DIGEST: [st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns], ...}}

The identity of each object file is taken before its bytes are checked. A
later gc trusts the record only while every object it lists has the same
identity (lstat): a write into an object, a replacement, a chmod, or a
renewal of its time (a publish reusing it, a pin) changes its mtime or ctime,
and the generation is validated again. What a record cannot see is bytes that
change without the file's metadata changing (media bit rot): ``verify`` and
every restore still check every byte they read. A record is a cache: losing
it costs one validation, and gc removes the records of generations it no
longer keeps.
"""
from __future__ import annotations

import time

from alpha_ckpt.errors import Refusal
from alpha_ckpt.format.records import canonical_json, digest_bytes, is_digest, parse_canonical_json
from alpha_ckpt.generation.reader import check_payloads, open_generation
from alpha_ckpt.store import RefRecord, Store
from alpha_ckpt.store.layout import VERIFIED
from alpha_ckpt.store.records import object_identity, read_record_file, record_names, write_record_file

VERIFIED_DIR = VERIFIED
MAX_RECORD_BYTES = 64 << 20


def _identity(store: Store, digest: str) -> list[int] | None:
    return object_identity(store, digest)


def _read_record(store: Store, root: str) -> dict | None:
    """The record gc wrote for ``root``, or None (absent, hostile or damaged: validate again)."""
    data = read_record_file(store, root, MAX_RECORD_BYTES)
    if data is None:
        return None
    lines = data.split(b"\n")
    if len(lines) != 3 or lines[2] != b"" or digest_bytes(lines[0]).encode("ascii") != lines[1]:
        return None
    try:
        obj = parse_canonical_json(lines[0], f"verified/{root}")
    except Refusal:
        return None
    if not isinstance(obj, dict) or obj.get("kind") != "verified" or obj.get("root") != root \
            or not isinstance(obj.get("objects"), dict):
        return None
    return obj


def _still_valid(store: Store, record: dict) -> bool:
    objects = record["objects"]
    return bool(objects) and all(is_digest(d) and _identity(store, d) == ident for d, ident in objects.items())


def _remember(store: Store, root: str, identities: dict[str, list[int]]) -> None:
    """Write the record (best effort: a record that cannot be written only costs a later validation)."""
    body = canonical_json({"kind": "verified", "root": root, "verified_at": time.time(), "objects": identities})
    data = body + b"\n" + digest_bytes(body).encode("ascii") + b"\n"
    write_record_file(store, root, data)


def remembered_check_complete(store: Store, record: RefRecord) -> tuple[Refusal | None, bool]:
    """:func:`alpha_ckpt.generation.reader.check_complete`, skipped while gc's record of it still holds.

    Returns (why it is not complete or None, whether its bytes were hashed now).
    """
    remembered = _read_record(store, record.root)
    if remembered is not None and _still_valid(store, remembered):
        return None, False
    try:
        with open_generation(store, record.root, record) as generation:
            digests = {m.digest for m in generation.manifests} | {s.digest for m in generation.manifests
                                                                   for s in m.shards}
            identities = {d: _identity(store, d) for d in sorted(digests)}  # before the bytes are checked
            check_payloads(generation)
    except Refusal as refusal:
        return refusal, True
    if all(ident is not None for ident in identities.values()):
        _remember(store, record.root, identities)
    return None, True


def remembered_roots(store: Store) -> list[str]:
    """The roots gc holds a record for (plain digest names only; no directory, or a hostile one: none)."""
    return record_names(store)
