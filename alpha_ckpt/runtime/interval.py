"""How often to checkpoint: Young/Daly's interval from the checkpoint's cost and the failure rate.

If a checkpoint costs ``C`` seconds of training time and failures arrive on
average every ``M`` seconds, the spacing that minimises the total waste
(checkpoint overhead plus work redone after a failure) is near
``sqrt(2 x C x M)`` (Young 1974; Daly 2006). Then the write overhead is
``C / interval`` of the run time and a failure redoes half an interval of
work on average. C = 60 s, M = 6 h gives 1,610 s (about 27 minutes), 3.7 %
and about 13 minutes.

Pure arithmetic: the job measures ``C`` and the seconds per update, owner 0
plans, and every owner applies the same plan (a number of updates), so the
owners never disagree about which boundary is a checkpoint.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\A\s*([0-9]+(?:\.[0-9]*)?)\s*(s|m|min|h|d)?\s*\Z")


def parse_duration(text: str) -> float:
    """'21600', '21600s', '360m', '6h', '0.25d' -> seconds (positive)."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a positive duration (examples: 21600, 360m, 6h)")
    return float(match.group(1)) * _UNITS[match.group(2) or ""]


@dataclass(frozen=True)
class IntervalPlan:
    cost_s: float           # C: training time one checkpoint costs
    mtbf_s: float           # M: mean time between failures
    interval_s: float       # sqrt(2 C M)
    overhead: float         # C / interval: the fraction of run time spent checkpointing
    expected_redo_s: float  # interval / 2: work a failure redoes on average

    def every_updates(self, update_s: float, floor_s: float = 0.0) -> int:
        """The interval (at least ``floor_s``, e.g. one background save) in whole updates, at least 1."""
        if update_s <= 0:
            return 1
        return max(1, math.ceil(max(self.interval_s, floor_s) / update_s - 1e-9))

    def describe(self) -> str:
        return (f"checkpoint interval {_human(self.interval_s)} = sqrt(2 x {self.cost_s:.3g} s x "
                f"{self.mtbf_s:.6g} s) (Young/Daly); write overhead {100 * self.overhead:.1f} %, "
                f"expected redone work per failure {_human(self.expected_redo_s)}")

    def to_json(self) -> dict:
        return {"cost_s": self.cost_s, "mtbf_s": self.mtbf_s, "interval_s": self.interval_s,
                "overhead": self.overhead, "expected_redo_s": self.expected_redo_s}


def young_daly(cost_s: float, mtbf_s: float) -> IntervalPlan:
    if not (cost_s >= 0 and mtbf_s > 0 and math.isfinite(cost_s) and math.isfinite(mtbf_s)):
        raise ValueError(f"checkpoint cost {cost_s!r} s and MTBF {mtbf_s!r} s must be finite, cost >= 0, MTBF > 0")
    interval = math.sqrt(2.0 * cost_s * mtbf_s)
    return IntervalPlan(cost_s, mtbf_s, interval, cost_s / interval if interval else 0.0, interval / 2.0)


def saves_per_durable(memory: IntervalPlan, durable: IntervalPlan, memory_spacing_s: float | None = None) -> int:
    """K, with a memory tier: one save in K goes to the durable store (the others to memory only).

    Young/Daly per tier: the memory tier's interval ``sqrt(2 x C_memory x M)`` spaces the saves
    (``memory_spacing_s``: that interval as applied, in whole updates; default the interval itself),
    the durable tier's ``sqrt(2 x C_durable x M_durable)`` the durable ones, so K is their ratio
    rounded half up, at least 1. A memory save costing as much as a durable one gains nothing (a
    durable save also holds the generation in memory): K = 1.
    """
    if memory.cost_s >= durable.cost_s:
        return 1
    spacing = memory.interval_s if memory_spacing_s is None else memory_spacing_s
    if not spacing > 0:  # a memory save measured to cost nothing at all: nothing to space the durable ones by
        return 1
    return max(1, math.floor(durable.interval_s / spacing + 0.5))


def _human(seconds: float) -> str:
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"
