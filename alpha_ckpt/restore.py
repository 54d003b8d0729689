"""Reading a generation: validate everything needed, then copy by a plan.

Order (a refusal at any step leaves the destination tensors untouched and the
store unmodified):

1. the root manifest: name, size, digest, header;
2. every shard head it names: presence, size, digest, format, capture prefix,
   schema, word ranges; then coverage of every region on word ranges;
3. every payload slice the plan reads: BLAKE3, zstd bounds, zero padding,
   finiteness of floating-point words;
4. only then the copies, straight from the mapped file into the destination.
"""
from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import blake3
import numpy as np
import torch
import zstandard

from .destinations import check_destinations, check_tied_saved_alike, destination_layouts
from .errors import Refusal, RefusalCode
from .heap import cyclic_gc_paused
from .format import (
    BLOCK_BYTES, DTYPES, CapturePrefix, ChildRef, ManifestHead, RegionDecl, ShardHead, ShardRef, SliceRecord, decode_head,
    hash_blocks, padding_ranges,
    parse_manifest_header, parse_shard_header, split_head,
)
from .manifest import (
    check_root_manifest, check_shard_against_record, first_non_finite, word_value,
)
from .planner import Hierarchy, PlanError, SavedSlice, WantedSlice, plan_restore
from .state.load import plan_load
from .store import History, ObjectFile, RefRecord, Store, UnreadableRef

_HEAD_READ = 64 << 10
# Slices are viewed straight from a read-only mapping of the object file and
# only ever read; torch warns about any read-only buffer, so silence exactly that.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=r"alpha_ckpt\.")


@dataclass(frozen=True)
class Counters:
    """What a restore returns: the capture prefix and the user's metadata."""

    run: str
    step: str
    update: int
    cursor: int
    epoch: int
    metadata: Any
    root: str


def _read_head(obj: ObjectFile, what: str, size_is_known: bool) -> tuple[Any, int]:
    first = obj.read_at(0, min(obj.size, _HEAD_READ))
    head_len = split_head(first, obj.size, what, size_is_known=size_is_known)
    head = first if head_len <= len(first) else obj.read_at(0, head_len)
    header = decode_head(head, obj.digest, obj.size, what, size_is_known=size_is_known)
    return header, head_len


def _check_size(obj: ObjectFile, expected: int | None, what: str) -> None:
    if expected is not None and obj.size != expected:
        raise Refusal(RefusalCode.FORMAT, f"{what} has {obj.size} bytes, its record says {expected} (truncated or extended)")


class Generation:
    """An opened generation whose manifest and shard heads are validated (payloads not yet)."""

    def __init__(self, store: Store, root: str, ref: RefRecord | None, manifest: ManifestHead,
                 shards: dict[str, tuple[ObjectFile, ShardHead]], manifests: tuple[ManifestHead, ...] = ()):
        self.store, self.root, self.ref, self.manifest, self.shards = store, root, ref, manifest, shards
        self.manifests = manifests or (manifest,)  # every manifest read: the root first

    @property
    def prefix(self) -> CapturePrefix:
        return self.manifest.prefix

    def close(self) -> None:
        for obj, _ in self.shards.values():
            obj.close()
        self.shards = {}

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def saved_slices(self) -> list[SavedSlice]:
        return [SavedSlice(s.ordinal, s.lo, s.hi, digest, i)
                for digest, (_, head) in self.shards.items() for i, s in enumerate(head.slices)]


def _read_manifest(store: Store, digest: str, size: int | None, what: str) -> ManifestHead:
    with store.open_object(digest, what) as obj:
        _check_size(obj, size, what)
        header, head_len = _read_head(obj, what, size_is_known=size is not None)
    if header.get("kind") != "manifest":
        raise Refusal(RefusalCode.FORMAT, f"{what} is a {header.get('kind')}, not a manifest")
    return parse_manifest_header(header, digest, head_len, what)


