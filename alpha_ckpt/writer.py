"""Writing a generation: shards straight from tensor memory, then the manifest, then the ref.

Hashing overlaps writing: while the calling thread writes a slice's bytes to
the file (the kernel copy releases the GIL), a worker hashes the same memory
(BLAKE3 releases the GIL too), so a save costs about the write time, not the
write time plus the hash time. The head carries fixed-width hex digests, so
its length is known before the digests are: the payload is written first at
its final offset and the head last.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import blake3
import torch
import zstandard

from . import durable
from .format import (
    DTYPES, STAR, CapturePrefix, ChildRef, Publisher, RegionDecl, ShardRef, SliceRecord, aligned, canonical_json,
    check_name, digest_bytes, encode_head, manifest_header, schema_digest_of, shard_header,
)
from .manifest import flatten_state, regions_of
from .planner import Piece, pack_shards
from .store import RefRecord, Store

DEFAULT_MAX_SHARD_BYTES = 2 << 30
_PLACEHOLDER = "0" * 64
_ZSTD_LEVEL = 1
_SAMPLE_BYTES = 1 << 20


@dataclass(frozen=True)
class Published:
    root: str
    ref: RefRecord
    shards: tuple[ShardRef, ...]


def word_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The region's words as a flat uint8 CPU tensor, without copying when possible."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _u8_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(b"")


def choose_codec(data: memoryview, requested: str) -> str:
    """'raw', 'zstd', or 'auto': zstd only where a sample compresses to at most 80 %."""
    if requested in ("raw", "zstd"):
        return requested
    if requested != "auto":
        raise ValueError(f"unknown compression {requested!r} (raw, zstd or auto)")
    sample = data[:_SAMPLE_BYTES]
    if len(sample) < 4096:
        return "raw"
    return "zstd" if len(zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(sample)) <= 0.8 * len(sample) else "raw"


_CODEC_CHOICES = ("raw", "zstd", "auto")


def _check_compression(compression: str | Mapping[str, str], names: set[str]) -> None:
    """Refuse a bad compression request before anything is written."""
    choices = [compression] if isinstance(compression, str) else list(compression.values())
    bad = [c for c in choices if c not in _CODEC_CHOICES]
    if bad:
        raise ValueError(f"unknown compression {bad[0]!r} (choose from {', '.join(_CODEC_CHOICES)})")
    if not isinstance(compression, str):
        unknown = sorted(set(compression) - names)
        if unknown:
            raise ValueError(f"compression names regions the state does not have: {unknown}")


_WRITEBACK_MIN_BYTES = 8 << 20


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    start, length = offset, len(view)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    if length >= _WRITEBACK_MIN_BYTES:
        durable.start_writeback(fd, start, length)


def _hash(view) -> str:
    return blake3.blake3(view).hexdigest()


def write_shard(store: Store, prefix: CapturePrefix, schema_digest: str, regions: Sequence[RegionDecl],
                parts: Sequence[tuple[Piece, memoryview, str]], pool: ThreadPoolExecutor) -> ShardRef:
    """Durably write one shard holding ``parts`` = (piece, its raw bytes, requested codec)."""
    records: list[SliceRecord] = []
    payloads: list[memoryview] = []
    offset = 0
    for piece, raw, requested in parts:
        region = regions[piece.ordinal]
        codec = choose_codec(raw, requested)
        stored = raw if codec == "raw" else memoryview(
            zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True).compress(raw))
        offset = aligned(offset)
        records.append(SliceRecord(
            ordinal=piece.ordinal, dtype=region.dtype, shape=region.shape, lo=piece.lo, hi=piece.hi, offset=offset,
            stored=len(stored), codec=codec, raw=len(raw), blake3=_PLACEHOLDER,
            stored_blake3=_PLACEHOLDER if codec == "zstd" else None,
        ))
        payloads.append(stored)
        offset += len(stored)
    head_len = len(encode_head(shard_header(prefix, schema_digest, records)))

    def write(fd: int) -> str:
        futures = []
        for record, stored, (_, raw, _) in zip(records, payloads, parts):
            futures.append((pool.submit(_hash, raw), pool.submit(_hash, stored) if record.codec == "zstd" else None))
            _pwrite_all(fd, stored, head_len + record.offset)
        final = []
        for record, (raw_f, stored_f) in zip(records, futures):
            final.append(SliceRecord(**{**record.__dict__, "blake3": raw_f.result(),
                                        "stored_blake3": stored_f.result() if stored_f else None}))
        head = encode_head(shard_header(prefix, schema_digest, final))
        assert len(head) == head_len, "digest placeholders must not change the head length"
        _pwrite_all(fd, memoryview(head), 0)
        # Zero padding is implicit: pwrite past a hole leaves zeros.
        end = head_len + max((r.offset + r.stored for r in records), default=0)
        if os.fstat(fd).st_size != end:
            os.ftruncate(fd, end)
        return digest_bytes(head)

    digest, _ = store.put_object(write)
    size = head_len + max((r.offset + r.stored for r in records), default=0)
    return ShardRef(digest, size, tuple((p.ordinal, p.lo, p.hi) for p, _, _ in parts))


def write_shards(store: Store, prefix: CapturePrefix, regions: Sequence[RegionDecl],
                 shards: Sequence[Sequence[tuple[Piece, memoryview, str]]],
                 pool: ThreadPoolExecutor | None = None) -> list[ShardRef]:
    """Durably write each shard (its (piece, raw bytes, codec) parts in physical order)."""
    schema = schema_digest_of(regions)
    if pool is not None:
        return [write_shard(store, prefix, schema, regions, parts, pool) for parts in shards]
    if not shards:
        return []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="alpha-ckpt-hash") as own_pool:
        return [write_shard(store, prefix, schema, regions, parts, own_pool) for parts in shards]


def write_manifest(store: Store, prefix: CapturePrefix, regions: Sequence[RegionDecl], shards: Sequence[ShardRef],
                   owners: int, metadata: Any, publisher: Publisher = STAR,
                   children: Sequence[ChildRef] = ()) -> tuple[str, int]:
    """Durably write a manifest (the star's root, or one tree group manifest); returns (digest, size)."""
    head = encode_head(manifest_header(prefix, schema_digest_of(regions), regions, shards, owners, metadata,
                                       publisher, children))

    def write(fd: int) -> str:
        _pwrite_all(fd, memoryview(head), 0)
        return digest_bytes(head)

    digest, _ = store.put_object(write, digest_hint=digest_bytes(head))
    return digest, len(head)


def publish_slices(store: Store, prefix: CapturePrefix, regions: Sequence[RegionDecl],
                   shards: Sequence[Sequence[tuple[Piece, memoryview, str]]], *, metadata: Any = None,
                   owners: int = 1) -> Published:
    """Write each shard (its (piece, raw bytes, codec) parts in physical order), the manifest, then the ref."""
    with store.pending_publish(prefix.run, prefix.step):  # gc spares what this publish writes or reuses
        shard_refs = write_shards(store, prefix, regions, shards)
        root, root_size = write_manifest(store, prefix, regions, shard_refs, owners, metadata)
        total = root_size + sum(s.size for s in shard_refs)
        record = store.publish_ref(prefix, root, root_size, total, owners=owners)
    return Published(root, record, tuple(shard_refs))


def save_state(state_dict: Mapping[str, Any], *, store: Store, prefix: CapturePrefix, metadata: Any = None,
               compression: str | Mapping[str, str] = "raw", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Published:
    check_name(prefix.run, "run")
    check_name(prefix.step, "step")
    canonical_json(metadata)  # refuse non-JSON metadata before writing anything
    named = flatten_state(state_dict)
    regions = regions_of(named)
    _check_compression(compression, {r.name for r in regions})
    data = {r.ordinal: _u8_view(word_bytes(t)) for r, (_, t) in zip(regions, named)}
    pieces = [Piece(r.ordinal, 0, r.words, DTYPES[r.dtype][0]) for r in regions]
    shards = []
    for group in pack_shards(pieces, max_shard_bytes):
        parts = []
        for p in group:
            region = regions[p.ordinal]
            codec = compression if isinstance(compression, str) else compression.get(region.name, "raw")
            parts.append((p, data[p.ordinal][p.lo * p.itemsize:p.hi * p.itemsize], codec))
        shards.append(parts)
    return publish_slices(store, prefix, regions, shards, metadata=metadata)
