"""The durable tier: generations in the store, published by the star or the tree (see :mod:`alpha_ckpt.tiers.seam`)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from alpha_ckpt.errors import Refusal
from alpha_ckpt.store import Store
from alpha_ckpt.tiers.durable.choice import Choice
from alpha_ckpt.tiers.durable.messages import Candidate, Candidates, Completion
from alpha_ckpt.tiers.durable.publisher import Contribution, Publisher
from alpha_ckpt.tiers.durable.wire import broadcast_json, global_rank
from alpha_ckpt.tiers.seam import DURABLE, Reading


class DurableTier:
    """``store``'s generations, published by ``publisher``; ``group``: the ranks' group. Rank 0's
    :attr:`follows`: the generation a save then continues, once a restore chose (see :class:`Choice`)."""

    name = DURABLE

    def __init__(self, store: Store, publisher: Publisher, rank: int, group: Any, save_timeout: float | None = None):
        self.store, self.publisher, self.rank, self.group = store, publisher, rank, group
        self.save_timeout = save_timeout
        self.follows: int | None = None

    def publish(self, contribution: Contribution) -> Completion:
        with self.store.deadline(self.save_timeout):  # the writes of this save end by then, or fail
            return self.publisher.publish(contribution)

    @property
    def phases(self) -> dict[str, float]:
        return dict(self.publisher.phases)

    def newest(self, run: str, step: str, root: Any, branch: bool) -> list[Candidate]:
        """Rank 0 decides what to try, in order (a refusal of the choice itself is a candidate that stops
        the restore); every rank gets the same list."""
        out = None
        if self.rank == 0:
            choice = Choice(self.store, run, step)
            try:
                out = Candidates.of(choice.candidates(root, branch))
            except Refusal as refusal:
                out = Candidates.of([Candidate.refused(refusal, binding=True)])
            finally:
                self.follows = choice.follows
        return Candidates.from_json(broadcast_json(out.to_json() if out else None, global_rank(0, self.group),
                                                   self.group)).candidates()

    @contextlib.contextmanager
    def reader(self, candidate: Candidate, wanted: Callable[[Any], set[str]]) -> Iterator[Reading]:
        yield Reading(self.store)  # every rank reads the store itself
