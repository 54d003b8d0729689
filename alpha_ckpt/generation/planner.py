"""Pure planning: what goes where. No I/O, no tensors; frozen plans.

Save side: :func:`pack_shards` packs region word ranges into shards of a
bounded size, splitting on word boundaries. Restore side: :func:`plan_restore`
maps saved slices onto destination slices, admitting joins (one destination
fed by several saved slices), splits (one saved slice feeding several
destinations), changed region boundaries and any physical order of slices.
Placement: :func:`shares` splits a range among owners, and :class:`Hierarchy`
is the shape of a bounded-fan-out publication tree.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Piece:
    """Words [lo, hi) of region ``ordinal``; ``itemsize`` bytes per word."""

    ordinal: int
    lo: int
    hi: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return (self.hi - self.lo) * self.itemsize


def pack_shards(pieces: Sequence[Piece], max_shard_bytes: int) -> tuple[tuple[Piece, ...], ...]:
    """Group pieces in order into shards of at most ``max_shard_bytes`` payload bytes.

    A piece larger than the room left is split on a word boundary. Every shard
    holds at least one word unless every piece is empty (empty regions still
    get a zero-length slice, so they are declared somewhere).
    """
    if any(p.itemsize > max_shard_bytes for p in pieces) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes {max_shard_bytes} is smaller than one word")
    shards: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    room = max_shard_bytes
    for piece in pieces:
        lo = piece.lo
        while True:
            words_left = piece.hi - lo
            fit = min(words_left, room // piece.itemsize)
            if fit == words_left:
                current.append(Piece(piece.ordinal, lo, piece.hi, piece.itemsize))
                room -= words_left * piece.itemsize
                break
            if fit > 0:
                current.append(Piece(piece.ordinal, lo, lo + fit, piece.itemsize))
                lo += fit
            if current:
                shards.append(tuple(current))
            current, room = [], max_shard_bytes
    if current:
        shards.append(tuple(current))
    return tuple(shards)


@dataclass(frozen=True)
class SavedSlice:
    """Where saved words live: ``source`` (a shard digest) and slice index ``index`` in it."""

    ordinal: int
    lo: int
    hi: int
    source: str
    index: int


@dataclass(frozen=True)
class WantedSlice:
    """Destination ``dest`` wants words [lo, hi) of region ``ordinal`` (dest holds exactly them)."""

    ordinal: int
    lo: int
    hi: int
    dest: int


@dataclass(frozen=True)
class Copy:
    """Copy ``words`` words from saved slice (source, index) at word ``src_word`` into dest at ``dst_word``.

    Both offsets are relative to the start of their slice.
    """

    source: str
    index: int
    src_word: int
    dest: int
    dst_word: int
    words: int


@dataclass(frozen=True)
class RestorePlan:
    copies: tuple[Copy, ...]
    sources: tuple[str, ...]  # saved sources the plan reads, in first-use order


class PlanError(ValueError):
    """A wanted word is not saved anywhere (coverage was not checked first)."""

    def __init__(self, ordinal: int, word: int):
        super().__init__(f"region ordinal {ordinal} word {word} is not saved")
        self.ordinal, self.word = ordinal, word


def plan_restore(saved: Sequence[SavedSlice], wanted: Sequence[WantedSlice]) -> RestorePlan:
    """Map every wanted word to exactly one saved word. Saved slices must not overlap."""
    by_region: dict[int, list[SavedSlice]] = {}
    for s in saved:
        if s.hi > s.lo:
            by_region.setdefault(s.ordinal, []).append(s)
    starts: dict[int, list[int]] = {}
    for ordinal, slices in by_region.items():
        slices.sort(key=lambda s: s.lo)
        starts[ordinal] = [s.lo for s in slices]
    copies: list[Copy] = []
    sources: dict[str, None] = {}
    for w in wanted:
        pos = w.lo
        slices = by_region.get(w.ordinal, [])
        i = bisect.bisect_right(starts.get(w.ordinal, []), pos) - 1
        while pos < w.hi:
            if i < 0 or i >= len(slices) or not slices[i].lo <= pos < slices[i].hi:
                raise PlanError(w.ordinal, pos)
            s = slices[i]
            end = min(w.hi, s.hi)
            copies.append(Copy(s.source, s.index, pos - s.lo, w.dest, pos - w.lo, end - pos))
            sources.setdefault(s.source)
            pos = end
            i += 1
    return RestorePlan(tuple(copies), tuple(sources))


def shares(total: int, owners: int) -> list[tuple[int, int]]:
    """Split [0, total) into ``owners`` contiguous shares; sizes differ by at most one, larger first."""
    if owners < 1:
        raise ValueError("owners must be at least 1")
    base, extra = divmod(total, owners)
    out, lo = [], 0
    for r in range(owners):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def share_of(total: int, owners: int, word: int) -> int:
    """The owner whose share (as :func:`shares` splits [0, total)) holds ``word``; O(1)."""
    base, extra = divmod(total, owners)
    if word < extra * (base + 1):
        return word // (base + 1)
    return extra + (word - extra * (base + 1)) // base


def owners_holding(total: int, owners: int, lo: int, hi: int) -> range:
    """The owners whose shares of [0, total) hold a word of [lo, hi) (empty for an empty range)."""
    if hi <= lo:
        return range(0)
    return range(share_of(total, owners, lo), share_of(total, owners, hi - 1) + 1)


@dataclass(frozen=True)
class Hierarchy:
    """A publication tree of ``owners`` roles with at most ``fanout`` children per role.

    Roles are numbered in preorder, so the subtree of a role of size ``n`` is
    the range [role, role + n). A role's n - 1 descendants are split among
    min(fanout, n - 1) children as :func:`shares` splits them (sizes differ by
    at most one, larger first), which keeps the height at about log_fanout(owners).
    Every query walks one root-to-role path: O(fanout x height), never O(owners).
    """

    owners: int
    fanout: int

    def __post_init__(self) -> None:
        if self.owners < 1 or self.fanout < 1:
            raise ValueError(f"a hierarchy needs owners >= 1 and fanout >= 1, got {self.owners} and {self.fanout}")

    def children(self, role: int, size: int) -> list[tuple[int, int]]:
        """(child role, child subtree size) of ``role`` whose subtree has ``size`` roles."""
        below = size - 1
        out, child = [], role + 1
        for lo, hi in shares(below, min(self.fanout, below)) if below else []:
            out.append((child, hi - lo))
            child += hi - lo
        return out

    def path(self, role: int) -> list[tuple[int, int]]:
        """(role, subtree size) from the root down to ``role``, inclusive."""
        if not 0 <= role < self.owners:
            raise ValueError(f"role {role} is outside [0, {self.owners})")
        out = [(0, self.owners)]
        while out[-1][0] != role:
            out.append(next((c, n) for c, n in self.children(*out[-1]) if c <= role < c + n))
        return out

    def subtree(self, role: int) -> int:
        return self.path(role)[-1][1]

    def parent(self, role: int) -> int | None:
        return self.path(role)[-2][0] if role else None

    def height(self, size: int | None = None) -> int:
        """Edges on the longest path down a subtree of ``size`` roles (default: the whole tree).

        A subtree's shape depends only on its size, and its first child always
        has the largest subtree.
        """
        height, size = 0, self.owners if size is None else size
        while size > 1:
            size = self.children(0, size)[0][1]
            height += 1
        return height
