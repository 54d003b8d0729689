"""Object bytes: the records and how they are encoded (decoding.py reads them back). No file I/O.

Every object (shard or manifest) is::

    magic  b"ALPHCKPT"            8 bytes
    version u32 little-endian     4 bytes (= 1)
    header_len u64 little-endian  8 bytes
    header  canonical JSON        header_len bytes
    payload                       header["payload_bytes"] bytes

The object's name is the BLAKE3 of its *head* (the first 20 + header_len
bytes). The head commits to every payload byte: payload slices tile the
payload exactly and each carries the BLAKE3 of its stored bytes. So checking
the name costs one hash of a small head, and every payload byte is still
covered by exactly one digest. docs/FORMAT.md is the byte-level spec.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import blake3

from alpha_ckpt.errors import Refusal, RefusalCode, StoreUsageError

MAGIC = b"ALPHCKPT"
VERSION = 1
PREFIX = struct.Struct("<8sIQ")
PREFIX_LEN = PREFIX.size  # 20
MAX_HEADER_BYTES = 64 << 20
MAX_INT = (1 << 63) - 1
ALIGN = 64  # the payload and every slice in it start at a multiple of this (file offset)
DIGEST_RE = re.compile(r"\A[0-9a-f]{64}\Z")
NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")

# dtype name -> (itemsize, is floating point). Names are torch's, without "torch.".
DTYPES: dict[str, tuple[int, bool]] = {
    "float64": (8, True),
    "float32": (4, True),
    "float16": (2, True),
    "bfloat16": (2, True),
    "int64": (8, False),
    "int32": (4, False),
    "int16": (2, False),
    "int8": (1, False),
    "uint8": (1, False),
    "bool": (1, False),
    "uint16": (2, False),
    "uint32": (4, False),
    "uint64": (8, False),
}
CODECS = ("raw", "zstd")
PREFIX_KEYS = ("run", "step", "update", "cursor", "epoch")


def digest_bytes(data) -> str:
    return blake3.blake3(data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """The one JSON encoding we write: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def check_json_value(value: Any, what: str) -> None:
    """Refuse (StoreUsageError) a value that canonical JSON would not give back as it is: a tuple (comes
    back a list), an int key (a str key), NaN; a reader would see another value than the writer meant."""
    try:
        same = json.loads(canonical_json(value)) == value
    except (ValueError, TypeError, RecursionError) as exc:
        raise StoreUsageError(f"{what} is not JSON: {exc}") from None
    if not same:
        raise StoreUsageError(f"{what} would not read back as given from JSON (tuples come back lists, int keys "
                              "str keys): pass lists and str keys")


def _no_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name):
    raise ValueError(f"non-finite JSON number {name}")


