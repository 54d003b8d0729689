"""Decoding an object's head: its bytes to a checked ShardHead or ManifestHead (no I/O).

Every field is checked as it is read (kinds, types, ranges, digests, names); a head that is not
exactly what :mod:`alpha_ckpt.format.records` writes is refused with a ``format`` Refusal.
"""
from __future__ import annotations

from typing import Any, Sequence

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import (
    ALIGN, CODECS, DTYPES, MAGIC, MAX_HEADER_BYTES, MAX_INT, PREFIX, PREFIX_LEN, STAR, VERSION, CapturePrefix, ChildRef,
    ManifestHead, Publisher, RegionDecl, ShardHead, ShardRef, SliceRecord, _fail, _numel, _require_keys, _uint, aligned,
    block_count, blocked, digest_bytes, digest_of_blocks, is_digest, parse_canonical_json, schema_digest_of,
)
from alpha_ckpt.format.values import decode_value, dotted_leaves


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise _fail(what, "shape must be a list of at most 64 dimensions")
    shape = tuple(_uint(d, what) for d in value)
    if _numel(shape) > MAX_INT:
        raise _fail(what, "shape has more words than fit in 63 bits")
    return shape


def _dtype(value: Any, what: str) -> str:
    if not isinstance(value, str) or value not in DTYPES:
        raise _fail(what, f"unknown dtype {value!r}")
    return value


def _digest(value: Any, what: str) -> str:
    if not is_digest(value):
        raise _fail(what, f"{value!r} is not a 64-hex BLAKE3 digest")
    return value


def split_head(data: bytes | memoryview, file_size: int, what: str, *, size_is_known: bool) -> int:
    """Check the fixed prefix of an object and return its head length (20 + header_len).

    ``data`` holds at least the first 20 bytes when the file has them. Before the
    digest is checked a wrong byte may be a corruption, not a format error: when
    the file has the size its parent records (``size_is_known``), inconsistencies
    are reported as ``corrupt-shard``.
    """
    if file_size < PREFIX_LEN or len(data) < PREFIX_LEN:
        raise _fail(what, f"file of {file_size} bytes is shorter than the {PREFIX_LEN}-byte prefix (truncated)")
    magic, version, header_len = PREFIX.unpack_from(data, 0)
    code = RefusalCode.CORRUPT_SHARD if size_is_known else RefusalCode.FORMAT
    if magic != MAGIC:
        raise Refusal(code, f"{what}: bad magic {magic!r}")
    if header_len > MAX_HEADER_BYTES or PREFIX_LEN + header_len > file_size:
        raise Refusal(code, f"{what}: header length {header_len} does not fit in a file of {file_size} bytes")
    if version != VERSION:
        raise Refusal(code, f"{what}: unsupported format version {version}")
    return PREFIX_LEN + header_len


def check_head_digest(head: bytes | memoryview, expected: str, what: str) -> None:
    actual = digest_bytes(head)
    if actual != expected:
        raise Refusal(RefusalCode.CORRUPT_SHARD, f"{what}: content digest {actual[:16]}... does not match its name {expected[:16]}...")


def decode_head(head: bytes | memoryview, digest: str, file_size: int, what: str, *, size_is_known: bool = False) -> Any:
    """Validate an object's head (prefix + header) against its digest and return the header object."""
    head_len = split_head(head, file_size, what, size_is_known=size_is_known)
    if len(head) < head_len:
        raise _fail(what, "head shorter than its declared length")
    view = memoryview(head)[:head_len]
    check_head_digest(view, digest, what)
    body = bytes(view[PREFIX_LEN:])
    stripped = body.rstrip(b" ")
    if len(body) - len(stripped) >= ALIGN or head_len % ALIGN:
        raise _fail(what, f"header padding is not the {ALIGN}-byte alignment padding")
    header = parse_canonical_json(stripped, what)
    if not isinstance(header, dict) or header.get("kind") not in ("shard", "manifest"):
        raise _fail(what, "header kind must be 'shard' or 'manifest'")
    payload = _uint(header.get("payload_bytes"), f"{what} payload_bytes")
    if head_len + payload != file_size:
        raise _fail(what, f"file has {file_size} bytes but its header declares {head_len + payload} (truncated or extended)")
    return header


