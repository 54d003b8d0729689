"""Where an entry of a collective state lives: replicated (the default), per rank, or partitioned."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class PerRank:
    """An entry that differs per rank (its RNG, its data position): stored per rank, restored to the same rank.

    Its regions are named ``PATH.RANK.rest`` (``rng.1.torch``) in the checkpoint.
    """

    value: Any


@dataclass
class Partitioned:
    """A rank's own word range [lo, hi) of a flat region of logical ``shape``
    (ZeRO-style optimizer state): the ranks' ranges tile the region."""

    tensor: torch.Tensor
    lo: int
    hi: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        words = 1
        for d in self.shape:
            words *= d
        if not 0 <= self.lo <= self.hi <= words or self.tensor.numel() != self.hi - self.lo:
            raise ValueError(f"Partitioned: words [{self.lo}, {self.hi}) of a region of {words} words need a tensor "
                             f"of {self.hi - self.lo} words, not {self.tensor.numel()}")


def is_dtensor(obj: Any) -> bool:
    """A torch.distributed.tensor.DTensor (checked without importing it: none exists before it is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def contiguous_words(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int] | None:
    """Pure: the flat word range [lo, hi) of a row-major tensor of ``shape`` that the box at ``offsets``
    of ``lengths`` is, or None when the box is not one contiguous range (an empty box is (0, 0))."""
    if any(n == 0 for n in lengths):
        return (0, 0)
    partial = [d for d in range(len(shape)) if lengths[d] != shape[d]]
    if partial and any(lengths[d] != 1 for d in range(partial[-1])):
        return None  # a dimension before the last partial one holds more than one index: several ranges
    lo, stride = 0, 1
    for d in reversed(range(len(shape))):
        lo += offsets[d] * stride
        stride *= shape[d]
    return lo, lo + math.prod(lengths)


@dataclass
class ShardRanges:
    """A DTensor's local shard as word ranges of its global tensor: ``ranges`` are (lo, hi, at): global
    words [lo, hi) are the local shard's flat words [at, at + hi - lo)."""

    tensor: torch.Tensor  # the local shard, flat and contiguous
    ranges: tuple[tuple[int, int, int], ...]
    shape: tuple[int, ...]


def box_ranges(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Pure: the row-major box at ``offsets`` of ``lengths`` in a tensor of ``shape`` as (lo, hi, at)
    word ranges, in the box's own row-major order (``at``: where the range starts in the box)."""
    if any(n == 0 for n in lengths):
        return ()
    one = contiguous_words(shape, offsets, lengths)
    if one is not None:
        return ((one[0], one[1], 0),)
    partial = [d for d in range(len(shape)) if lengths[d] != shape[d]][-1]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = lengths[partial] * strides[partial]
    starts = np.zeros(1, dtype=np.int64) + offsets[partial] * strides[partial]
    for d in range(partial):  # every index of the leading box dimensions, row-major
        starts = (starts[:, None] + (offsets[d] + np.arange(lengths[d], dtype=np.int64))[None, :] * strides[d]).T
        starts = starts.reshape(-1)
    starts = np.sort(starts)  # row-major in the tensor is row-major in the box
    return tuple((int(lo), int(lo) + run, i * run) for i, lo in enumerate(starts))


def dtensor_part(value: Any, name: str) -> "torch.Tensor | Partitioned | ShardRanges":
    """A DTensor as the Checkpointer stores it: a replicated one as its local (whole) tensor; a sharded one
    as the word ranges of the global tensor its local shard is: a Partitioned range when it is one
    (FSDP2's ``Shard(0)``), else :class:`ShardRanges` (``Shard(1)`` of a matrix, a box of a 2-D mesh,
    FSDP2 over tensor parallel: one range per row of the box). A shard that other ranks hold too (HSDP's
    replicas, or a DTensor on a sub-mesh: FSDP-only modules of a (dp, tp) mesh, alike on every tp rank)
    is declared by each of them: the save's agreement picks one writer and compares the others' digests
    (:func:`~alpha_ckpt.collective.agreement.shared_piece_writers`). Raises ValueError, naming the entry,
    for ``Partial``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    placements, mesh = tuple(value.placements), value.device_mesh
    local = value.to_local()
    if all(isinstance(p, Replicate) for p in placements):
        return local
    # _StridedShard (FSDP2 over a tensor-parallel Shard) leaves each rank one box too: its offsets come
    # from the same function DCP takes its chunk offsets from.
    if not all(isinstance(p, (Shard, Replicate)) or type(p).__name__ == "_StridedShard" for p in placements):
        raise ValueError(f"state entry {name!r} is a DTensor placed {placements}: partial (unreduced) values are not "
                         "a checkpoint; reduce them first")
    shape = tuple(int(d) for d in value.shape)
    lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    lengths, offsets = tuple(int(n) for n in lengths), tuple(int(o) for o in offsets)
    words = contiguous_words(shape, offsets, lengths)
    if words is not None:
        return Partitioned(local.reshape(-1), words[0], words[1], shape)
    return ShardRanges(local.reshape(-1), box_ranges(shape, offsets, lengths), shape)


def restore_ranges(value: Any, name: str) -> "torch.Tensor | ShardRanges":
    """Where a DTensor destination's words go: its local shard (replicated), or every range of it
    (a replica's too: each rank restores what it holds, whoever saved it)."""
    part = dtensor_part(value, name)
    if isinstance(part, Partitioned):
        return ShardRanges(part.tensor, ((part.lo, part.hi, 0),) if part.hi > part.lo else (), part.shape)
    return part
