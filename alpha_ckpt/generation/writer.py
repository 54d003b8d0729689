"""Writing a generation: shards straight from tensor memory, then the manifest, then the ref.

Hashing overlaps writing: while the calling thread writes a slice's bytes to
the file (the kernel copy releases the GIL), a worker hashes the same memory
(BLAKE3 releases the GIL too), so a save costs about the write time, not the
write time plus the hash time. The head carries fixed-width hex digests, so
its length is known before the digests are: the payload is written first at
its final offset and the head last.
"""
from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import zstandard

from alpha_ckpt.store import durable
from alpha_ckpt.format.records import (
    BLOCK_BYTES, DTYPES, STAR, CapturePrefix, ChildRef, ManifestHead, Publisher, RegionDecl, ShardRef, SliceRecord, aligned, block_count,
    block_digests, blocked, check_json_value, check_name, digest_bytes, encode_head,
    manifest_header, schema_digest_of, shard_header,
)
from alpha_ckpt.runtime.heap import cyclic_gc_paused
from alpha_ckpt.state.manifest import check_root_manifest, decode_manifest
from alpha_ckpt.runtime.options import pattern_list
from alpha_ckpt.state.capture import CapturedState, capture_state
from alpha_ckpt.generation.planner import Piece, pack_shards
from alpha_ckpt.generation.hashing import (  # noqa: F401 (re-exported: imported from here)
    HASH_BATCH_BYTES, INLINE_HASH_BYTES, HashBatch, Ready, hash_stored, hash_part, hash_small, refuse_non_finite,
)
from alpha_ckpt.generation.packing import (  # noqa: F401 (re-exported: imported from here)
    ZSTD_LEVEL, DEFAULT_DISK_BYTES_PER_S, ShardCarry, check_compression, choose_codec, cut_part, group_parts,
    word_bytes, word_view, zstd_pays,
)
from alpha_ckpt.generation.reader import validate_object_file
from alpha_ckpt.store import RefRecord, Store, check_fence
from alpha_ckpt.store.backend import ObjectContent, ObjectWriter

# The largest shard file a save writes. Buffered writes to one file are serialized by the kernel
# (one writer at a time per inode), so a larger file is written by one thread however many the
# store runs; at most this size, a large save is several files that Store.write_threads write at once.
DEFAULT_MAX_SHARD_BYTES = 128 << 20
_PLACEHOLDER = "0" * 64


DEDUP_MIN_BYTES = 1 << 20  # a region at least this large gets a shard of its own, so it can be carried
MAX_PIECE_BYTES = DEFAULT_MAX_SHARD_BYTES  # a larger part is cut into shards of at most this many bytes


