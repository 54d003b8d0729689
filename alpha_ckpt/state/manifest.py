"""Region identity, the schema of a state dict, and coverage checks.

A region is identified by (schema digest, declaration ordinal): the digest of
the complete logical schema and the position of the region in it. Names and
dtypes describe a region; no rank, path or offset is part of its identity.
Coverage is checked on word ranges, never by adding up byte counts.
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.decoding import decode_head, parse_manifest_header
from alpha_ckpt.format.records import (DTYPES, MAX_INT, CapturePrefix, ManifestHead, RegionDecl, ShardHead, ShardRef, canonical_json,
                     digest_bytes)
from alpha_ckpt.format.values import decode_value, encode_value

# torch.frombuffer warns on every read-only buffer (mapped files, caller memory); we never write through them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=r"alpha_ckpt\.")

_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
_DTYPE_NAMES = {dt: name for name, dt in _TORCH_DTYPES.items()}


_NUMPY_SUMMED = {"float64": np.float64, "float32": np.float32, "float16": np.float16}  # bfloat16: torch
_SUM_AS = {"float64": np.float64, "float32": np.float32, "float16": np.float32}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


_SMALL_WORDS = 4096


def first_non_finite(raw, dtype: str, start: int = 0, end: int | None = None) -> int | None:
    """Index of the first NaN/inf word in raw bytes [start, end) of words of ``dtype``, or None.

    The one finiteness rule: a restore refuses what it finds, and a publish
    refuses to write what a restore would refuse.
    """
    end = len(raw) if end is None else end
    if not DTYPES[dtype][1] or end <= start:
        return None
    size = DTYPES[dtype][0]
    count = (end - start) // size
    # One cheap pass first: any NaN or inf makes the sum non-finite, so a finite sum proves every
    # word finite. Half types sum in float32 (their own range overflows at once); a sum that
    # overflows only from large finite words is found out by the exact pass below. numpy sums on
    # the calling thread: torch would start (and leave spinning) an OpenMP team in every thread
    # that checks, which on a busy host takes the cores that hashing and writing need.
    if dtype in _NUMPY_SUMMED and count <= _SMALL_WORDS:  # a few words: no error-state context per tensor
        if np.isfinite(np.frombuffer(raw, dtype=_NUMPY_SUMMED[dtype], count=count, offset=start)).all():
            return None
    elif dtype in _NUMPY_SUMMED:
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are what this looks for
            total = np.frombuffer(raw, dtype=_NUMPY_SUMMED[dtype], count=count, offset=start).sum(dtype=_SUM_AS[dtype])
        if np.isfinite(total):
            return None
    words = torch.frombuffer(raw, dtype=torch_dtype(dtype), count=count, offset=start)
    if dtype not in _NUMPY_SUMMED and torch.isfinite(words.sum(dtype=torch.float32 if size == 2 else None)):
        return None
    low, high = torch.aminmax(words)  # NaN propagates; +-inf shows at the ends
    if torch.isfinite(low) and torch.isfinite(high):
        return None
    return start // size + int((~torch.isfinite(words)).nonzero()[0, 0])


def word_value(raw, dtype: str, index: int) -> float:
    return float(torch.frombuffer(raw, dtype=torch_dtype(dtype), count=1, offset=index * DTYPES[dtype][0])[0])


def dtype_name(dtype: torch.dtype, where: str) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"{where}: dtype {dtype} is not supported (supported: {', '.join(DTYPES)})") from None


def regions_of(named: Sequence[tuple[str, torch.Tensor]], allow_nonfinite: Sequence[str] = ()) -> tuple[RegionDecl, ...]:
    """Region declarations of (dotted name, tensor) pairs; names matching an ``allow_nonfinite``
    pattern (fnmatch) are declared to hold NaN/inf."""
    return tuple(
        RegionDecl(i, name, dtype_name(t.dtype, name), tuple(t.shape), matches_any(name, allow_nonfinite))
        for i, (name, t) in enumerate(named)
    )


def matches_any(name: str, patterns: str | Sequence[str]) -> bool:
    """fnmatch on dotted names: ``*.mask`` matches ``model.blocks.0.mask``; a bare string is one pattern."""
    if isinstance(patterns, str):  # callers parse their patterns once (pattern_list); a bare string is still one
        patterns = (patterns,)
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def describe_region(r: RegionDecl) -> str:
    return f"{r.dtype}{list(r.shape)}"


def refuse_mismatch(what: str, missing: Sequence[str], unexpected: Sequence[str], differ: Sequence[str],
                    dtype_only: bool = False) -> Refusal:
    """One refusal naming the entries a destination and a checkpoint disagree on (first 10 of each, and counts).

    ``coverage`` when an entry is missing, unexpected or reshaped; ``contract-mismatch``
    when the only differences are dtypes (another numerical contract).
    """
    parts = []
    for label, names in (("missing from the checkpoint", missing), ("in the checkpoint but not the destination",
                                                                     unexpected), ("different", differ)):
        if names:
            more = f", and {len(names) - 10} more" if len(names) > 10 else ""
            parts.append(f"{len(names)} {label}: {', '.join(names[:10])}{more}")
    code = RefusalCode.CONTRACT_MISMATCH if dtype_only and not missing and not unexpected else RefusalCode.COVERAGE
    return Refusal(code, f"{what}: the destination does not match the checkpoint ({'; '.join(parts)})")


def match_regions(saved: Sequence[RegionDecl], wanted: Sequence[RegionDecl], what: str) -> list[int]:
    """Match destination regions to saved ones by dotted name (never by order): the saved ordinal of each.

    Refuses, naming them, entries missing from the checkpoint, saved entries the
    destination lacks, and entries whose dtype or shape differ.
    """
    by_name = {r.name: r for r in saved}
    wanted_names = {r.name for r in wanted}
    missing = [r.name for r in wanted if r.name not in by_name]
    unexpected = [r.name for r in saved if r.name not in wanted_names]
    differ, dtype_only = [], True
    for w in wanted:
        s = by_name.get(w.name)
        if s is not None and (s.dtype, s.shape) != (w.dtype, w.shape):
            differ.append(f"{w.name} (saved {describe_region(s)}, destination {describe_region(w)})")
            dtype_only = dtype_only and s.shape == w.shape
    if missing or unexpected or differ:
        raise refuse_mismatch(what, missing, unexpected, differ, dtype_only)
    return [by_name[w.name].ordinal for w in wanted]


def check_coverage(regions: Sequence[RegionDecl], slices: Iterable[tuple[int, int, int, str]], what: str) -> None:
    """Every region's words [0, n) are covered exactly once by (ordinal, lo, hi, source) slices.

    An empty slice [w, w) inside the region holds no word and is accepted as nothing."""
    per_region: dict[int, list[tuple[int, int, str]]] = {r.ordinal: [] for r in regions}
    for ordinal, lo, hi, source in slices:
        if ordinal not in per_region:
            raise Refusal(RefusalCode.COVERAGE, f"{what}: {source} names region ordinal {ordinal}, which the schema does not declare")
        if lo == hi <= regions[ordinal].words:
            continue  # an empty piece (an FSDP shard of a tensor with fewer rows than ranks) holds nothing
        if not lo < hi <= regions[ordinal].words:
            raise Refusal(RefusalCode.COVERAGE, f"{what}: {source} holds words [{lo}, {hi}) of region "
                          f"{regions[ordinal].name!r}, which has {regions[ordinal].words} words")
        per_region[ordinal].append((lo, hi, source))
    for region in regions:
        end = 0
        for lo, hi, source in sorted(per_region[region.ordinal]):
            if lo < end:
                raise Refusal(RefusalCode.COVERAGE, f"{what}: region {region.name!r} words [{lo}, {min(hi, end)}) are saved twice ({source})")
            if lo > end:
                raise Refusal(RefusalCode.COVERAGE, f"{what}: region {region.name!r} words [{end}, {lo}) are not saved by any shard")
            end = hi
        if end != region.words:
            raise Refusal(RefusalCode.COVERAGE, f"{what}: region {region.name!r} words [{end}, {region.words}) are not saved by any shard")


def check_region_names(regions: Sequence[RegionDecl], what: str) -> None:
    """Region names are unique: a reader matches a destination's entries to regions by dotted name."""
    seen: set[str] = set()
    for r in regions:
        if r.name in seen:
            raise Refusal(RefusalCode.FORMAT, f"{what}: two regions are named {r.name!r} (dotted names that "
                          "coincide, perhaps only across ranks: a PerRank entry beside another of that name)")
        seen.add(r.name)


