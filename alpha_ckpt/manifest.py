"""Region identity, the schema of a state dict, and coverage checks.

A region is identified by (schema digest, declaration ordinal): the digest of
the complete logical schema and the position of the region in it. Names and
dtypes describe a region; no rank, path or offset is part of its identity.
Coverage is checked on word ranges, never by adding up byte counts.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Sequence

import torch

from .errors import Refusal, RefusalCode
from .format import DTYPES, CapturePrefix, RegionDecl, ShardHead, ShardRef

# torch.frombuffer warns on every read-only buffer (mapped files, caller memory); we never write through them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=r"alpha_ckpt\.")

_TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
_DTYPE_NAMES = {dt: name for name, dt in _TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def first_non_finite(raw, dtype: str, start: int = 0, end: int | None = None) -> int | None:
    """Index of the first NaN/inf word in raw bytes [start, end) of words of ``dtype``, or None.

    The one finiteness rule: a restore refuses what it finds, and a publish
    refuses to write what a restore would refuse.
    """
    end = len(raw) if end is None else end
    if not DTYPES[dtype][1] or end <= start:
        return None
    size = DTYPES[dtype][0]
    words = torch.frombuffer(raw, dtype=torch_dtype(dtype), count=(end - start) // size, offset=start)
    # One cheap pass first: any NaN or inf makes the sum non-finite, so a finite sum proves every
    # word finite. Half types sum in float32 (their own range overflows at once); a sum that
    # overflows only from large finite words is found out by the exact pass below.
    total = words.sum(dtype=torch.float32 if size == 2 else None)
    if torch.isfinite(total):
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


def flatten_state(state: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Nested dicts of tensors -> [(dotted name, tensor)] in declaration (insertion) order.

    Keys may contain dots (module FQNs do); two entries that flatten to the
    same dotted name are refused, since the name describes the region.
    """
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"state key {prefix}{key!r}: keys must be non-empty strings")
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(value, name + ".")
            elif isinstance(value, torch.Tensor):
                if name in seen:
                    raise ValueError(f"state entry {name!r} appears twice after flattening nested keys")
                seen.add(name)
                out.append((name, value))
            else:
                raise ValueError(f"state entry {name!r} is a {type(value).__name__}; only tensors and dicts of tensors are saved")

    walk(state, "")
    return out


def regions_of(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[RegionDecl, ...]:
    return tuple(
        RegionDecl(i, name, dtype_name(t.dtype, name), tuple(t.shape)) for i, (name, t) in enumerate(named)
    )


def check_schema_matches(saved: Sequence[RegionDecl], wanted: Sequence[RegionDecl], what: str) -> None:
    """The destination must declare the same regions the checkpoint saved."""
    saved_names = [r.name for r in saved]
    wanted_names = [r.name for r in wanted]
    if saved_names != wanted_names:
        missing = sorted(set(wanted_names) - set(saved_names))
        unexpected = sorted(set(saved_names) - set(wanted_names))
        raise Refusal(RefusalCode.COVERAGE, f"{what}: regions differ from the destination (missing {missing}, "
                      f"unexpected {unexpected}{', order differs' if not missing and not unexpected else ''})")
    for s, w in zip(saved, wanted):
        if s.dtype != w.dtype:
            raise Refusal(RefusalCode.CONTRACT_MISMATCH, f"{what}: region {s.name!r} was saved as {s.dtype}, destination is {w.dtype}")
        if s.shape != w.shape:
            raise Refusal(RefusalCode.COVERAGE, f"{what}: region {s.name!r} was saved with shape {list(s.shape)}, destination has {list(w.shape)}")


def check_coverage(regions: Sequence[RegionDecl], slices: Iterable[tuple[int, int, int, str]], what: str) -> None:
    """Every region's words [0, n) are covered exactly once by (ordinal, lo, hi, source) slices."""
    per_region: dict[int, list[tuple[int, int, str]]] = {r.ordinal: [] for r in regions}
    for ordinal, lo, hi, source in slices:
        if ordinal not in per_region:
            raise Refusal(RefusalCode.COVERAGE, f"{what}: {source} names region ordinal {ordinal}, which the schema does not declare")
        if not lo < hi <= regions[ordinal].words:
            if lo == hi == 0 and regions[ordinal].words == 0:
                continue
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