def isolate_large_pieces(shards: Sequence[Sequence[tuple]], min_bytes: int = DEDUP_MIN_BYTES) -> list[list[tuple]]:
    """Give every part of at least ``min_bytes`` a shard of its own; the small parts stay together.

    A part larger than :data:`MAX_PIECE_BYTES` is cut into consecutive parts of at most that many
    bytes, each in a shard of its own, and the small parts go into shards of at most that many
    bytes: a shard's head holds one block digest per 64 KiB, so one shard must stay far below
    64 GiB (the header limit is 64 MiB).
    """
    limit = max(BLOCK_BYTES, MAX_PIECE_BYTES // BLOCK_BYTES * BLOCK_BYTES)
    out: list[list[tuple]] = []
    for parts in shards:
        out += [[cut] for part in parts if len(part[1]) >= min_bytes for cut in cut_part(part, limit)]
        out += group_parts([p for p in parts if len(p[1]) < min_bytes], limit)
    return out


@dataclass(frozen=True)
class Published:
    root: str
    ref: RefRecord
    shards: tuple[ShardRef, ...]


_WRITEBACK_MIN_BYTES = 8 << 20


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    start, length = offset, len(view)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    if length >= _WRITEBACK_MIN_BYTES:
        durable.start_writeback(fd, start, length)


_GATHER_BYTES = 1 << 20  # segments smaller than this are copied together and written by one pwrite
_GATHER_GAP = 4096       # the most zero bytes (alignment padding) a gathered run spans between two


def _pwrite_segments(fd: int, segments: Sequence[tuple[int, memoryview]]) -> None:
    """pwrite each (offset, bytes) in order. Segments under :data:`_GATHER_BYTES` are first copied
    together, their padding zero, and written by one pwrite per ~:data:`_GATHER_BYTES`: a shard of
    100,000 small slices costs about a hundred system calls, not 100,000. Writeback is started for
    every run of at least :data:`_WRITEBACK_MIN_BYTES` written, however small the segments: a shard
    of many small slices otherwise leaves its whole size dirty for the final fsync to write."""
    dirty_start, dirty_end = None, 0
    gathered, gathered_at = bytearray(), 0

    def write(offset: int, view) -> None:
        nonlocal dirty_start, dirty_end
        _pwrite_all(fd, memoryview(view), offset)
        if len(view) >= _WRITEBACK_MIN_BYTES:
            return  # _pwrite_all started its writeback
        if dirty_start is None or offset < dirty_end:
            dirty_start = offset
        dirty_end = offset + len(view)
        if dirty_end - dirty_start >= _WRITEBACK_MIN_BYTES:
            durable.start_writeback(fd, dirty_start, dirty_end - dirty_start)
            dirty_start = None

    for offset, view in segments:
        end = gathered_at + len(gathered)
        if gathered and (len(view) >= _GATHER_BYTES or not end <= offset <= end + _GATHER_GAP):
            write(gathered_at, gathered)
            gathered = bytearray()
        if len(view) >= _GATHER_BYTES:
            write(offset, view)
            continue
        if not gathered:
            gathered_at = offset
        gathered += bytes(offset - gathered_at - len(gathered))  # padding: zero, as a hole reads
        gathered += view
        if len(gathered) >= _GATHER_BYTES:
            write(gathered_at, gathered)
            gathered = bytearray()
    if gathered:
        write(gathered_at, gathered)
    if dirty_start is not None and dirty_end > dirty_start:
        durable.start_writeback(fd, dirty_start, dirty_end - dirty_start)


_DIRECT_BLOCK = 16 << 20        # bytes per O_DIRECT write, from a reused page-aligned buffer
_DIRECT_ALIGN = 4096            # O_DIRECT offsets and lengths: multiples of the logical block size
DIRECT_MIN_BYTES = 16 << 20     # smaller files are written buffered: too short to win anything
# (16 MiB, not 32: the pieces of a region split over 4+ ranks are often that small, and where fresh
# page-cache pages are dear a 4-rank save ran 15-40 % faster with them measured for O_DIRECT too)
_direct_buffers = threading.local()


def _aligned_buffers() -> list[mmap.mmap]:
    """Three reused page-aligned blocks per thread: the first block (written last) and two in flight."""
    bufs = getattr(_direct_buffers, "bufs", None)
    if bufs is None or len(bufs[0]) < _DIRECT_BLOCK:
        bufs = _direct_buffers.bufs = [mmap.mmap(-1, _DIRECT_BLOCK) for _ in range(3)]
    return bufs


def _fill(buf, start: int, end: int, segments: Sequence[tuple[int, memoryview]], starts: Sequence[int]) -> None:
    """Copy the file bytes [start, end) into ``buf[:end - start]``, gaps zero.

    ``segments`` are in file order; ``starts`` (their offsets) lets a block find its first
    segment by bisection instead of scanning them all (a shard may hold thousands of slices).
    """
    out = np.frombuffer(buf, dtype=np.uint8)
    first = max(0, bisect.bisect_right(starts, start) - 1)
    pos = start  # bytes of the block before pos are filled
    for offset, view in segments[first:]:
        if offset >= end:
            break
        lo, hi = max(start, offset), min(end, offset + len(view))
        if lo < hi:
            out[pos - start:lo - start] = 0
            out[lo - start:hi - start] = np.frombuffer(view[lo - offset:hi - offset], dtype=np.uint8)
            pos = hi
    out[pos - start:end - start] = 0


def write_direct(fd: int, total: int, segments: Sequence[tuple[int, memoryview]], head: Callable[[], bytes],
                 writer: ThreadPoolExecutor, head_len: int = 0) -> bool:
    """Write a file with O_DIRECT from reused aligned buffers; False (nothing written) if refused.

    ``segments`` are (file offset, bytes) of the payload; ``head()`` gives the
    bytes at offset 0, called once every payload block is written (it waits
    for the digests). Copying a block into the buffer overlaps writing the
    previous one; the page cache is bypassed, so there are no page faults on
    fresh page-cache memory, which cap buffered writes here near 1 GB/s.

    Only the aligned run that holds the head waits for the digests, so what is
    written after the hashing is a few pages, not a block; the unaligned last
    bytes are written buffered, so the file never needs truncating.
    """
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        return False
    direct_end = total - total % _DIRECT_ALIGN
    head_end = min(direct_end, head_len + (-head_len % _DIRECT_ALIGN))
    first, *spare = _aligned_buffers()
    if head_end > len(first):
        first = mmap.mmap(-1, head_end)
    starts = [offset for offset, _ in segments]
    try:
        pending = []
        for i, start in enumerate(range(head_end, direct_end, _DIRECT_BLOCK)):
            buf = spare[i % 2]
            if len(pending) == 2:
                pending.pop(0).result()  # the buffer is free again
            end = min(direct_end, start + _DIRECT_BLOCK)
            _fill(buf, start, end, segments, starts)
            pending.append(writer.submit(_pwrite_all, fd, memoryview(buf)[:end - start], start))
        for f in pending:
            f.result()
        with_head = [(0, memoryview(head()))] + list(segments)
        with_head_starts = [0] + starts
        if head_end:
            _fill(first, 0, head_end, with_head, with_head_starts)
            _pwrite_all(fd, memoryview(first)[:head_end], 0)
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    if direct_end < total:
        tail = bytearray(total - direct_end)
        _fill(tail, direct_end, total, with_head, with_head_starts)
        _pwrite_all(fd, memoryview(tail), direct_end)
    return True


@dataclass
class ShardWrite:
    """One shard ready to be written: ``write(fd)`` writes it and returns its name; ``size`` bytes
    (its raw bytes until it is written, then its file's size).

    ``mode`` ('direct' or 'buffered') is how a large shard is written, set before it is committed;
    a shard under :data:`DIRECT_MIN_BYTES` is always written buffered.
    """
    size: int
    parts: tuple[tuple[int, int, int], ...]  # (ordinal, lo, hi) of each part, as its ShardRef names them
    write: Callable[[int], str] = lambda fd: ""
    mode: str = "buffered"
    refused_direct: bool = False             # set when the file system refused O_DIRECT for it

    @property
    def large(self) -> bool:
        return self.size >= DIRECT_MIN_BYTES


def prepare_shard(store: Store, prefix: CapturePrefix, schema_digest: str, regions: Sequence[RegionDecl],
                  parts: Sequence[tuple[Piece, memoryview, str]], pool: ThreadPoolExecutor,
                  raw_digests: Sequence[tuple[str, str | None] | None] = (),
                  digests_out: list[tuple[str, str | None]] | None = None,
                  check_finite: bool = True, writers: int = 1) -> ShardWrite:
    """One shard holding ``parts`` = (piece, its raw bytes, requested codec), ready for a durable commit.

    ``raw_digests`` may give parts' raw (digest, block digests) as :func:`block_digests` computes
    them, so they are not hashed twice;
    ``digests_out``, if given, receives every part's raw (digest, block digests) (replacing what it held).
    Every float word is checked while it is hashed: a NaN or inf raises a ``non-finite``
    :class:`Refusal` naming the region and word from the write, so the shard is not committed.
    ``writers``: how many processes write at once (what the disk rate that decides compression is measured under).
    """
    known = list(raw_digests) + [None] * (len(parts) - len(raw_digests))

    def layout() -> tuple[list[SliceRecord], list[memoryview], int, int]:
        """The slice records, payloads, head length and size: compressed only when the shard is
        written, so a batch holds the compressed bytes of only the shards being written at once
        (``store.write_threads``)."""
        records: list[SliceRecord] = []
        payloads: list[memoryview] = []
        offset = 0
        disk = store.write_modes.measured_bytes_per_s(writers) or DEFAULT_DISK_BYTES_PER_S
        for piece, raw, requested in parts:
            region = regions[piece.ordinal]
            codec = choose_codec(raw, requested, disk)
            stored = raw if codec == "raw" else memoryview(
                zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True).compress(raw))
            offset = aligned(offset)
            records.append(SliceRecord(
                ordinal=piece.ordinal, dtype=region.dtype, shape=region.shape, lo=piece.lo, hi=piece.hi, offset=offset,
                stored=len(stored), codec=codec, raw=len(raw), blake3=_PLACEHOLDER,
                stored_blake3=_PLACEHOLDER if codec == "zstd" else None,
                blocks=_PLACEHOLDER * block_count(len(raw)) if blocked(len(raw)) else None,
            ))
            payloads.append(stored)
            offset += len(stored)
        head_len = len(encode_head(shard_header(prefix, schema_digest, records)))

        end = head_len + max((r.offset + r.stored for r in records), default=0)
        return records, payloads, head_len, end

    def prepare() -> tuple[Callable[[], bytes], list[tuple[int, memoryview]], int, int]:
        """Lay the shard out and start hashing it: (head(), the payload's (offset, bytes), head length, size);
        head() waits for the digests (and refuses a non-finite word)."""
        records, payloads, head_len, end = layout()
        shard.size = end
        futures = []
        batch = HashBatch()  # small raw parts, hashed together: one task per batch, not one per tensor
        for record, stored, (piece, raw, _), digest in zip(records, payloads, parts, known):
            check = check_finite and not regions[piece.ordinal].nonfinite
            if not check and digest is not None:
                raw_f = Ready((*digest, None))
            elif len(raw) <= INLINE_HASH_BYTES:
                raw_f = Ready(hash_small(raw, record.dtype, digest, check))
            elif len(raw) < HASH_BATCH_BYTES:
                raw_f = batch.add((raw, record.dtype, digest, check))
                if batch.full():
                    batch.submit(pool)
                    batch = HashBatch()
            else:
                raw_f = pool.submit(hash_part, raw, record.dtype, digest, check)
            futures.append((raw_f, pool.submit(hash_stored, stored) if record.codec == "zstd" else None))
        if batch.jobs:
            batch.submit(pool)

        encoded_head: list[bytes] = []

        def head() -> bytes:
            if encoded_head:
                return encoded_head[0]
            final = []
            for record, (raw_f, stored_f), (piece, raw, _) in zip(records, futures, parts):
                raw_digest, blocks, bad = raw_f.result()
                if bad is not None:
                    raise refuse_non_finite(regions[piece.ordinal], piece, raw, bad)
                final.append(SliceRecord(**{**record.__dict__, "blake3": raw_digest, "blocks": blocks,
                                            "stored_blake3": stored_f.result() if stored_f else None}))
            encoded = encode_head(shard_header(prefix, schema_digest, final))
            assert len(encoded) == head_len, "digest placeholders must not change the head length"
            encoded_head.append(encoded)
            if digests_out is not None:
                digests_out[:] = [(r.blake3, r.blocks) for r in final]
            return encoded

        segments = [(head_len + r.offset, stored) for r, stored in zip(records, payloads)]
        return head, segments, head_len, end

    def content() -> ObjectContent:
        """The shard read where its bytes lie (tensor memory, compressed copies), for a backend that uploads it."""
        head, segments, _, end = prepare()
        encoded = head()
        return ObjectContent(digest_bytes(encoded), end, ((0, memoryview(encoded)), *segments))

    def write(fd: int) -> str:
        head, segments, head_len, end = prepare()
        if end >= DIRECT_MIN_BYTES and shard.mode == "direct":
            if write_direct(fd, end, segments, head, _direct_writer(), head_len):
                return digest_bytes(head())
            shard.refused_direct = True  # this file system refuses O_DIRECT: buffered from now on
        _pwrite_segments(fd, segments)
        encoded = head()
        _pwrite_all(fd, memoryview(encoded), 0)
        # Zero padding is implicit: pwrite past a hole leaves zeros.
        if os.fstat(fd).st_size != end:
            os.ftruncate(fd, end)
        return digest_bytes(encoded)

    # Sized by its raw bytes until written (a compressed shard is smaller): what decides "large" for planning.
    shard = ShardWrite(sum(len(raw) for _, raw, _ in parts), tuple((p.ordinal, p.lo, p.hi) for p, _, _ in parts),
                       ObjectWriter(write, content))
    return shard


