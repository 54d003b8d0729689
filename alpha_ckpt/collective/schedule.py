"""Which updates a script checkpoints: every K, or Young/Daly's interval from what the run measures.

``every=K``: updates K, 2K, 3K, ... ``every="auto"`` with ``mtbf``: the first
due update measures the checkpoint's cost C (sync: the whole save; async:
the training stall), then ``sqrt(2 x C x M)`` (:mod:`alpha_ckpt.interval`)
is turned into a number of updates from the measured seconds per update.
Rank 0 plans and every rank applies the same number, so the ranks never
disagree about which update is a checkpoint: ``due`` itself is local and
deterministic between plans.
"""
from __future__ import annotations

import math
import statistics
import time

from ..interval import IntervalPlan, parse_duration, young_daly


class Schedule:
    def __init__(self, every: int | str | None, mtbf: float | str | None = None):
        self.auto = every == "auto"
        if self.auto:
            if mtbf is None:
                raise ValueError('every="auto" needs mtbf= (the mean time between failures: seconds, or "6h")')
            self.mtbf_s = parse_duration(mtbf) if isinstance(mtbf, str) else float(mtbf)
            if not (self.mtbf_s > 0 and math.isfinite(self.mtbf_s)):
                raise ValueError(f"mtbf must be a positive number of seconds, not {mtbf!r}")
        elif every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f'every is a number of updates >= 1 or "auto", not {every!r}')
        elif mtbf is not None:
            raise ValueError('mtbf goes with every="auto"')
        self.every = None if self.auto else every
        self.next_due: int | None = None   # auto: the update of the next checkpoint, once planned
        self.plan: IntervalPlan | None = None
        self.update_seconds: list[float] = []
        self._last_tick: float | None = None

    def due(self, update: int) -> bool:
        """Whether ``update`` is a checkpoint (every rank gets the same answer). Also times the updates."""
        now = time.monotonic()
        if self._last_tick is not None:
            self.update_seconds.append(now - self._last_tick)
        self._last_tick = now
        if self.every is None and not self.auto:
            raise ValueError("this Checkpointer has no schedule: pass every=K or every=\"auto\" with mtbf=")
        if not self.auto:
            return update % self.every == 0
        if self.next_due is None:
            return True  # the first checkpoint measures what one costs
        return update >= self.next_due

    def saved(self) -> None:
        """A save just returned: the next update's time starts now (a save is not an update)."""
        self._last_tick = time.monotonic()

    def every_updates(self, cost_s: float, floor_s: float = 0.0) -> int:
        """Rank 0: the number of updates to the next checkpoint, from the cost just measured."""
        self.plan = young_daly(cost_s, self.mtbf_s)
        update_s = statistics.median(self.update_seconds[-20:]) if self.update_seconds else 0.0
        return self.plan.every_updates(update_s, floor_s)