def _check_group(group: ManifestHead, record: ChildRef, root: ManifestHead, hierarchy: Hierarchy, what: str) -> None:
    """A child group manifest against its parent's record, the root, and the hierarchy's shape."""
    p = group.publisher
    if p.kind != "tree" or p.fanout != hierarchy.fanout or group.owners != hierarchy.owners:
        raise Refusal(RefusalCode.COVERAGE, f"{what} is not a group manifest of this tree "
                      f"({hierarchy.owners} owners, fan-out {hierarchy.fanout})")
    if (p.role, p.subtree) != (record.role, record.size):
        raise Refusal(RefusalCode.COVERAGE, f"{what} is role {p.role} with {p.subtree} roles; its parent's record "
                      f"says role {record.role} with {record.size}")
    if group.prefix != root.prefix or group.schema_digest != root.schema_digest:
        raise Refusal(RefusalCode.MIXED_CAPTURE, f"{what} captured {group.prefix}, the root {root.prefix}")
    _check_children_prescribed(group, hierarchy, what)


def _check_children_prescribed(group: ManifestHead, hierarchy: Hierarchy, what: str) -> None:
    below = group.publisher.subtree - 1
    if len(group.children) != min(hierarchy.fanout, below):  # before building the prescription: bounded work
        raise Refusal(RefusalCode.COVERAGE, f"{what} records {len(group.children)} children, the hierarchy prescribes "
                      f"{min(hierarchy.fanout, below)}")
    prescribed = hierarchy.children(group.publisher.role, group.publisher.subtree)
    if [(c.role, c.size) for c in group.children] != prescribed:
        raise Refusal(RefusalCode.COVERAGE, f"{what} records children {[(c.role, c.size) for c in group.children]}, "
                      f"the hierarchy prescribes {prescribed}")


def _tree_manifests(store: Store, root: ManifestHead, roles: Sequence[int] | None) -> list[ManifestHead]:
    """The root, then every group manifest (roles None) or those on the paths down to ``roles``."""
    p = root.publisher
    hierarchy = Hierarchy(root.owners, p.fanout)
    if (p.role, p.subtree) != (0, root.owners):
        raise Refusal(RefusalCode.COVERAGE, f"root manifest is role {p.role} with {p.subtree} roles, "
                      f"not the root of {root.owners}")
    _check_children_prescribed(root, hierarchy, "root manifest")
    if roles is not None and any(not 0 <= r < root.owners for r in roles):
        raise Refusal(RefusalCode.COVERAGE, f"the tree has roles [0, {root.owners}), not all of {sorted(roles)}")
    out, pending = [root], [root]
    while pending:
        parent = pending.pop()
        for record in parent.children:
            if roles is not None and not any(record.role <= r < record.role + record.size for r in roles):
                continue  # never a subtree holding none of the roles wanted
            what = f"group manifest of role {record.role} ({record.digest[:16]}...)"
            group = _read_manifest(store, record.digest, record.bytes, what)
            _check_group(group, record, root, hierarchy, what)
            out.append(group)
            pending.append(group)
    return sorted(out, key=lambda g: g.publisher.role)  # preorder: the root first, a path top-down


def _holds_any(record: ShardRef, wanted: Mapping[int, Sequence[tuple[int, int]]]) -> bool:
    """Whether the record holds a word of ``wanted`` ((lo, hi) ranges by ordinal: each slice looks
    only at its own region's ranges, never at every wanted slice)."""
    return any(lo < w_hi and w_lo < hi and hi > lo
               for (o, lo, hi) in record.slices for w_lo, w_hi in wanted.get(o, ()))