COMMIT_BATCH = 64  # shards per durable commit: each holds a descriptor open from its write to its fsync


def commit_shards(store: Store, shards: Sequence[ShardWrite], writers: int = 1,
                  agreed_mode: str | None = None) -> list[ShardRef]:
    """Durably write prepared shards, in batches of :data:`COMMIT_BATCH` (one batched commit each).

    Each batch's write mode is the store's choice (:meth:`WriteModes.next`), and its
    throughput (its large shards' bytes over its time) is what the store learns the modes
    from, for ``writers`` processes writing at once. While the store probes a mode, a batch ends
    at its first large shard: the first save of a process measures both modes on a few shards,
    not on whole saves. ``agreed_mode`` (:meth:`WriteModes.for_save` of the save's coordinator)
    is used for every batch this store would not probe with, so that a save's ranks write alike.
    """
    out: list[ShardRef] = []
    at = 0
    while at < len(shards):
        mode, probe = store.write_modes.next(writers, agreed_mode)
        take = COMMIT_BATCH
        if probe:  # up to the next large shard (small ones are written buffered whatever the mode)
            take = next((i + 1 for i, s in enumerate(shards[at:at + COMMIT_BATCH]) if s.large), COMMIT_BATCH)
        batch = shards[at:at + take]
        at += len(batch)
        for s in batch:
            s.mode = mode
        started = time.perf_counter()
        results = store.put_objects([s.write for s in batch], validate=validate_object_file)
        seconds = time.perf_counter() - started
        large = [s for s, (_, written) in zip(batch, results) if s.large and written]
        if large:
            refused = any(s.refused_direct for s in large)
            store.write_modes.record("buffered" if refused else mode, sum(s.size for s in large), seconds, refused, writers)
        out += [ShardRef(digest, s.size, s.parts) for s, (digest, _) in zip(batch, results)]
    return out