def parse_shard_header(header: Any, digest: str, head_len: int, what: str) -> ShardHead:
    _require_keys(header, ("kind", "prefix", "schema_digest", "payload_bytes", "slices"), what)
    if header["kind"] != "shard":
        raise _fail(what, f"expected a shard, found a {header['kind']}")
    prefix = CapturePrefix.from_json(header["prefix"], what)
    schema = _digest(header["schema_digest"], f"{what} schema_digest")
    payload = _uint(header["payload_bytes"], f"{what} payload_bytes")
    raw_slices = header["slices"]
    if not isinstance(raw_slices, list):
        raise _fail(what, "slices must be a list")
    keys = ("ordinal", "dtype", "shape", "lo", "hi", "offset", "stored", "codec", "raw", "blake3")
    slices = []
    for i, s in enumerate(raw_slices):
        w = f"{what} slice {i}"
        _require_keys(s, keys, w, optional=("stored_blake3", "blocks"))
        dtype = _dtype(s["dtype"], w)
        shape = _shape(s["shape"], w)
        lo, hi = _uint(s["lo"], f"{w} lo"), _uint(s["hi"], f"{w} hi")
        if not lo <= hi <= _numel(shape):
            raise _fail(w, f"word range [{lo}, {hi}) is not inside a region of {_numel(shape)} words")
        raw = _uint(s["raw"], f"{w} raw")
        if raw != (hi - lo) * DTYPES[dtype][0]:
            raise _fail(w, f"raw length {raw} != {hi - lo} words x {DTYPES[dtype][0]} bytes")
        codec = s["codec"]
        if codec not in CODECS:
            raise _fail(w, f"unknown codec {codec!r}")
        stored = _uint(s["stored"], f"{w} stored")
        stored_digest = s.get("stored_blake3")
        if codec == "raw":
            if stored != raw or stored_digest is not None:
                raise _fail(w, "a raw slice stores exactly its raw bytes and has no stored_blake3")
        else:
            stored_digest = _digest(stored_digest, f"{w} stored_blake3")
        slice_digest = _digest(s["blake3"], f"{w} blake3")
        blocks = s.get("blocks")
        # Optional on a large slice (one written before block digests has the BLAKE3 of its bytes).
        if blocks is not None and not blocked(raw):
            raise _fail(w, f"a slice of {raw} bytes records no block digests")
        if blocks is not None:
            if (not isinstance(blocks, str) or len(blocks) != 64 * block_count(raw)
                    or blocks.strip("0123456789abcdef")):
                raise _fail(w, f"blocks must be {block_count(raw)} concatenated 64-hex digests")
            if digest_of_blocks(blocks) != slice_digest:
                raise _fail(w, "blake3 is not the BLAKE3 of its block digests")
        slices.append(SliceRecord(
            ordinal=_uint(s["ordinal"], f"{w} ordinal"), dtype=dtype, shape=shape, lo=lo, hi=hi,
            offset=_uint(s["offset"], f"{w} offset"), stored=stored, codec=codec, raw=raw,
            blake3=slice_digest, stored_blake3=stored_digest, blocks=blocks,
        ))
    # The slices must tile [0, payload) in some order, each starting at the next
    # aligned offset: every payload byte is then either covered by exactly one
    # digest or is alignment padding, which readers require to be zero.
    end = 0
    for s in sorted(slices, key=lambda s: (s.offset, s.stored)):
        if s.offset != aligned(end):
            raise _fail(what, f"payload slice at offset {s.offset} should start at {aligned(end)} (gap, overlap or misalignment)")
        end = s.offset + s.stored
    if end != payload:
        raise _fail(what, f"slices cover {end} payload bytes, header declares {payload}")
    return ShardHead(digest, head_len, prefix, schema, payload, tuple(slices))


def padding_ranges(head: ShardHead) -> list[tuple[int, int]]:
    """Payload byte ranges [a, b) that are alignment padding (must be zero)."""
    out, end = [], 0
    for s in sorted(head.slices, key=lambda s: (s.offset, s.stored)):
        if s.offset > end:
            out.append((end, s.offset))
        end = s.offset + s.stored
    return out


