"""Where an entry of a collective state lives: replicated (the default), per rank, or partitioned."""
from __future__ import annotations

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