_writers = threading.local()


def _direct_writer() -> ThreadPoolExecutor:
    """This thread's one O_DIRECT write thread (its writes overlap the next block's copy)."""
    pool = getattr(_writers, "pool", None)
    if pool is None:
        pool = _writers.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alpha-ckpt-direct")
    return pool


def write_shards(store: Store, prefix: CapturePrefix, regions: Sequence[RegionDecl],
                 shards: Sequence[Sequence[tuple[Piece, memoryview, str]]],
                 pool: ThreadPoolExecutor | None = None, carry: ShardCarry | None = None,
                 check_finite: bool = True, digests_out: dict | None = None, writers: int = 1,
                 agreed_mode: str | None = None) -> list[ShardRef]:
    """Durably write each shard (its (piece, raw bytes, codec) parts in physical order).

    With ``carry``, large parts get shards of their own, and a part whose bytes
    are those this writer already stored for the same run/step is not written
    again: its old shard is named, marked carried. ``digests_out``, if given,
    receives every part's raw (digest, block digests) under its (ordinal, lo, hi),
    as hashed while it was written (a caller that needs them hashes nothing again).
    ``writers`` is how many processes write this save at once (the ranks of a collective save): the
    store learns its write modes per count (:meth:`WriteModes.next`); ``agreed_mode`` as
    :func:`commit_shards`.
    """
    schema = schema_digest_of(regions)
    if not shards:
        return []
    if carry is not None:
        shards = isolate_large_pieces(shards)
    if pool is None:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="alpha-ckpt-hash") as own_pool:
            return _write_all(store, prefix, schema, regions, shards, own_pool, carry, check_finite, digests_out,
                              writers, agreed_mode)
    return _write_all(store, prefix, schema, regions, shards, pool, carry, check_finite, digests_out, writers,
                      agreed_mode)