def open_generation(store: Store, root: str, ref: RefRecord | None = None, *,
                    role: int | Sequence[int] | Callable[[ManifestHead], Sequence[int]] | None = None,
                    wanted: Sequence[WantedSlice] | None = None, manifest: ManifestHead | None = None) -> Generation:
    """Validate the root manifest and the shard heads it leads to; check coverage.

    For a tree, ``role=None`` reads every group manifest (verification);
    ``role=r`` reads only the height + 1 manifests from the root down to role
    r, and opens r's own shards and the root's (which hold the replicated
    words): a restore never touches a sibling subtree. ``role=[r, s, ...]``
    reads the union of those paths (a repartitioned restore); a callable
    picks them from the root manifest. Coverage of a
    path is structural (each parent checked its children's roles and subtree
    sizes); a wanted word that is not on the paths is refused when planned.
    With ``wanted``, only the shards whose records hold a wanted word are
    opened (star or tree); coverage is still checked on every record read.
    ``manifest``: the root manifest as the caller already read and validated it (it is not read again).
    """
    if ref is None:
        store.check_digest(root)
        ref = store.find_ref(root)
    what = f"root manifest {root[:16]}..."
    if manifest is None or manifest.digest != root:  # ``manifest``: this root's, read and validated by the caller
        manifest = _read_manifest(store, root, ref.root_size if ref else None, what)
    if ref is not None and ref.prefix != manifest.prefix:
        raise Refusal(RefusalCode.MIXED_CAPTURE, f"{what}: ref {ref.run}/{ref.step}/{ref.generation} records another capture prefix")
    if callable(role):  # the roles to read may depend on what the root manifest says
        role = role(manifest) if manifest.publisher.kind == "tree" else None
    targets = [role] if isinstance(role, int) else (None if role is None else sorted(set(role)))
    if manifest.publisher.kind == "tree":
        groups = _tree_manifests(store, manifest, targets)
        chosen = groups if targets is None else [g for g in groups if g.publisher.role in set(targets) | {0}]
        records = list({r.digest: r for g in chosen for r in g.shards}.values())  # the root may be a target too
    else:
        groups, records = [manifest], list(manifest.shards)
    every_record = records
    if wanted is not None:
        by_ordinal: dict[int, list[tuple[int, int]]] = {}
        for w in wanted:
            by_ordinal.setdefault(w.ordinal, []).append((w.lo, w.hi))
        records = [r for r in records if _holds_any(r, by_ordinal)]
    shards: dict[str, tuple[ObjectFile, ShardHead]] = {}
    try:
        for record in records:
            w = f"shard {record.digest[:16]}..."
            if record.digest in shards:
                raise Refusal(RefusalCode.COVERAGE, f"{w} is named twice by the manifest")
            if record.digest == root:
                raise Refusal(RefusalCode.FORMAT, f"{what} names itself as a shard")
            obj = store.open_object(record.digest, "shard")
            try:
                _check_size(obj, record.size, w)
                header, head_len = _read_head(obj, w, size_is_known=True)
                head = parse_shard_header(header, record.digest, head_len, w)
                check_shard_against_record(head, record, manifest.prefix, manifest.schema_digest, manifest.regions, w)
            except BaseException:
                obj.close()
                raise
            shards[record.digest] = (obj, head)
        # The one validator publishers run before their ref (a path of a tree is covered structurally).
        check_root_manifest(manifest, every_record if targets is None or manifest.publisher.kind == "star" else None,
                            what)
        if isinstance(manifest.metadata, dict) and "dcp" in manifest.metadata:
            # a DCP checkpoint: its Metadata must tile its tensors by its regions (imported here: torch's
            # DCP package takes about a second to import, and most generations are not DCP's)
            from .dcp_metadata import check_generation
            check_generation(manifest)
    except BaseException:
        for obj, _ in shards.values():
            obj.close()
        raise
    return Generation(store, root, ref, manifest, shards, tuple(groups))