def parse_canonical_json(data: bytes, what: str) -> Any:
    """Parse JSON we wrote; anything not in our canonical form is refused as ``format``."""
    # Parsed with the C decoder's own dicts: a duplicate key cannot survive the canonical re-encoding
    # below (the dict keeps one of them), and only a header that fails it is parsed again to name it.
    try:
        obj = json.loads(data.decode("ascii"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Refusal(RefusalCode.FORMAT, f"{what}: header is not valid canonical JSON ({exc})") from None
    try:
        again = canonical_json(obj)
    except (ValueError, TypeError, RecursionError) as exc:
        raise Refusal(RefusalCode.FORMAT, f"{what}: header is not canonical JSON ({exc})") from None
    if again != bytes(data):
        try:
            json.loads(data.decode("ascii"), object_pairs_hook=_no_duplicate_keys)
        except ValueError as exc:
            raise Refusal(RefusalCode.FORMAT, f"{what}: header is not valid canonical JSON ({exc})") from None
        raise Refusal(RefusalCode.FORMAT, f"{what}: header is not in canonical JSON form")
    return obj


def is_digest(name: object) -> bool:
    return isinstance(name, str) and DIGEST_RE.match(name) is not None


def check_name(name: object, what: str) -> str:
    """Run and step names: plain path components, never '..', '/', NUL or empty."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise Refusal(RefusalCode.FORMAT, f"{what} {name!r} is not a plain name ([A-Za-z0-9._-], 1-128 chars, no leading dot)")
    return name


# ---------------------------------------------------------------- data types


@dataclass(frozen=True)
class CapturePrefix:
    """What every owner's capture of one update boundary must agree on."""

    run: str
    step: str
    update: int
    cursor: int
    epoch: int

    def __post_init__(self) -> None:
        # Every writer builds its prefix here (alpha_ckpt.save, the Checkpointer, the DCP backend): a
        # counter no reader would accept (from_json) is a usage error before anything is written.
        for name in ("update", "cursor", "epoch"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= MAX_INT:
                raise StoreUsageError(f"{name} must be an int in [0, 2**63), got {value!r}")

    def to_json(self) -> dict:
        return {"run": self.run, "step": self.step, "update": self.update, "cursor": self.cursor, "epoch": self.epoch}

    @classmethod
    def from_json(cls, obj: Any, what: str) -> "CapturePrefix":
        _require_keys(obj, PREFIX_KEYS, f"{what} prefix")
        return cls(
            run=check_name(obj["run"], f"{what} run"),
            step=check_name(obj["step"], f"{what} step"),
            update=_uint(obj["update"], f"{what} prefix.update"),
            cursor=_uint(obj["cursor"], f"{what} prefix.cursor"),
            epoch=_uint(obj["epoch"], f"{what} prefix.epoch"),
        )


@dataclass(frozen=True)
class SliceRecord:
    """One slice of one region inside a shard's payload: words [lo, hi)."""

    ordinal: int
    dtype: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    offset: int
    stored: int
    codec: str
    raw: int
    blake3: str
    stored_blake3: str | None = None  # zstd only: digest of the compressed bytes
    blocks: str | None = None  # slices over BLOCK_BYTES: each raw block's hex BLAKE3, in order (see block_digests)

    def to_json(self) -> dict:
        out = {
            "ordinal": self.ordinal, "dtype": self.dtype, "shape": list(self.shape), "lo": self.lo, "hi": self.hi,
            "offset": self.offset, "stored": self.stored, "codec": self.codec, "raw": self.raw, "blake3": self.blake3,
        }
        if self.stored_blake3 is not None:
            out["stored_blake3"] = self.stored_blake3
        if self.blocks is not None:
            out["blocks"] = self.blocks
        return out

    def block_digest(self, i: int) -> str:
        return self.blocks[64 * i:64 * (i + 1)]


# A slice larger than one block records the digest of each block of its raw bytes, so a reader
# that needs only some words of a raw slice reads and verifies only the blocks that hold them (a
# resharded restore reads at most one partial block at each end of each word range, not whole
# slices of other ranks). Its ``blake3`` is then the BLAKE3 of that list: one hashing pass gives both.
BLOCK_BYTES = 64 << 10


def blocked(raw_bytes: int) -> bool:
    """Whether a slice of ``raw_bytes`` raw bytes records block digests (when written by this version)."""
    return raw_bytes > BLOCK_BYTES


def block_count(raw_bytes: int) -> int:
    return -(-raw_bytes // BLOCK_BYTES)


def hash_blocks(view: memoryview) -> list[str]:
    """The hex BLAKE3 of each BLOCK_BYTES block of ``view`` (the last one shorter), in order."""
    return [blake3.blake3(view[i:i + BLOCK_BYTES]).hexdigest() for i in range(0, len(view), BLOCK_BYTES)]


def digest_of_blocks(blocks: str) -> str:
    """A blocked slice's digest: the BLAKE3 of its concatenated block digests."""
    return blake3.blake3(blocks.encode("ascii")).hexdigest()


def joined_digest(parts: Sequence[tuple[str, str | None]]) -> str:
    """The digest :func:`block_digests` gives a run of bytes, from its consecutive parts' (digest, block
    digests), each part but the last a whole number of blocks: a part too short to be blocked is one block,
    its digest that block's. A region cut into several shards is thereby known without hashing it again."""
    if len(parts) == 1:
        return parts[0][0]
    return digest_of_blocks("".join(blocks if blocks is not None else digest for digest, blocks in parts))


def block_digests(data) -> tuple[str, str | None]:
    """A raw slice's (digest, block digests): for a blocked slice, the BLAKE3 of its blocks' concatenated
    hex digests and that string; else the BLAKE3 of its bytes and None. The one definition every
    writer, replica check and reader uses."""
    view = memoryview(data).cast("B")
    if not blocked(len(view)):
        return blake3.blake3(view).hexdigest(), None
    blocks = "".join(hash_blocks(view))
    return digest_of_blocks(blocks), blocks


@dataclass(frozen=True)
class ShardHead:
    digest: str
    head_len: int
    prefix: CapturePrefix
    schema_digest: str
    payload_bytes: int
    slices: tuple[SliceRecord, ...]

    @property
    def size(self) -> int:
        return self.head_len + self.payload_bytes


@dataclass(frozen=True)
class RegionDecl:
    """A region as the schema declares it. Identity: (schema digest, ordinal)."""

    ordinal: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nonfinite: bool = False  # declared (allow_nonfinite) to hold NaN/inf: restored as saved

    @property
    def words(self) -> int:
        return _numel(self.shape)

    def to_json(self) -> dict:
        out = {"ordinal": self.ordinal, "name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.nonfinite:
            out["nonfinite"] = True
        return out


@dataclass(frozen=True)
class ShardRef:
    """A manifest's record of one shard: its digest, size and word ranges.

    ``carried`` is (update, cursor, epoch) when the shard was written by an
    earlier capture of the same run/step and is reused unchanged (a frozen
    region costs no bytes); the shard's own head records that capture, and a
    reader checks it against exactly this, never against "any earlier one".
    """

    digest: str
    size: int
    slices: tuple[tuple[int, int, int], ...]  # (ordinal, lo, hi)
    carried: tuple[int, int, int] | None = None

    def to_json(self) -> dict:
        out = {"digest": self.digest, "size": self.size, "slices": [list(s) for s in self.slices]}
        if self.carried is not None:
            out["carried"] = dict(zip(("update", "cursor", "epoch"), self.carried))
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "ShardRef":
        """The record :meth:`to_json` made (a peer's, on its way into a manifest that validates it again)."""
        carried = obj.get("carried")
        return cls(str(obj["digest"]), int(obj["size"]), tuple((int(o), int(lo), int(hi)) for o, lo, hi in obj["slices"]),
                   None if carried is None else (int(carried["update"]), int(carried["cursor"]), int(carried["epoch"])))

    def written_by(self, prefix: "CapturePrefix") -> "CapturePrefix":
        """The capture whose prefix the shard's head must carry, within a manifest of ``prefix``."""
        if self.carried is None:
            return prefix
        return CapturePrefix(prefix.run, prefix.step, *self.carried)


@dataclass(frozen=True)
class ChildRef:
    """A tree group manifest's record of one child: its role, subtree size and group manifest."""

    role: int
    size: int
    digest: str
    bytes: int  # the child group manifest's exact size

    def to_json(self) -> dict:
        return {"role": self.role, "size": self.size, "digest": self.digest, "bytes": self.bytes}


@dataclass(frozen=True)
class Publisher:
    """Who wrote a manifest: the star (one manifest), or role ``role`` of a tree of ``fanout``."""

    kind: str             # "star" | "tree"
    fanout: int = 0       # tree only
    role: int = 0         # tree only: this group manifest's role (preorder)
    subtree: int = 0      # tree only: roles [role, role + subtree) are below this manifest

    def to_json(self) -> dict:
        if self.kind == "star":
            return {"kind": "star"}
        return {"kind": "tree", "fanout": self.fanout, "role": self.role, "subtree": self.subtree}


STAR = Publisher("star")


@dataclass(frozen=True)
class ManifestHead:
    digest: str
    head_len: int
    prefix: CapturePrefix
    schema_digest: str
    regions: tuple[RegionDecl, ...]
    shards: tuple[ShardRef, ...]
    owners: int
    metadata: Any
    publisher: Publisher = STAR
    children: tuple[ChildRef, ...] = ()
    state: Any = None  # the decoded typed skeleton (regions as RegionRef), or None: a dict of regions by name
    state_json: Any = field(default=None, compare=False)  # the same skeleton as recorded (typed JSON)

    @property
    def size(self) -> int:
        return self.head_len


# ---------------------------------------------------------------- encoding


def encode_head(header: Mapping[str, Any]) -> bytes:
    """Prefix + canonical JSON header, padded with spaces so the payload starts aligned."""
    body = canonical_json(header)
    body += b" " * (-(PREFIX_LEN + len(body)) % ALIGN)
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(body)} bytes exceeds the {MAX_HEADER_BYTES}-byte cap")
    return PREFIX.pack(MAGIC, VERSION, len(body)) + body


def aligned(offset: int) -> int:
    return offset + (-offset % ALIGN)


def shard_header(prefix: CapturePrefix, schema_digest: str, slices: Sequence[SliceRecord]) -> dict:
    payload = max((s.offset + s.stored for s in slices), default=0)
    return {
        "kind": "shard", "prefix": prefix.to_json(), "schema_digest": schema_digest,
        "payload_bytes": payload, "slices": [s.to_json() for s in slices],
    }


def manifest_header(
    prefix: CapturePrefix, schema_digest: str, regions: Sequence[RegionDecl], shards: Sequence[ShardRef],
    owners: int, metadata: Any, publisher: Publisher = STAR, children: Sequence[ChildRef] = (), state: Any = None,
) -> dict:
    """``state`` is the typed skeleton (:mod:`alpha_ckpt.format.values`) of what was saved, root manifests only."""
    header = {
        "kind": "manifest", "prefix": prefix.to_json(), "schema_digest": schema_digest,
        "regions": [r.to_json() for r in regions], "shards": [s.to_json() for s in shards],
        "children": [c.to_json() for c in children], "owners": owners, "metadata": metadata, "payload_bytes": 0,
        "publisher": publisher.to_json(),
    }
    if state is not None:
        header["state"] = state
    return header


_last_schema: tuple[tuple[RegionDecl, ...] | None, str] = (None, "")


def schema_digest_of(regions: Sequence[RegionDecl]) -> str:
    """Digest of the complete logical schema (names, dtypes, shapes, in declaration order).

    A save asks for the same regions' digest several times (its shards, its manifest); a tuple of
    frozen declarations cannot change, so the last one's digest is reused for the same tuple."""
    global _last_schema
    last, digest = _last_schema
    if last is not None and regions is last:
        return digest
    digest = digest_bytes(canonical_json({"schema": [r.to_json() for r in regions]}))
    if isinstance(regions, tuple):
        _last_schema = (regions, digest)
    return digest


# ---------------------------------------------------------------- checks shared with decoding.py


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fail(what: str, message: str) -> Refusal:
    return Refusal(RefusalCode.FORMAT, f"{what}: {message}")


def _require_keys(obj: Any, keys: Sequence[str], what: str, optional: Sequence[str] = ()) -> None:
    if not isinstance(obj, dict):
        raise _fail(what, "expected an object")
    missing = [k for k in keys if k not in obj]
    extra = [k for k in obj if k not in keys and k not in optional]
    if missing or extra:
        raise _fail(what, f"missing keys {missing}, unexpected keys {extra}")


def _uint(value: Any, what: str) -> int:
    if type(value) is not int or value < 0 or value > MAX_INT:
        raise _fail(what, f"expected a non-negative integer, got {value!r}")
    return value
