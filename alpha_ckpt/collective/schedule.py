"""Which updates a script checkpoints, and to which tier: every K, or Young/Daly's intervals from what the run measures.

``every=K``: updates K, 2K, 3K, ... ``every="auto"`` with ``mtbf``: the
interval is ``sqrt(2 x C x M)`` (:mod:`alpha_ckpt.runtime.interval`) turned into a
number of updates from the measured seconds per update, where C is what a
checkpoint costs the training (sync: the whole save; async: the stall),
the mean of the last three measured, or ``checkpoint_cost`` until one is.
Without ``checkpoint_cost`` the first update is a checkpoint, to measure C.
Rank 0 plans and every rank applies the same number, so the ranks never
disagree about which update is a checkpoint: between plans ``due`` is local
and deterministic.

With the memory tier each save goes to one of two tiers: ``"memory"`` (host
memory replicated to peers: cheap, survives a rank's loss) or ``"durable"``
(the store, also held in memory). One save in ``durable_every`` (K) is
durable: the first save, then the K-th save after each durable one (saves 1,
K+1, 2K+1, ... while K holds), so ``n`` saves hold ``ceil(n / K)`` durable ones
and a job has a durable generation from its first save on. Every rank counts
the same saves (a save is collective), so every rank names the same tier.
``every="auto"`` plans both: the updates between saves from the memory tier's
interval ``sqrt(2 x C_memory x mtbf)``, and K from the durable tier's
``sqrt(2 x C_durable x mtbf_durable)`` (:func:`alpha_ckpt.runtime.interval.saves_per_durable`).
"""
from __future__ import annotations

import math
import statistics
import time

from alpha_ckpt.runtime import options as options_core
from alpha_ckpt.runtime.interval import IntervalPlan, parse_duration, saves_per_durable, young_daly
from alpha_ckpt.tiers.durable.messages import Interval
from alpha_ckpt.tiers.seam import DURABLE, MEMORY

TIERS = (MEMORY, DURABLE)
# With the memory tier and a fixed schedule: one save in five is durable. A whole-job or node loss then
# redoes at most five save intervals of work, while the store's write is paid once every five saves; it is
# the K that Young/Daly gives under the default mtbf_durable when a durable save costs two and a half
# memory saves (K = sqrt(10 x C_durable / C_memory)).
DEFAULT_DURABLE_EVERY = 5
# every="auto" with the memory tier, without mtbf_durable: the failures the memory tier does not survive
# (a node's or the whole job's loss) are taken to come ten times more rarely than those it does.
MTBF_DURABLE_FACTOR = 10.0
_PROVISIONAL_DURABLE_EVERY = 2  # planned before a memory save was measured: the next save measures one


def _seconds(value: float | str, what: str) -> float:
    seconds = parse_duration(value) if isinstance(value, str) else float(value)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{what} must be a positive number of seconds, not {value!r}")
    return seconds


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} is a number >= 1, not {value!r}")
    return value


def save_tier(index: int, durable_every: int) -> str:
    """The tier of the ``index``-th save (1-based) under a fixed K: durable on saves 1, K+1, 2K+1, ..."""
    _count(index, "a save's index")
    return DURABLE if (index - 1) % _count(durable_every, "durable_every") == 0 else MEMORY