# ---------------------------------------------------------------- payload checks


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
                 region: str | None = None, span: tuple[int, int] | None = None) -> memoryview | None:
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
    """
    named = repr(region) if region is not None else f"ordinal {rec.ordinal}"
    w = f"{what} slice of region {named} words [{rec.lo}, {rec.hi})"
    if rec.codec == "raw":
        first, last = span if span is not None else (0, len(stored))
        if (first, last) != (0, len(stored)) and (rec.blocks is None or (first, last) != read_span(rec, first, last)):
            raise ValueError(f"{w}: span {span} is not whole blocks of a slice with block digests")
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


class _Payloads:
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
                                region=region.name if region else None, span=spans.get(key))

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
    payloads = _Payloads(generation.shards, generation.manifest.regions)
    keys = [(d, i) for d, (_, head) in generation.shards.items() for i in range(len(head.slices))]
    payloads.decode(keys, keep=False, advance=advance)
    payloads.release()


def verify_generation(store: Store, root: str) -> Generation:
    """Full validation of every object of a generation. Returns the (closed) generation on success."""
    with open_generation(store, root) as generation:
        check_payloads(generation)
    return generation


def _flat_destination(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes to fill, tensor to copy back into t or t itself when it can be filled in place)."""
    if t.numel() == 0:  # nothing to fill (NumPy's empty arrays have zero strides, which view() refuses)
        return torch.empty(0, dtype=torch.uint8), t
    if t.is_contiguous() and t.device.type == "cpu":
        return t.detach().reshape(-1).view(torch.uint8), t
    staging = torch.empty(t.shape, dtype=t.dtype)
    return staging.reshape(-1).view(torch.uint8), staging


class PreparedRestore:
    """Every slice a restore reads, validated and held (views of the mapped files); nothing copied yet.

    Distributed owners each prepare their own part, agree on the verdict, and
    only then :meth:`copy_into` their tensors: no owner copies a byte of a
    generation that any owner refused.
    """

    def __init__(self, generation: Generation, wanted: Sequence[WantedSlice], *,
                 advance: Callable[[int], None] | None = None):
        self.generation = generation
        try:
            self.plan = plan_restore(generation.saved_slices(), wanted)
        except PlanError as exc:
            regions = generation.manifest.regions
            named = repr(regions[exc.ordinal].name) if exc.ordinal < len(regions) else f"ordinal {exc.ordinal}"
            raise Refusal(RefusalCode.COVERAGE, f"generation {generation.root[:16]}...: region {named} word "
                          f"{exc.word} is not saved") from None
        self._payloads = _Payloads(generation.shards, generation.manifest.regions)
        self._spans = read_spans(generation, self.plan.copies)
        self._raws = self._payloads.decode(list(self._spans), advance=advance, spans=self._spans)

    @property
    def bytes_read(self) -> int:
        """Stored bytes validated (what the restore read of the shards' payloads): whole slices, or
        the blocks that hold the words it restores."""
        return sum(b - a for a, b in self._spans.values())

    def copy_into(self, targets: Sequence[torch.Tensor]) -> None:
        """Fill ``targets[w.dest]`` (flat uint8, exactly words [lo, hi) of its region) by the plan."""
        _copy_by_plan(self.plan, self.generation, self._raws, targets)
        self.release()

    def release(self) -> None:
        self._raws.clear()
        self._payloads.release()


def read_spans(generation: Generation, copies) -> dict[tuple[str, int], tuple[int, int]]:
    """For each saved slice the copies read from, the stored bytes [a, b) to read and verify (pure)."""
    words: dict[tuple[str, int], tuple[int, int]] = {}
    for c in copies:
        key = (c.source, c.index)
        lo, hi = words.get(key, (c.src_word, c.src_word + c.words))
        words[key] = (min(lo, c.src_word), max(hi, c.src_word + c.words))
    out = {}
    for (digest, index), (lo, hi) in words.items():
        rec = generation.shards[digest][1].slices[index]
        size = DTYPES[rec.dtype][0]
        out[(digest, index)] = read_span(rec, lo * size, hi * size)
    return out


