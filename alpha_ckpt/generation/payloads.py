"""Checking payload bytes: a slice's BLAKE3 (whole or by 64 KiB block), its zstd frame, the zero
padding between slices and the finiteness of floating-point words, read ahead from the mapped files
on a few threads; and whole objects checked as verify checks them, before a writer keeps them.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import blake3
import zstandard

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.decoding import decode_head, padding_ranges, parse_manifest_header, parse_shard_header, split_head
from alpha_ckpt.format.records import BLOCK_BYTES, DTYPES, ManifestHead, RegionDecl, ShardHead, SliceRecord, hash_blocks
from alpha_ckpt.generation.opening import Generation, read_head
from alpha_ckpt.state.manifest import first_non_finite, word_value
from alpha_ckpt.store import ObjectFile


def _first_non_finite(rec: SliceRecord, raw: memoryview, start: int = 0, end: int | None = None) -> int | None:
    """Index (within the slice) of the first NaN/inf word in raw bytes [start, end), or None."""
    return first_non_finite(raw, rec.dtype, start, end)


def _word_value(rec: SliceRecord, raw: memoryview, index: int) -> float:
    return word_value(raw, rec.dtype, index)


def _refuse_non_finite(rec: SliceRecord, index: int, value: float, what: str) -> Refusal:
    return Refusal(RefusalCode.NON_FINITE, f"{what}: word {rec.lo + index} is {value} (a region that may hold "
                   "NaN/inf is declared so at save: allow_nonfinite)")


_CHUNK = 16 << 20  # unit of reading ahead, hashing and finiteness checks
_SMALL_RESTORE = 1 << 20  # below this many stored bytes, validate in the calling thread


def _no_wait(upto: int) -> None:
    return None


def _check_blocks(rec: SliceRecord, raw: memoryview, start: int, code: RefusalCode, what: str) -> None:
    """Check raw bytes [start, start + len(raw)) of a slice (``start`` a block boundary; the range ends on
    one or at the slice's end) against the slice's block digests."""
    for i, digest in enumerate(hash_blocks(raw)):
        at = start + i * BLOCK_BYTES
        if digest != rec.block_digest(at // BLOCK_BYTES):
            raise Refusal(code, f"{what}: BLAKE3 of its bytes [{at}, {min(at + BLOCK_BYTES, rec.raw)}) "
                          "does not match the header")


def read_span(rec: SliceRecord, lo_byte: int, hi_byte: int) -> tuple[int, int]:
    """The stored bytes of ``rec`` to read and verify for its raw bytes [lo_byte, hi_byte): the blocks
    that hold them for a raw slice with block digests, else the whole slice."""
    if rec.codec != "raw" or rec.blocks is None:
        return 0, rec.stored
    return lo_byte - lo_byte % BLOCK_BYTES, min(rec.stored, -(-hi_byte // BLOCK_BYTES) * BLOCK_BYTES)


def decode_slice(rec: SliceRecord, stored: memoryview, what: str,
                 wait: Callable[[int], None] = _no_wait, keep: bool = True,
                 advance: Callable[[int], None] | None = None, finite: bool = True,
                 region: str | None = None, span: tuple[int, int] | None = None,
                 checked: bool = False) -> memoryview | None:
    """Check a slice's stored bytes and return its raw words (a view, or a decompressed copy).

    ``span`` (from :func:`read_span`) limits a raw slice with block digests to the stored bytes
    [a, b): only they are checked (``wait`` then counts from a), and only they may be used.
    ``wait(n)`` returns once the first n stored bytes are in memory: raw slices
    are hashed chunk by chunk as they arrive. With ``keep=False`` (verification
    only) a zstd slice is checked through one bounded chunk buffer and nothing
    is returned, so no declared size is ever allocated. ``advance(n)`` is told
    the stored bytes checked so far (per chunk of a raw slice, once per zstd
    slice), for a progress bar; it may be called from several threads. With
    ``finite=False`` only the bytes' integrity is checked, not the words' values.
    ``region`` is the region's dotted name, for messages (a shard alone knows only its ordinal).
    ``checked``: a raw slice of an object whose every slice was validated already (``ObjectFile.checked``)
    is returned as it is.
    """
    named = repr(region) if region is not None else f"ordinal {rec.ordinal}"
    w = f"{what} slice of region {named} words [{rec.lo}, {rec.hi})"
    if rec.codec == "raw":
        first, last = span if span is not None else (0, len(stored))
        if (first, last) != (0, len(stored)) and (rec.blocks is None or (first, last) != read_span(rec, first, last)):
            raise ValueError(f"{w}: span {span} is not whole blocks of a slice with block digests")
        if checked:
            wait(last - first)
            return stored
        hasher = blake3.blake3() if rec.blocks is None else None
        bad = None
        for start in range(first, last, _CHUNK):
            end = min(start + _CHUNK, last)
            wait(end - first)
            if hasher is None:
                _check_blocks(rec, stored[start:end], start, RefusalCode.CORRUPT_SHARD, w)
            else:
                hasher.update(stored[start:end])
            if bad is None and finite:
                bad = _first_non_finite(rec, stored, start, end)
            if advance is not None:
                advance(end - start)
        # A damaged byte is reported as corrupt even where it also reads as NaN.
        if hasher is not None and hasher.hexdigest() != rec.blake3:
            raise Refusal(RefusalCode.CORRUPT_SHARD, f"{w}: BLAKE3 of its bytes does not match the header")
        if bad is not None:
            raise _refuse_non_finite(rec, bad, _word_value(rec, stored, bad), w)
        return stored
    wait(len(stored))
    if blake3.blake3(stored).hexdigest() != rec.stored_blake3:
        raise Refusal(RefusalCode.CORRUPT_SHARD, f"{w}: BLAKE3 of its compressed bytes does not match the header")
    _check_zstd_frame(stored, rec.raw, w)
    # Decompress chunk by chunk: into the slice's own buffer when the caller keeps
    # it (its size is the destination's), else through one reused chunk buffer.
    out = bytearray(rec.raw) if keep else None
    scratch = None if keep else bytearray(min(_CHUNK, rec.raw))
    hasher, bad, pos = blake3.blake3(), None, 0
    size = DTYPES[rec.dtype][0]
    try:
        with zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False) as reader:
            while pos < rec.raw:
                target = memoryview(out)[pos:pos + _CHUNK] if keep else memoryview(scratch)[:min(_CHUNK, rec.raw - pos)]
                filled = 0
                while filled < len(target):
                    n = reader.readinto(target[filled:])
                    if n == 0:
                        break
                    filled += n
                if filled < len(target):  # the frame ended early: refused below by the length check
                    pos += filled
                    break
                if rec.blocks is None:
                    hasher.update(target)
                else:
                    _check_blocks(rec, target, pos, RefusalCode.FORMAT, f"{w}: decompressed")
                if bad is None and finite:
                    local = _first_non_finite(rec, target)
                    if local is not None:
                        bad = (pos // size + local, _word_value(rec, target, local))
                pos += filled
            if reader.read(1):
                raise Refusal(RefusalCode.FORMAT, f"{w}: zstd frame decodes to more than the declared {rec.raw} bytes")
    except zstandard.ZstdError as exc:
        raise Refusal(RefusalCode.FORMAT, f"{w}: zstd frame does not decode ({exc})") from None
    if pos != rec.raw or (rec.blocks is None and hasher.hexdigest() != rec.blake3):
        raise Refusal(RefusalCode.FORMAT, f"{w}: decompressed bytes do not match the header's length and BLAKE3")
    if bad is not None:
        raise _refuse_non_finite(rec, bad[0], bad[1], w)
    if advance is not None:
        advance(len(stored))
    return memoryview(out) if keep else None


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _check_zstd_frame(stored: memoryview, raw: int, what: str) -> None:
    """Exactly one zstd frame, declaring exactly ``raw`` bytes, and nothing after it.

    python-zstandard allocates whatever size a frame claims, so the claim is
    checked before anything is decompressed; the frame's length is found by
    walking its block headers.
    """
    if bytes(stored[:4]) != _ZSTD_MAGIC:
        raise Refusal(RefusalCode.FORMAT, f"{what}: not a zstd frame")
    try:
        claimed = zstandard.frame_content_size(stored)
        position = zstandard.frame_header_size(stored)
        has_checksum = zstandard.get_frame_parameters(stored).has_checksum
    except zstandard.ZstdError as exc:
        raise Refusal(RefusalCode.FORMAT, f"{what}: bad zstd frame header ({exc})") from None
    if claimed != raw:
        raise Refusal(RefusalCode.FORMAT, f"{what}: zstd frame claims {claimed} bytes, header declares {raw}")
    while True:
        if position + 3 > len(stored):
            raise Refusal(RefusalCode.FORMAT, f"{what}: zstd frame is truncated")
        block = int.from_bytes(stored[position:position + 3], "little")
        block_type, block_size = (block >> 1) & 3, block >> 3
        if block_type == 3:
            raise Refusal(RefusalCode.FORMAT, f"{what}: zstd block of reserved type")
        position += 3 + (1 if block_type == 1 else block_size)  # an RLE block stores one byte
        if block & 1:
            break
    position += 4 if has_checksum else 0
    if position != len(stored):
        raise Refusal(RefusalCode.FORMAT, f"{what}: zstd frame is {position} bytes, the slice stores {len(stored)}")


def check_zero_padding(head: ShardHead, payload: memoryview, what: str) -> None:
    """Alignment gaps carry no digest of their own: they must be zero."""
    for a, b in padding_ranges(head):
        if any(payload[a:b]):
            raise Refusal(RefusalCode.CORRUPT_SHARD, f"{what}: alignment padding at payload byte {a} is not zero")


class _Cancelled(Exception):
    """Raised in a verifier still waiting for bytes after another one refused."""


class _Prefetcher:
    """Reads the slices in, in file order, ahead of the verifiers, on ``streams`` threads.

    The chunks to read are split into contiguous runs, one per stream: two
    concurrent sequential readers get more from a virtual disk than one (cold
    1 GiB: 0.44 s vs 0.56 s here). The threads mostly wait on I/O while the
    verifier threads hash what has arrived, so a cold restore costs about the
    read time, not the read time plus the hash time.
    """

    def __init__(self, jobs: Sequence[tuple[tuple[str, int], ObjectFile, int, int]], streams: int = 2):
        chunks = [(key, obj, offset, start, min(start + _CHUNK, length))
                  for key, obj, offset, length in jobs for start in range(0, length, _CHUNK)]
        total = sum(end - start for _, _, _, start, end in chunks)
        runs: list[list] = [[] for _ in range(max(1, streams))]
        done_bytes = 0
        for chunk in chunks:
            runs[min(len(runs) - 1, done_bytes * len(runs) // max(total, 1))].append(chunk)
            done_bytes += chunk[4] - chunk[3]
        self.runs = [r for r in runs if r]
        self._length = {key: length for key, _, _, length in jobs}
        self._arrived = {key: 0 for key, _, _, _ in jobs}  # bytes from the slice start that are in memory
        self._finished: dict[tuple[str, int], set[int]] = {key: set() for key, _, _, _ in jobs}  # chunk starts read
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._cancelled = False
        self._threads = [threading.Thread(target=self._read, args=(run,), name=f"alpha-ckpt-prefetch-{i}", daemon=True)
                         for i, run in enumerate(self.runs)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _read(self, run) -> None:
        try:
            for key, obj, offset, start, end in run:
                if self._cancelled:
                    return
                obj.populate(offset + start, end - start)
                with self._cond:
                    # Chunks of one slice may finish out of order (two streams):
                    # advance the contiguous prefix over every chunk that is in.
                    finished = self._finished[key]
                    finished.add(start)
                    arrived = self._arrived[key]
                    while arrived in finished:
                        finished.discard(arrived)
                        arrived = min(arrived + _CHUNK, self._length[key])
                    self._arrived[key] = arrived
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the verifiers, which raise it
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def order(self) -> list[tuple[str, int]]:
        """Verification order: alternate between the streams, each in file order."""
        per_run = [list(dict.fromkeys(c[0] for c in run)) for run in self.runs]
        out: list[tuple[str, int]] = []
        for i in range(max(map(len, per_run), default=0)):
            out.extend(keys[i] for keys in per_run if i < len(keys))
        return list(dict.fromkeys(out))

    def waiter(self, key: tuple[str, int]) -> Callable[[int], None]:
        def wait(upto: int) -> None:
            with self._cond:
                while self._arrived[key] < upto and self._error is None:
                    self._cond.wait()
                if self._error is not None and self._arrived[key] < upto:
                    raise self._error
        return wait

    def stop(self) -> None:
        with self._cond:
            self._cancelled = True
            if self._error is None:
                self._error = _Cancelled("verification stopped")
            self._cond.notify_all()
        for t in self._threads:
            t.join()


class Payloads:
    """Maps each shard once and validates slices in parallel (BLAKE3 and torch release the GIL)."""

    def __init__(self, shards: Mapping[str, tuple[ObjectFile, ShardHead]], regions: Sequence[RegionDecl] = ()):
        self.shards = shards
        self.regions = regions  # the manifest's: names for messages, and which regions may hold NaN/inf
        self._views: dict[str, memoryview] = {}
        self._lock = threading.Lock()

    def payload(self, digest: str) -> memoryview:
        with self._lock:
            view = self._views.get(digest)
            if view is None:
                obj, head = self.shards[digest]
                view = obj.view()[head.head_len:]
                self._views[digest] = view
            return view

    def check_padding(self, digest: str) -> None:
        check_zero_padding(self.shards[digest][1], self.payload(digest), f"shard {digest[:16]}...")

    def decode(self, wanted: Sequence[tuple[str, int]], *, keep: bool = True, workers: int = 2,
               advance: Callable[[int], None] | None = None, finite: bool = True,
               spans: Mapping[tuple[str, int], tuple[int, int]] | None = None,
               ) -> dict[tuple[str, int], memoryview | None]:
        """Validate the wanted slices (all of them, or raise the first refusal in file order).

        ``spans`` may limit a slice to the stored bytes [a, b) of :func:`read_span`: only they are
        read and checked (the returned view is the whole slice; only that span of it may be used).
        """
        spans = spans or {}

        def span_of(key: tuple[str, int]) -> tuple[int, int]:
            return spans.get(key) or (0, self.shards[key[0]][1].slices[key[1]].stored)

        def one(key: tuple[str, int], wait: Callable[[int], None]) -> memoryview | None:
            digest, index = key
            rec = self.shards[digest][1].slices[index]
            region = self.regions[rec.ordinal] if rec.ordinal < len(self.regions) else None
            return decode_slice(rec, self.payload(digest)[rec.offset:rec.offset + rec.stored], f"shard {digest[:16]}...",
                                wait, keep=keep, advance=advance, finite=finite and not (region and region.nonfinite),
                                region=region.name if region else None, span=spans.get(key),
                                checked=keep and self.shards[digest][0].checked)

        for digest in dict.fromkeys(d for d, _ in wanted):
            self.check_padding(digest)
        total = sum(b - a for a, b in map(span_of, wanted))
        if total <= _SMALL_RESTORE:
            # Small reads: starting threads would cost more than the reading and hashing.
            ordered = sorted(wanted, key=lambda k: (k[0], self.shards[k[0]][1].slices[k[1]].offset))
            return {key: one(key, _no_wait) for key in ordered}
        # File order, so the prefetchers read sequentially and the verifiers follow them.
        jobs = []
        for key in sorted(wanted, key=lambda k: (k[0], self.shards[k[0]][1].slices[k[1]].offset)):
            obj, head = self.shards[key[0]]
            rec = head.slices[key[1]]
            first, last = span_of(key)
            jobs.append((key, obj, head.head_len + rec.offset + first, last - first))
        prefetcher = _Prefetcher(jobs)
        order = prefetcher.order()
        order += [key for key, _, _, length in jobs if not length]  # empty slices: nothing to read
        results: dict[tuple[str, int], memoryview | None] = {}
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="alpha-ckpt-verify")
        prefetcher.start()
        try:
            # Small slices are verified in batches (one task per ~1 MiB, not one per tensor), in order.
            batches: list[list[tuple]] = [[]]
            filled = 0
            for key in order:
                if batches[-1] and (filled >= _VERIFY_BATCH_BYTES or len(batches[-1]) >= _VERIFY_BATCH_SLICES):
                    batches.append([])
                    filled = 0
                batches[-1].append((key, prefetcher.waiter(key)))
                first, last = span_of(key)
                filled += last - first
            futures = [(batch, pool.submit(lambda b: [one(key, wait) for key, wait in b], batch))
                       for batch in batches if batch]
            for batch, future in futures:
                results.update(zip((key for key, _ in batch), future.result()))
        finally:
            # On a refusal, stop reading and drop the queued slices at once.
            prefetcher.stop()
            pool.shutdown(wait=True, cancel_futures=True)
        return results

    def release(self) -> None:
        self._views.clear()


_VERIFY_BATCH_BYTES = 1 << 20
_VERIFY_BATCH_SLICES = 4096


def payload_bytes(generation: Generation) -> int:
    """Stored bytes of every slice of the opened shards: what full validation reads and hashes."""
    return sum(s.stored for _, head in generation.shards.values() for s in head.slices)


def check_payloads(generation: Generation, *, advance: Callable[[int], None] | None = None) -> None:
    """Validate every slice (and the padding) of every opened shard; nothing is kept."""
    payloads = Payloads(generation.shards, generation.manifest.regions)
    keys = [(d, i) for d, (_, head) in generation.shards.items() for i in range(len(head.slices))]
    payloads.decode(keys, keep=False, advance=advance)
    payloads.release()


def validate_object_bytes(data: bytes | memoryview, digest: str, what: str = "object") -> ShardHead | ManifestHead:
    """Validate one whole object held in memory (the hostile-input entry point; same checks as restore)."""
    view = memoryview(data)
    head_len = split_head(view, len(view), what, size_is_known=False)
    header = decode_head(view[:head_len], digest, len(view), what)
    if header["kind"] == "manifest":
        return parse_manifest_header(header, digest, head_len, what)
    head = parse_shard_header(header, digest, head_len, what)
    payload = view[head_len:]
    check_zero_padding(head, payload, what)
    for rec in head.slices:
        decode_slice(rec, payload[rec.offset:rec.offset + rec.stored], what, keep=False)
    return head


def validate_object_file(obj: ObjectFile, what: str = "object") -> ShardHead | ManifestHead:
    """Validate one whole object file as verify does, except its words' values (NaN is not damage).

    The head must hash to the object's name and fit the file's size exactly,
    every slice's bytes must have the digest the head records, and the
    padding must be zero: then the file holds exactly the bytes its name
    commits to. Read through the map, in parallel, like verify.
    """
    header, head_len = read_head(obj, what, size_is_known=True)
    if header["kind"] == "manifest":
        return parse_manifest_header(header, obj.digest, head_len, what)
    head = parse_shard_header(header, obj.digest, head_len, what)
    payloads = Payloads({obj.digest: (obj, head)})
    try:
        payloads.decode([(obj.digest, i) for i in range(len(head.slices))], keep=False, finite=False)
    finally:
        payloads.release()
    return head
