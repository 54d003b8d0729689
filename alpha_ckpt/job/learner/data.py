"""The synthetic nightly-forecasting data set and the input sequence.

Sample ``i`` is (store i // items, item i % items): 90 days of daily demand
and the 7 days that follow. Every number is drawn from a generator keyed by
(seed, sample index), so a sample does not depend on who reads it or when.
The input sequence visits all samples once per pass, in an order keyed by
(seed, pass); the cursor is the position in that sequence.
"""
from __future__ import annotations

import functools
import math

import blake3
import torch

from alpha_ckpt.generation.planner import shares  # noqa: F401  (the input sequence's split among owners)
from alpha_ckpt.job.learner.config import JobConfig


def keyed_generator(*key: object) -> torch.Generator:
    """A CPU generator whose seed is a digest of ``key``: randomness keyed, not streamed."""
    digest = blake3.blake3(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample(config: JobConfig, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(history[history_days], target[horizon_days]) of sample ``index``, float32."""
    g = keyed_generator("sample", config.seed, index)
    days = config.history_days + config.horizon_days
    level = 1.0 + torch.rand((), generator=g) * 4.0
    trend = (torch.rand((), generator=g) - 0.5) * 0.02
    phase = torch.rand((), generator=g) * 2 * math.pi
    t = torch.arange(days, dtype=torch.float32)
    weekly = torch.sin(2 * math.pi * t / 7 + phase) * 0.3 * level
    noise = torch.randn(days, generator=g) * 0.1 * level
    series = (level + trend * t + weekly + noise).to(torch.float32) / 5.0
    return series[:config.history_days].clone(), series[config.history_days:].clone()


@functools.lru_cache(maxsize=8)
def _pass_order(seed: int, samples: int, pass_index: int) -> torch.Tensor:
    return torch.randperm(samples, generator=keyed_generator("pass", seed, pass_index))


def sequence_indices(config: JobConfig, start: int, stop: int) -> list[int]:
    """Sample indices at input-sequence positions [start, stop)."""
    out = []
    n = config.samples
    for position in range(start, stop):
        out.append(int(_pass_order(config.seed, n, position // n)[position % n]))
    return out


def batch(config: JobConfig, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [sample(config, i) for i in sequence_indices(config, start, stop)]
    if not pairs:
        return torch.empty(0, config.history_days), torch.empty(0, config.horizon_days)
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
