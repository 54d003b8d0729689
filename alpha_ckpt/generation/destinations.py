"""Where a restore writes: destination tensors checked for shared memory before any byte is written.

Pure planning, no I/O. :func:`check_destinations` refuses (``coverage``)
two destinations that share a byte, one that overlaps itself (an expanded
view, overlapping strides) and, through :func:`destination_layouts`, one
that holds no memory to restore into (a meta tensor, a non-strided layout):
each would report success with a destination that differs from the saved
state. Exactly the same view under two names (tied weights: a model's input
embedding and output projection) is allowed; such names come back as a
group, and :func:`check_tied_saved_alike` requires the checkpoint to hold
identical words for all of them.

Cost: the common case (every destination in storage of its own, or in
disjoint byte spans of one storage) is an interval sweep over the spans.
Only spans that intersect are decided exactly, with a mask of the
intersecting span (one flag per granule: the largest unit every layout in
it is aligned to) marked through strided views of each destination.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from alpha_ckpt.errors import Refusal, RefusalCode


@dataclass(frozen=True)
class Layout:
    """Where one destination's elements lie: byte ``address`` of element 0, then strides in elements."""

    name: str
    memory: str       # the device: only destinations on one device can share bytes
    address: int
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        """One past the last byte of the highest-addressed element (strides are never negative)."""
        return self.address + self.itemsize * (1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)))

    @property
    def view(self) -> tuple:
        """What makes two destinations the very same view."""
        return self.memory, self.address, self.shape, self.stride, self.dtype


def destination_layouts(named: Sequence[tuple[str, torch.Tensor]]) -> list[Layout]:
    """The layout of every destination; refuses those that hold no memory a restore can write."""
    unwritable = [f"{name!r} ({'a meta tensor' if t.device.type == 'meta' else f'layout {t.layout}'})"
                  for name, t in named if t.device.type == "meta" or t.layout != torch.strided]
    if unwritable:
        raise Refusal(RefusalCode.COVERAGE, f"destination {', '.join(unwritable)} holds no memory a restore can "
                      "write in place")
    return [Layout(name, str(t.device), t.data_ptr(), t.element_size(), tuple(t.shape), tuple(t.stride()),
                   str(t.dtype)) for name, t in named]


def check_destinations(layouts: Sequence[Layout]) -> list[list[int]]:
    """Refuse destinations that overlap; return the groups (indices) of destinations that are one view, tied.

    Empty destinations are written nowhere and take part in nothing.
    """
    by_view: dict[tuple, list[int]] = {}
    for i, layout in enumerate(layouts):
        if layout.numel:
            by_view.setdefault(layout.view, []).append(i)
    distinct = [layouts[members[0]] for members in by_view.values()]
    for layout in distinct:
        if _overlaps_itself(layout):
            raise Refusal(RefusalCode.COVERAGE, f"destination {layout.name!r} overlaps itself (an expanded view or "
                          "overlapping strides): it cannot hold every saved word")
    for cluster in _intersecting_spans(distinct):
        _refuse_shared_bytes(cluster)
    return [members for members in by_view.values() if len(members) > 1]


def check_tied_saved_alike(groups: Sequence[Sequence[int]], names: Sequence[str],
                           saved: Mapping[int, Sequence[tuple[int, int, str]]]) -> None:
    """Tied destinations get the same bytes twice only if the checkpoint holds the same words for each name.

    ``saved`` maps a region's ordinal (its index among the destinations) to
    the (lo, hi, raw BLAKE3) of the slices that hold it, sorted: equal lists
    are equal words, known from the shard heads without reading a byte.
    Words split into slices differently cannot be compared that way, and
    are refused too.
    """
    for group in groups:
        first = group[0]
        for other in group[1:]:
            if list(saved[other]) != list(saved[first]):
                raise Refusal(RefusalCode.COVERAGE, f"destinations {names[first]!r} and {names[other]!r} are the same "
                              "tensor (tied), but the checkpoint does not hold the same words for both (or splits "
                              "them into slices differently)")


def _intersecting_spans(layouts: Sequence[Layout]) -> list[list[Layout]]:
    """Clusters of two or more layouts whose byte spans intersect (one sort and one sweep)."""
    clusters: list[list[Layout]] = []
    current: list[Layout] = []
    current_end = 0
    for layout in sorted(layouts, key=lambda l: (l.memory, l.address)):
        if current and layout.memory == current[0].memory and layout.address < current_end:
            current.append(layout)
            current_end = max(current_end, layout.end)
            continue
        if len(current) > 1:
            clusters.append(current)
        current, current_end = [layout], layout.end
    if len(current) > 1:
        clusters.append(current)
    return clusters


def _overlaps_itself(layout: Layout) -> bool:
    dims = sorted((s, n) for n, s in zip(layout.shape, layout.stride) if n > 1)
    if any(s == 0 for s, _ in dims):
        return True  # an expanded dimension: every index along it is the same element
    extent = 1  # elements spanned by the smaller-stride dimensions so far
    for s, n in dims:
        if s < extent:
            break  # no quick proof: decide exactly
        extent += (n - 1) * s
    else:
        return False
    mask, origin, granule = _mask_for([layout])
    marked = _marks(mask, layout, origin, granule)
    marked.fill_(True)
    return int(mask.sum()) < layout.numel * (layout.itemsize // granule)


def _refuse_shared_bytes(cluster: Sequence[Layout]) -> None:
    """Mark each layout's bytes in one mask; a layout finding a byte already marked shares it with an earlier one."""
    mask, origin, granule = _mask_for(cluster)
    for i, layout in enumerate(cluster):
        marked = _marks(mask, layout, origin, granule)
        if bool(marked.any()):
            earlier = next(e for e in cluster[:i] if _share_a_byte(e, layout))
            raise Refusal(RefusalCode.COVERAGE, f"destinations {earlier.name!r} and {layout.name!r} share memory: "
                          "restoring both cannot give each its saved words (only the very same view under two "
                          "names, tied weights, may be)")
        marked.fill_(True)


def _share_a_byte(a: Layout, b: Layout) -> bool:
    mask, origin, granule = _mask_for([a, b])
    _marks(mask, a, origin, granule).fill_(True)
    return bool(_marks(mask, b, origin, granule).any())


def _mask_for(layouts: Sequence[Layout]) -> tuple[torch.Tensor, int, int]:
    """A flag per granule of the layouts' joint span: (mask, byte address of flag 0, granule in bytes)."""
    origin = min(l.address for l in layouts)
    end = max(l.end for l in layouts)
    granule = math.gcd(*(l.itemsize for l in layouts), *(l.address - origin for l in layouts))
    return torch.zeros((end - origin) // granule, dtype=torch.bool), origin, granule


def _marks(mask: torch.Tensor, layout: Layout, origin: int, granule: int) -> torch.Tensor:
    """The flags of ``layout``'s bytes: its strides in granules, plus a trailing dimension over one element."""
    per_item = layout.itemsize // granule
    return mask.as_strided((*layout.shape, per_item), (*(s * per_item for s in layout.stride), 1),
                           (layout.address - origin) // granule)