def check_counters(prefix: CapturePrefix, what: str) -> None:
    for name in ("update", "cursor", "epoch"):
        value = getattr(prefix, name)
        if type(value) is not int or not 0 <= value <= MAX_INT:
            raise Refusal(RefusalCode.FORMAT, f"{what}: {name} {value!r} is not an int in [0, 2**63)")


def encode_identity(identity: Any, what: str = "identity") -> Any:
    """A learner identity as a root manifest records it: its typed JSON (:mod:`alpha_ckpt.format.values`), so
    that tuples, int keys and floats come back as they were given. ValueError for what it cannot hold."""
    return encode_value(identity, what)


def identity_matches(saved: Any, identity: Any) -> bool:
    """Whether a root manifest's recorded identity (``metadata["identity"]``) is ``identity``, compared as
    typed values: the saved encoding against the same encoding of the given one (bit-exact floats,
    tuples apart from lists). A generation whose identity was recorded as plain JSON (before identities
    were typed) is compared as plain JSON."""
    try:
        given = canonical_json(encode_identity(identity))
    except (ValueError, TypeError):
        return False
    try:
        if canonical_json(saved) == given:
            return True
        decode_value(saved)
        return False  # a typed identity, another one
    except (ValueError, TypeError):
        return False
    except Refusal:  # not typed JSON: recorded as plain JSON
        try:
            return canonical_json(saved) == canonical_json(identity)
        except (ValueError, TypeError):
            return False


