"""Where an entry of a collective state lives: replicated (the default), per rank, or partitioned."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

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


def dtensor_part(value: Any, name: str) -> "Partitioned | torch.Tensor":
    """A DTensor as the Checkpointer stores it: a replicated one as its local (whole) tensor, a sharded one
    as the Partitioned word range its local shard is of the global tensor (FSDP2's ``Shard(0)``, any
    ``Shard(d)`` whose shard is one contiguous range). Raises ValueError, naming the entry, for a
    ``Partial`` placement, a shard that is not one range, or replicas across mesh dimensions."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    placements, mesh = tuple(value.placements), value.device_mesh
    local = value.to_local()
    if all(isinstance(p, Replicate) for p in placements):
        return local
    strided = any(type(p).__name__ == "_StridedShard" for p in placements)  # FSDP2 over tensor parallel
    if not strided and not all(isinstance(p, (Shard, Replicate)) for p in placements):
        raise ValueError(f"state entry {name!r} is a DTensor placed {placements}: partial (unreduced) values are not "
                         "a checkpoint; reduce them first")
    if any(isinstance(p, Replicate) and mesh.size(d) > 1 for d, p in enumerate(placements)):
        raise ValueError(f"state entry {name!r} is a DTensor placed {placements} on mesh {tuple(mesh.shape)}: "
                         "sharded and replicated across mesh dimensions (HSDP) is not stored by the Checkpointer "
                         "yet; save it through alpha_ckpt.dcp")
    shape = tuple(int(d) for d in value.shape)
    lengths, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    words = None if strided else contiguous_words(shape, tuple(offsets), tuple(lengths))
    if words is None or strided:
        raise ValueError(f"state entry {name!r} is a DTensor placed {placements} on mesh {tuple(mesh.shape)}: its "
                         f"local shard {list(lengths)} at {list(offsets)} is not one contiguous word range of "
                         f"{list(shape)}; the Checkpointer stores row-wise (Shard(0)) and replicated DTensors "
                         "today; save it through alpha_ckpt.dcp")
    return Partitioned(local.reshape(-1), words[0], words[1], shape)