def restore_slices(generation: Generation, wanted: Sequence[WantedSlice], targets: Sequence[torch.Tensor]) -> None:
    """Validate every saved slice the plan reads, then fill ``targets[w.dest]`` (flat uint8) by the plan.

    Each wanted slice's target holds exactly words [lo, hi) of its region.
    Nothing is written to any target unless every read slice validated.
    """
    PreparedRestore(generation, wanted).copy_into(targets)


@cyclic_gc_paused()
def load_state(state: Mapping[str, Any], *, store: Store, root: str) -> Counters:
    """Validate the generation for what ``state`` asks, then fill it: tensors in place, values and
    Stateful objects after every copy (:mod:`alpha_ckpt.state.load`).

    The destination is matched to the checkpoint by dotted name; every entry that
    is missing, unexpected or of another shape or dtype is named in one refusal.
    Destinations that share memory are refused first (tied weights, the very
    same view under two names, only where the checkpoint holds the same
    words for both): the copies would otherwise overwrite each other.
    """
    with open_generation(store, root) as generation:
        manifest = generation.manifest
        what = f"generation {root[:16]}..."
        plan = plan_load(state, manifest.state, manifest.regions)
        fill = prepare_fill(generation, plan, what)
        fill()
        p = manifest.prefix
        return Counters(p.run, p.step, p.update, p.cursor, p.epoch, manifest.metadata, root)


def prepare_fill(generation: Generation, plan, what: str) -> Callable[[], None]:
    """Validate every slice ``plan`` (:class:`alpha_ckpt.state.load.LoadPlan`) reads; return what fills it.

    Refuses before any copy: a plan that names mismatched entries, destinations that
    share memory, a damaged slice. The returned call copies every target, then runs
    the plan's ``finish`` (values, ``load_state_dict``). Collective restores prepare on
    every rank, agree, and only then fill.
    """
    refusal = plan.refusal(what)
    if refusal is not None:
        raise refusal
    regions = generation.manifest.regions
    names = [regions[o].name for o, *_ in plan.targets]
    tied = check_destinations(destination_layouts([(n, t) for n, (_, t, _, _) in zip(names, plan.targets)]))
    if tied:
        saved = _saved_words(generation)
        check_tied_saved_alike(tied, names, {i: saved.get(o, []) for i, (o, *_) in enumerate(plan.targets)})
    wanted = [WantedSlice(o, lo, hi, i) for i, (o, _, lo, hi) in enumerate(plan.targets)]
    prepared = PreparedRestore(generation, wanted)

    def fill() -> None:
        staged = [_flat_destination(t) for _, t, _, _ in plan.targets]
        prepared.copy_into([flat for flat, _ in staged])
        with torch.no_grad():
            for (_, t, _, _), (_, filled) in zip(plan.targets, staged):
                if filled is not t:
                    t.copy_(filled)
        plan.finish()
    fill.bytes_read = prepared.bytes_read  # what validation read of the shards' payloads
    return fill


def _saved_words(generation: Generation) -> dict[int, list[tuple[int, int, str]]]:
    """Per region ordinal, the (lo, hi, raw BLAKE3) of the slices holding it, from the shard heads."""
    out: dict[int, list[tuple[int, int, str]]] = {}
    for _, head in generation.shards.values():
        for s in head.slices:
            out.setdefault(s.ordinal, []).append((s.lo, s.hi, s.blake3))
    return {ordinal: sorted(slices) for ordinal, slices in out.items()}