class Schedule:
    def __init__(self, every: int | str | None, mtbf: float | str | None = None,
                 checkpoint_cost: float | str | None = None, *, memory: bool = False,
                 durable_every: int | None = None, mtbf_durable: float | str | None = None):
        # The rules are the options' (alpha_ckpt.runtime.options): a UsageError, which is a ValueError.
        values = options_core.check({"every": every, "mtbf": mtbf, "checkpoint_cost": checkpoint_cost,
                                     "memory": True if memory else None, "durable_every": durable_every,
                                     "mtbf_durable": mtbf_durable})
        every, durable_every = values["every"], values["durable_every"]
        self.auto = every == "auto"
        if self.auto:
            self.mtbf_s = _seconds(mtbf, "mtbf")
            self.assumed_cost_s = None if checkpoint_cost is None else _seconds(checkpoint_cost, "checkpoint_cost")
        self.every = None if self.auto else every
        self.memory = bool(memory)
        # every="auto" plans K unless durable_every fixes it.
        self.plans_durable = self.memory and self.auto and durable_every is None
        self.mtbf_durable_s = (None if not self.plans_durable else
                               MTBF_DURABLE_FACTOR * self.mtbf_s if mtbf_durable is None else
                               _seconds(mtbf_durable, "mtbf_durable"))
        self.durable_every = (1 if not self.memory else durable_every if durable_every is not None else
                              _PROVISIONAL_DURABLE_EVERY if self.plans_durable else DEFAULT_DURABLE_EVERY)
        self.next_due: int | None = None   # auto: the update of the next checkpoint, once planned
        self.costs: dict[str, list[float]] = {tier: [] for tier in TIERS}  # training seconds each save cost
        self.update_seconds: list[float] = []
        self.plan: IntervalPlan | None = None          # the interval that spaces the saves (memory's, with the tier)
        self.durable_plan: IntervalPlan | None = None  # with the tier and K planned: the durable tier's
        self.planned: dict | None = None  # the last plan: intervals, cost sources, seconds per update, updates, K
        self.plans = 0                     # plans made so far (a caller reports each new one)
        self.measuring = False             # the checkpoint that measures C was asked for
        self.saves = 0                     # saves recorded (skipped ones are not)
        self.memory_since_durable: int | None = None  # memory saves since the last durable one; None: none yet
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

    def next_tier(self) -> str:
        """The tier the next save goes to (the same on every rank): ``"durable"`` or ``"memory"``."""
        if not self.memory or self.memory_since_durable is None:
            return DURABLE
        return DURABLE if self.memory_since_durable + 1 >= self.durable_every else MEMORY

    def saved(self, cost_s: float | None = None, tier: str = DURABLE) -> None:
        """A save to ``tier`` just returned (``cost_s``: what it cost the training; None: the save was
        skipped on every rank, nothing is counted); the next update's time starts now."""
        if tier not in TIERS or (tier == MEMORY and not self.memory):
            raise ValueError(f"a save's tier is {' or '.join(TIERS) if self.memory else DURABLE!r}, not {tier!r}")
        if cost_s is not None:
            self.costs[tier].append(cost_s)
            self.saves += 1
            if tier == DURABLE:
                self.memory_since_durable = 0
            elif self.memory_since_durable is not None:
                self.memory_since_durable += 1
        self._last_tick = time.monotonic()

    def restored(self) -> None:
        """Every rank, after a restore: what decides ``due`` and the tier starts again as in a new process
        (the next save is durable, every="auto" measures and plans again), so a rank that is a new process
        and ranks that kept theirs agree. The costs measured so far are kept."""
        self.next_due, self.measuring, self.memory_since_durable = None, False, None
        self.update_seconds, self._last_tick = [], None
        if self.plans_durable:
            self.durable_every = _PROVISIONAL_DURABLE_EVERY

    def _cost(self, tier: str) -> tuple[float | None, str]:
        measured = self.costs[tier][-3:]
        if measured:
            return statistics.fmean(measured), "measured"
        if tier == DURABLE:
            return self.assumed_cost_s, "assumed"
        # No memory save measured yet: a durable save also holds the generation in memory, so its cost bounds one.
        durable, _ = self._cost(DURABLE)
        return durable, DURABLE

    def decide(self, update: int, floor_s: float = 0.0) -> int | None:
        """Rank 0: the number of updates to the next checkpoint, or None while no cost is known.
        With the memory tier and K planned, ``durable_every`` is the K planned with it (:meth:`decision`)."""
        update_s = statistics.median(self.update_seconds[-20:]) if self.update_seconds else 0.0
        if not self.memory:
            cost, source = self._cost(DURABLE)
            if cost is None:
                return None
            self.plan = young_daly(cost, self.mtbf_s)
            every = self.plan.every_updates(update_s, floor_s)
            self.planned = {**self.plan.to_json(), "cost_source": source, "update_s": update_s,
                            "every_updates": every, "update": update, "tier": DURABLE}
            return every
        memory_cost, memory_source = self._cost(MEMORY)
        durable_cost, durable_source = self._cost(DURABLE)
        if memory_cost is None:
            return None
        self.plan = young_daly(memory_cost, self.mtbf_s)
        every = self.plan.every_updates(update_s, floor_s)
        planned = {**self.plan.to_json(), "cost_source": memory_source, "update_s": update_s,
                   "every_updates": every, "update": update, "tier": MEMORY}
        if self.plans_durable and durable_cost is not None:
            self.durable_plan = young_daly(durable_cost, self.mtbf_durable_s)
            if memory_source == DURABLE:
                self.durable_every = _PROVISIONAL_DURABLE_EVERY  # the next save measures a memory save
            else:  # the memory saves' spacing as applied: whole updates, at least one save long
                spacing = every * update_s if update_s > 0 else self.plan.interval_s
                self.durable_every = saves_per_durable(self.plan, self.durable_plan, spacing)
            planned.update({"durable_cost_s": durable_cost, "durable_mtbf_s": self.mtbf_durable_s,
                            "durable_interval_s": self.durable_plan.interval_s,
                            "durable_cost_source": durable_source})
        planned["durable_every"] = self.durable_every
        self.planned = planned
        return every

    def decision(self, update: int, floor_s: float = 0.0) -> Interval:
        """Rank 0: :meth:`decide` as the record every rank applies (:meth:`apply_interval`)."""
        every = self.decide(update, floor_s)
        return Interval(every, self.durable_every if self.memory and every is not None else None)

    def apply(self, update: int, every: int, durable_every: int | None = None) -> None:
        """Every rank: the plan rank 0 decided at ``update`` (``durable_every``: its K, with the memory tier)."""
        self.next_due = update + every
        if durable_every is not None:
            if not self.memory:
                raise ValueError("a plan of durable_every reached a schedule without the memory tier")
            self.durable_every = _count(durable_every, "durable_every")
        self.plans += 1

    def apply_interval(self, update: int, interval: Interval) -> None:
        """Every rank: rank 0's :meth:`decision` as received; nothing while it planned nothing."""
        if interval.every is not None:
            self.apply(update, interval.every, interval.durable_every)

    def describe(self) -> str:
        """The last plan in one line, both tiers with the memory tier."""
        if self.plan is None:
            return "no checkpoint interval planned yet"
        text = self.plan.describe()
        if not self.memory:
            return text
        text = f"memory saves: {text}; one save in {self.durable_every} durable"
        if self.durable_plan is not None:
            text += f" (durable tier: {self.durable_plan.describe()})"
        return text


def save_event_fields(run: str, step: str, update: int, root: str, tier: str, seconds: float) -> dict:
    """The fields of the ``checkpoint_saved`` event (docs/EVENTS.md) of one Checkpointer save."""
    if tier not in TIERS:
        raise ValueError(f"a save's tier is memory or durable, not {tier!r}")
    return {"run": run, "step": step, "update": update, "root": root, "tier": tier, "seconds": round(seconds, 6)}