def parse_manifest_header(header: Any, digest: str, head_len: int, what: str) -> ManifestHead:
    keys = ("kind", "prefix", "schema_digest", "regions", "shards", "children", "owners", "metadata", "payload_bytes",
            "publisher")
    _require_keys(header, keys, what, optional=("state",))
    if header["kind"] != "manifest":
        raise _fail(what, f"expected a manifest, found a {header['kind']}")
    if header["payload_bytes"] != 0:
        raise _fail(what, "a manifest has no payload")
    publisher = _publisher(header["publisher"], what)
    children = _children(header["children"], publisher, what)
    prefix = CapturePrefix.from_json(header["prefix"], what)
    schema = _digest(header["schema_digest"], f"{what} schema_digest")
    if not isinstance(header["regions"], list) or not isinstance(header["shards"], list):
        raise _fail(what, "regions and shards must be lists")
    regions = []
    for i, r in enumerate(header["regions"]):
        w = f"{what} region {i}"
        _require_keys(r, ("ordinal", "name", "dtype", "shape"), w, optional=("nonfinite",))
        if type(r["ordinal"]) is not int or r["ordinal"] != i:
            raise _fail(w, f"ordinal {r['ordinal']!r} is not its declaration position {i}")
        if not isinstance(r["name"], str):
            raise _fail(w, "name must be a string")
        if r.get("nonfinite", True) is not True:
            raise _fail(w, "nonfinite is written only as true")
        regions.append(RegionDecl(i, r["name"], _dtype(r["dtype"], w), _shape(r["shape"], w), "nonfinite" in r))
    if schema_digest_of(regions) != schema:
        raise _fail(what, "schema_digest does not match the declared regions")
    shards = []
    for i, s in enumerate(header["shards"]):
        w = f"{what} shard record {i}"
        _require_keys(s, ("digest", "size", "slices"), w, optional=("carried",))
        if not isinstance(s["slices"], list):
            raise _fail(w, "slices must be a list")
        triples = []
        for t in s["slices"]:
            if not isinstance(t, list) or len(t) != 3:
                raise _fail(w, "each slice is [ordinal, lo, hi]")
            ordinal = _uint(t[0], w)
            if ordinal >= len(regions):
                raise Refusal(RefusalCode.COVERAGE, f"{w} names region ordinal {ordinal}, which the schema does not declare")
            triples.append((ordinal, _uint(t[1], w), _uint(t[2], w)))
        carried = None
        if "carried" in s:
            c = s["carried"]
            _require_keys(c, ("update", "cursor", "epoch"), f"{w} carried")
            carried = (_uint(c["update"], w), _uint(c["cursor"], w), _uint(c["epoch"], w))
            if carried[0] > prefix.update or carried[2] > prefix.epoch or carried == (prefix.update, prefix.cursor,
                                                                                      prefix.epoch):
                raise _fail(w, f"carried from capture {carried}, which is not earlier than the manifest's")
        shards.append(ShardRef(_digest(s["digest"], w), _uint(s["size"], w), tuple(triples), carried))
    owners = header["owners"]
    if type(owners) is not int or owners < 1:
        raise _fail(what, f"owners must be a positive integer, got {owners!r}")
    if publisher.kind == "tree" and publisher.role + publisher.subtree > owners:
        raise _fail(what, f"tree role {publisher.role} with subtree {publisher.subtree} exceeds {owners} owners")
    state = _state_skeleton(header["state"], regions, what) if "state" in header else None
    return ManifestHead(digest, head_len, prefix, schema, tuple(regions), tuple(shards), owners, header["metadata"],
                        publisher, children, state, header.get("state"))


def _state_skeleton(obj: Any, regions: Sequence[RegionDecl], what: str) -> Any:
    """Decode a root manifest's typed skeleton; it must name every region once, by its dotted path."""
    skeleton = decode_value(obj, f"{what} state")
    if not isinstance(skeleton, dict):
        raise _fail(what, "state must be a typed dict")
    named = [(path, ref) for path, ref in dotted_leaves(skeleton)]
    for path, ref in named:
        if ref.name != path:
            raise _fail(what, f"state names region {ref.name!r} at {path!r}")
    if [path for path, _ in named] != [r.name for r in regions]:
        raise _fail(what, "state does not name exactly the declared regions, in declaration order")
    return skeleton


def _publisher(obj: Any, what: str) -> Publisher:
    w = f"{what} publisher"
    if isinstance(obj, dict) and obj.get("kind") == "star":
        _require_keys(obj, ("kind",), w)
        return STAR
    _require_keys(obj, ("kind", "fanout", "role", "subtree"), w)
    if obj["kind"] != "tree":
        raise _fail(w, f"unknown publisher {obj['kind']!r}")
    fanout, role, subtree = (_uint(obj[k], w) for k in ("fanout", "role", "subtree"))
    if fanout < 1 or subtree < 1:
        raise _fail(w, "fanout and subtree must be at least 1")
    return Publisher("tree", fanout, role, subtree)


def _children(obj: Any, publisher: Publisher, what: str) -> tuple[ChildRef, ...]:
    if not isinstance(obj, list):
        raise _fail(what, "children must be a list")
    if publisher.kind == "star" and obj:
        raise _fail(what, "a star manifest has no child manifests")
    out = []
    for i, c in enumerate(obj):
        w = f"{what} child record {i}"
        _require_keys(c, ("role", "size", "digest", "bytes"), w)
        out.append(ChildRef(_uint(c["role"], w), _uint(c["size"], w), _digest(c["digest"], w), _uint(c["bytes"], w)))
    return tuple(out)