_UNCHECKED = object()


def check_root_manifest(manifest: ManifestHead, records: Iterable[ShardRef] | None, what: str, *,
                        identity: Any = _UNCHECKED, metadata: Any = _UNCHECKED) -> None:
    """THE structural check of a decoded root manifest, run by every publisher before its ref is written
    (on the manifest's bytes as a reader decodes them: :func:`decode_manifest`) and by every reader
    (restore, verify) before a byte is copied: what one accepts the other accepts.

    Decoding (:func:`~alpha_ckpt.format.records.parse_manifest_header`) already checked the format, the
    counters' types, the typed skeleton naming every region in order and canonical metadata. This adds:
    counters in range, region names unique, and coverage: ``records`` (every shard record of the
    generation; None for a tree's root alone, whose coverage is structural) hold every word of every
    region exactly once. ``identity`` and ``metadata`` (a publisher's): what a reader decodes is what
    was given (the identity as :func:`identity_matches` compares it; the metadata equal as a value).
    """
    check_counters(manifest.prefix, what)
    check_region_names(manifest.regions, what)
    if records is not None:
        records = list(records)
        seen: set[str] = set()
        for r in records:  # a reader opens each shard once: a second record of one object is another claim
            if r.digest in seen:
                raise Refusal(RefusalCode.COVERAGE, f"{what}: shard {r.digest[:16]}... is named twice by the manifest")
            seen.add(r.digest)
        check_coverage(manifest.regions, ((o, lo, hi, f"shard {r.digest[:16]}...")
                                          for r in records for (o, lo, hi) in r.slices), what)
    if identity is not _UNCHECKED:
        meta = manifest.metadata if isinstance(manifest.metadata, dict) else {}
        if not identity_matches(meta.get("identity"), identity):
            raise Refusal(RefusalCode.FORMAT, f"{what}: the identity it records would not match the one it was "
                          "saved with on restore")
    if metadata is not _UNCHECKED and not (manifest.metadata == metadata and
                                           canonical_json(manifest.metadata) == canonical_json(metadata)):
        raise Refusal(RefusalCode.FORMAT, f"{what}: its metadata reads back as another value than was given")


def decode_manifest(head: bytes | memoryview, what: str) -> ManifestHead:
    """A manifest's bytes (as :func:`alpha_ckpt.generation.writer.encode_manifest` makes them) decoded exactly as a
    reader decodes the object file: the head digest, canonical JSON, every field."""
    digest = digest_bytes(head)
    header = decode_head(head, digest, len(head), what)
    if header.get("kind") != "manifest":
        raise Refusal(RefusalCode.FORMAT, f"{what} is a {header.get('kind')}, not a manifest")
    return parse_manifest_header(header, digest, len(head), what)


def check_shard_against_record(head: ShardHead, record: ShardRef, prefix: CapturePrefix, schema_digest: str,
                               regions: Sequence[RegionDecl], what: str) -> None:
    """A shard must belong to the same capture (or the earlier one it is declared carried from)
    and hold exactly what the manifest says."""
    expected = record.written_by(prefix)
    if head.prefix != expected:
        carried = f" (carried from {_describe(expected)})" if record.carried is not None else ""
        raise Refusal(RefusalCode.MIXED_CAPTURE, f"{what}: captured at {_describe(head.prefix)}, "
                      f"but the manifest is of {_describe(prefix)}{carried}")
    if head.schema_digest != schema_digest:
        raise Refusal(RefusalCode.MIXED_CAPTURE, f"{what}: belongs to schema {head.schema_digest[:16]}..., "
                      f"the manifest's is {schema_digest[:16]}...")
    held = sorted((s.ordinal, s.lo, s.hi) for s in head.slices)
    if held != sorted(record.slices):
        raise Refusal(RefusalCode.FORMAT, f"{what}: holds word ranges {held[:4]}... that differ from the manifest's record")
    for s in head.slices:
        region = regions[s.ordinal]
        if s.dtype != region.dtype or s.shape != region.shape:
            raise Refusal(RefusalCode.FORMAT, f"{what}: slice of region {region.name!r} describes it as "
                          f"{s.dtype}{list(s.shape)}, the schema as {region.dtype}{list(region.shape)}")


def _describe(p: CapturePrefix) -> str:
    return f"run={p.run} step={p.step} update={p.update} cursor={p.cursor} epoch={p.epoch}"
