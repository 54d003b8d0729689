"""Which updates a script checkpoints: every K, or Young/Daly's interval from what the run measures.

``every=K``: updates K, 2K, 3K, ... ``every="auto"`` with ``mtbf``: the
interval is ``sqrt(2 x C x M)`` (:mod:`alpha_ckpt.interval`) turned into a
number of updates from the measured seconds per update, where C is what a
checkpoint costs the training (sync: the whole save; async: the stall),
the mean of the last three measured, or ``checkpoint_cost`` until one is.
Without ``checkpoint_cost`` the first update is a checkpoint, to measure C.
Rank 0 plans and every rank applies the same number, so the ranks never
disagree about which update is a checkpoint: between plans ``due`` is local
and deterministic.
"""
from __future__ import annotations

import math
import statistics
import time

from ..interval import IntervalPlan, parse_duration, young_daly


def _seconds(value: float | str, what: str) -> float:
    seconds = parse_duration(value) if isinstance(value, str) else float(value)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{what} must be a positive number of seconds, not {value!r}")
    return seconds


class Schedule:
    def __init__(self, every: int | str | None, mtbf: float | str | None = None,
                 checkpoint_cost: float | str | None = None):
        self.auto = every == "auto"
        if self.auto:
            if mtbf is None:
                raise ValueError('every="auto" needs mtbf= (the mean time between failures: seconds, or "6h")')
            self.mtbf_s = _seconds(mtbf, "mtbf")
            self.assumed_cost_s = None if checkpoint_cost is None else _seconds(checkpoint_cost, "checkpoint_cost")
        elif every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f'every is a number of updates >= 1 or "auto", not {every!r}')
        elif mtbf is not None or checkpoint_cost is not None:
            raise ValueError('mtbf and checkpoint_cost go with every="auto"')
        self.every = None if self.auto else every
        self.next_due: int | None = None   # auto: the update of the next checkpoint, once planned
        self.costs: list[float] = []       # training seconds each checkpoint cost
        self.update_seconds: list[float] = []
        self.plan: IntervalPlan | None = None
        self.planned: dict | None = None  # the last plan: interval, cost source, seconds per update, updates
        self.plans = 0                     # plans made so far (a caller reports each new one)
        self.measuring = False             # the checkpoint that measures C was asked for
        self._last_tick: float | None = None

    def due(self, update: int) -> bool:
        """Whether ``update`` is a checkpoint (every rank gets the same answer). Also times the updates."""
        now = time.monotonic()
        if self._last_tick is not None:
            self.update_seconds.append(now - self._last_tick)
        self._last_tick = now
        if self.every is None and not self.auto:
            raise ValueError('this Checkpointer has no schedule: pass every=K or every="auto" with mtbf=')
        if not self.auto:
            return update % self.every == 0
        if self.next_due is None:
            if self.assumed_cost_s is None and not self.measuring:
                self.measuring = True
                return True  # the first checkpoint measures what one costs
            return False     # waiting for a plan
        return update >= self.next_due

    def needs_plan(self) -> bool:
        return self.auto and self.next_due is None

    def saved(self, cost_s: float | None = None) -> None:
        """A save just returned (``cost_s``: what it cost the training); the next update's time starts now."""
        if cost_s is not None:
            self.costs.append(cost_s)
        self._last_tick = time.monotonic()

    def decide(self, update: int, floor_s: float = 0.0) -> int | None:
        """Rank 0: the number of updates to the next checkpoint, or None while no cost is known."""
        measured = self.costs[-3:]
        cost = statistics.fmean(measured) if measured else self.assumed_cost_s
        if cost is None:
            return None
        self.plan = young_daly(cost, self.mtbf_s)
        update_s = statistics.median(self.update_seconds[-20:]) if self.update_seconds else 0.0
        every = self.plan.every_updates(update_s, floor_s)
        self.planned = {**self.plan.to_json(), "cost_source": "measured" if measured else "assumed",
                        "update_s": update_s, "every_updates": every, "update": update}
        return every

    def apply(self, update: int, every: int) -> None:
        """Every rank: the plan rank 0 decided at ``update``."""
        self.next_due = update + every
        self.plans += 1