def _copy_by_plan(plan, generation: Generation, raws, targets) -> None:
    # numpy copies on this thread. torch's copy_ of a large tensor starts an OpenMP team per call,
    # which oversubscribes the cores when every rank is a process (measured: 512 MiB per rank, 2
    # ranks on 2 cores, 0.15-0.86 s with copy_ against 0.065-0.086 s single-threaded).
    dests = [t.numpy() for t in targets]
    for c in plan.copies:
        rec = generation.shards[c.source][1].slices[c.index]
        if not rec.raw:
            continue
        size = DTYPES[rec.dtype][0]
        src = np.frombuffer(raws[(c.source, c.index)], dtype=np.uint8)
        dests[c.dest][c.dst_word * size:(c.dst_word + c.words) * size] = src[c.src_word * size:(c.src_word + c.words) * size]


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
    header, head_len = _read_head(obj, what, size_is_known=True)
    if header["kind"] == "manifest":
        return parse_manifest_header(header, obj.digest, head_len, what)
    head = parse_shard_header(header, obj.digest, head_len, what)
    payloads = _Payloads({obj.digest: (obj, head)})
    try:
        payloads.decode([(obj.digest, i) for i in range(len(head.slices))], keep=False, finite=False)
    finally:
        payloads.release()
    return head


def check_complete(store: Store, record: RefRecord) -> Refusal | None:
    """Why generation ``record`` is not complete, or None when it is.

    The one definition that ``latest``, ``--resume latest``, retention and gc
    share: a generation is complete when its ref reads back intact and every
    object it names validates fully (digests, format, coverage, capture
    prefixes, finiteness): exactly what a restore of the whole state checks.
    gc remembers the result per object file (:mod:`alpha_ckpt.complete`).
    """
    try:
        with open_generation(store, record.root, record) as generation:
            check_payloads(generation)
    except Refusal as refusal:
        return refusal
    return None


def check_structure(store: Store, record: RefRecord) -> Refusal | None:
    """Why generation ``record``'s ref, manifests or shard heads are damaged or missing, or None.

    Reads every head and no payload byte: O(objects), not O(bytes). A payload byte that does not
    match its digest is found by whoever reads it, before anything is copied.
    """
    try:
        with open_generation(store, record.root, record):
            pass
    except Refusal as refusal:
        return refusal
    return None


UNREADABLE_REF = "(unreadable ref)"  # what latest names in place of a root it cannot read


def latest_order(history: History) -> list[RefRecord | tuple[str, Refusal]]:
    """Newest first: the generations ``latest`` tries, in order, with what it passes over and why (pure).

    The one rule of "newest" when refs are damaged, shared by ``latest``,
    ``restore("latest")``, retention and gc (the fence of every publish reads
    the same :class:`~alpha_ckpt.store.History`): an unreadable ref is passed
    over (named by its refusal; its number stays taken), and so is a
    generation of an older epoch than the newest readable one's (a
    continuation has published since, so a resume of it would be refused as
    ``stale-epoch``). A damaged or stale newer generation never hides an intact
    older one of the newest epoch.
    """
    records = history.records
    newest_epoch = max((r.prefix.epoch for r in records), default=0)
    out: list[RefRecord | tuple[str, Refusal]] = []
    for entry in reversed(history.entries):
        if isinstance(entry, UnreadableRef):
            out.append((UNREADABLE_REF, entry.refusal))
        elif entry.prefix.epoch < newest_epoch:
            out.append((entry.root, Refusal(RefusalCode.STALE_EPOCH, f"generation {entry.generation} is of epoch "
                                            f"{entry.prefix.epoch}; {history.run}/{history.step} has published in "
                                            f"epoch {newest_epoch} since")))
        else:
            out.append(entry)
    return out


def latest_generation(store: Store, run: str, step: str, check: Callable[[Store, RefRecord], Refusal | None] | None = None,
                      ) -> tuple[RefRecord | None, list[tuple[str, Refusal]]]:
    """The newest complete generation of (run, step) that is not stale, and the newer ones skipped with why.

    Complete is ``check`` (default :func:`check_complete`); the order and what is passed over
    unread is :func:`latest_order`'s.
    """
    skipped: list[tuple[str, Refusal]] = []
    for entry in latest_order(store.history(run, step)):
        if not isinstance(entry, RefRecord):
            skipped.append(entry)
            continue
        refusal = (check or check_complete)(store, entry)
        if refusal is not None:
            skipped.append((entry.root, refusal))
            continue
        return entry, skipped
    return None, skipped