def _write_all(store, prefix, schema, regions, shards, pool, carry, check_finite, digests_out, writers,
               agreed_mode) -> list[ShardRef]:
    out: list[ShardRef | None] = []
    to_write: list[tuple[int, ShardWrite, list, tuple | None]] = []  # (index in out, shard, its digests, carry key)
    for parts in shards:
        key = known = None
        if carry is not None and len(parts) == 1:
            piece, raw, codec = parts[0]
            key = ShardCarry.key(prefix, schema, piece, codec)
            # Hash first only where there is something to compare with; otherwise the
            # digest is computed while the shard is written, as for any shard.
            known = [block_digests(raw)] if carry.knows(key) else []
            record = carry.find(key, prefix, known[0][0], store) if known else None
            if record is not None:
                if digests_out is not None:
                    digests_out[(piece.ordinal, piece.lo, piece.hi)] = known[0]
                out.append(record)
                continue
        digests: list[tuple[str, str | None]] = list(known or [])
        to_write.append((len(out), prepare_shard(store, prefix, schema, regions, parts, pool, known or (),
                                                 digests_out=digests, check_finite=check_finite, writers=writers),
                         digests, key))
        out.append(None)
    committed = commit_shards(store, [w for _, w, _, _ in to_write], writers, agreed_mode)
    for (index, _, digests, key), record in zip(to_write, committed):
        out[index] = record
        if key is not None:
            carry.remember(key, digests[0][0], record, prefix)
        if digests_out is not None:
            digests_out.update(zip(record.slices, digests))
    return out  # type: ignore[return-value]


def encode_manifest(prefix: CapturePrefix, regions: Sequence[RegionDecl], shards: Sequence[ShardRef],
                    owners: int, metadata: Any, publisher: Publisher = STAR,
                    children: Sequence[ChildRef] = (), state: Any = None) -> bytes:
    """A manifest's bytes (the whole object: a manifest has no payload)."""
    return encode_head(manifest_header(prefix, schema_digest_of(regions), regions, shards, owners, metadata,
                                       publisher, children, state))


