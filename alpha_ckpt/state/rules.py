"""Placement by name: entries of a state that differ per rank by nature (BatchNorm's running statistics
under DDP) without wrapping the object that holds them in :class:`~alpha_ckpt.state.placement.PerRank`.

``per_rank`` patterns: an entry whose dotted name matches (fnmatch, ``*.running_mean``) is stored
as if it were wrapped in ``PerRank`` at that name (regions ``PATH.RANK``), restored to the same
rank, and bound to the saved rank count (refused as ``placement-bound`` on another, unless the
restore drops per-rank entries). ``from_rank0`` patterns: a tensor whose dotted name matches is
stored as rank 0 holds it (rank 0 writes it, the other ranks' copies are neither written nor
compared) and restores to every rank, on any rank count. Everything else stays replicated.

The patterns are recorded in the root manifest (``metadata["placement_patterns"]``): a restore matches a
destination that holds the plain entry against what was saved per rank only where a recorded
pattern says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from alpha_ckpt.state.manifest import matches_any
from alpha_ckpt.runtime.options import pattern_list

METADATA_KEY = "placement_patterns"


def patterns(value: Any, what: str) -> tuple[str, ...]:
    """fnmatch patterns from a string (one pattern) or an iterable of strings, none empty; ValueError otherwise."""
    out = pattern_list(value, what)
    if any(not p for p in out):
        raise ValueError(f"{what}: a pattern is a non-empty string, not ''")
    return out


@dataclass(frozen=True)
class PlacementRules:
    per_rank: tuple[str, ...] = ()
    from_rank0: tuple[str, ...] = ()

    @classmethod
    def of(cls, per_rank: Any = (), from_rank0: Any = ()) -> "PlacementRules":
        return cls(patterns(per_rank, "per_rank"), patterns(from_rank0, "from_rank0"))

    def __bool__(self) -> bool:
        return bool(self.per_rank or self.from_rank0)

    def recorded(self) -> dict:
        """What the root manifest's metadata records (nothing when no pattern is given)."""
        if not self:
            return {}
        return {METADATA_KEY: {"per_rank": list(self.per_rank), "from_rank0": list(self.from_rank0)}}

    def kind(self, name: str) -> str | None:
        """"per-rank", "rank0" or None (replicated) for the entry ``name``; ValueError when both match."""
        mine, first = matches_any(name, self.per_rank), matches_any(name, self.from_rank0)
        if mine and first:
            raise ValueError(f"state entry {name!r} matches both a per_rank and a from_rank0 pattern")
        return "per-rank" if mine else "rank0" if first else None


def recorded_per_rank(metadata: Any) -> tuple[str, ...]:
    """The per_rank patterns a root manifest's metadata records (none in one written without them)."""
    placement = metadata.get(METADATA_KEY) if isinstance(metadata, Mapping) else None
    found = placement.get("per_rank") if isinstance(placement, Mapping) else None
    return tuple(p for p in found if isinstance(p, str)) if isinstance(found, list) else ()