def write_manifest(store: Store, prefix: CapturePrefix, regions: Sequence[RegionDecl], shards: Sequence[ShardRef],
                   owners: int, metadata: Any, publisher: Publisher = STAR,
                   children: Sequence[ChildRef] = (), state: Any = None,
                   check: Callable[[ManifestHead], None] | None = None) -> tuple[str, int]:
    """Durably write a manifest (the star's root, or one tree group manifest); returns (digest, size).

    ``state`` is the typed skeleton of the saved state (root manifests). ``check`` (a root's
    publisher: :func:`alpha_ckpt.state.manifest.check_root_manifest`) gets the manifest decoded from its
    bytes exactly as a reader decodes them, before anything is written; it raises a Refusal.
    """
    head = encode_manifest(prefix, regions, shards, owners, metadata, publisher, children, state)
    if check is not None:
        check(decode_manifest(head, f"root manifest {digest_bytes(head)[:16]}..."))

    def write(fd: int) -> str:
        _pwrite_all(fd, memoryview(head), 0)
        return digest_bytes(head)

    digest, _ = store.put_object(write, digest_hint=digest_bytes(head), validate=validate_object_file)
    return digest, len(head)


def publish_slices(store: Store, prefix: CapturePrefix, regions: Sequence[RegionDecl],
                   shards: Sequence[Sequence[tuple[Piece, memoryview, str]]], *, metadata: Any = None,
                   owners: int = 1, carry: ShardCarry | None = None, follows: int | None = None,
                   state: Any = None) -> Published:
    """Write each shard (its (piece, raw bytes, codec) parts in physical order), the manifest, then the ref.

    Refuses (nothing published) what a restore would refuse (a NaN or inf word, a root manifest
    :func:`~alpha_ckpt.state.manifest.check_root_manifest` refuses) and what would fork the history (:func:`alpha_ckpt.store.check_fence`;
    ``follows`` as there).
    """
    with store.pending_publish(prefix.run, prefix.step):  # gc spares what this publish writes or reuses
        shard_refs = write_shards(store, prefix, regions, shards, carry=carry)
        root, root_size = write_manifest(
            store, prefix, regions, shard_refs, owners, metadata, state=state,
            check=lambda m: check_root_manifest(m, shard_refs, f"root manifest {m.digest[:16]}...", metadata=metadata))
        total = root_size + sum(s.size for s in shard_refs)
        record = store.publish_ref(prefix, root, root_size, total, owners=owners, follows=follows)
    return Published(root, record, tuple(shard_refs))


@cyclic_gc_paused()
def save_state(state: Mapping[str, Any] | CapturedState, *, store: Store, prefix: CapturePrefix,
               metadata: Any = None, compression: str | Mapping[str, str] = "raw",
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, carry: ShardCarry | None = None,
               allow_nonfinite: Sequence[str] = ()) -> Published:
    """Publish ``state`` (anything :func:`alpha_ckpt.state.capture_state` takes, or what it returned)."""
    check_name(prefix.run, "run")
    check_name(prefix.step, "step")
    check_json_value(metadata, "metadata")  # refused before writing anything: a reader gets it back as given
    history = store.history(prefix.run, prefix.step, whole=False)
    if not (history.newest is not None and history.newest.prefix == prefix):  # decided by its root, at publish
        check_fence(history, prefix, None)  # a save the history refuses writes nothing (publish checks again)
    captured = state if isinstance(state, CapturedState) else capture_state(state)
    regions = captured.regions(pattern_list(allow_nonfinite, "allow_nonfinite"))
    check_compression(compression, {r.name for r in regions})
    data = {r.ordinal: word_view(t) for r, (_, t) in zip(regions, captured.named)}
    pieces = [Piece(r.ordinal, 0, r.words, DTYPES[r.dtype][0]) for r in regions]
    shards = []
    for group in pack_shards(pieces, max_shard_bytes):
        parts = []
        for p in group:
            region = regions[p.ordinal]
            codec = compression if isinstance(compression, str) else compression.get(region.name, "raw")
            parts.append((p, data[p.ordinal][p.lo * p.itemsize:p.hi * p.itemsize], codec))
        shards.append(parts)
    return publish_slices(store, prefix, regions, shards, metadata=metadata, carry=carry, state=captured.skeleton)
