"""The seam every tier keeps: where a save's generation goes and where a restore finds one.

A tier is a place generations live: the durable store (:class:`alpha_ckpt.tiers.durable.tier.DurableTier`)
and host memory on this rank and its peers (:class:`alpha_ckpt.tiers.memory.tier.MemoryTier`). The
Checkpointer knows no tier by its insides; it walks them:

- ``save``: ``tier.publish(contribution)`` for each tier the schedule names, fastest first (the
  memory tier, then the store); every rank gets the same :class:`Completion`.
- ``restore``: ``tier.newest(run, step, root, branch)`` from each tier (the same candidates on every
  rank), walked newest first by their counters (:func:`walk_order`), each through one agreement loop:
  ``with tier.reader(candidate, wanted) as reading:`` brings what this rank's restore reads within reach
  (None: it cannot, on every rank alike, and the walk goes on), then the one validator and one verdict.

An object store or a node's peers add a tier (or a backend under the store), not a branch in the
Checkpointer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol, Sequence

from alpha_ckpt.store import Store
from alpha_ckpt.tiers.durable.messages import Candidate, Completion
from alpha_ckpt.tiers.durable.publisher import Contribution

DURABLE = "durable"
MEMORY = "memory"


@dataclass
class Reading:
    """What a restore of one candidate reads from: ``store``, and what bringing it within reach cost."""

    store: Store
    bytes_from_peers: int = 0
    seconds: float = 0.0


class Tier(Protocol):
    name: str  # DURABLE or MEMORY: what a save's result and a restore's event name it by
    phases: dict[str, float]  # this rank's seconds in each phase of the last publish (write, commit, ...)

    def publish(self, contribution: Contribution) -> Completion:
        """Collective: the ranks' contributions as one generation of this tier (the same completion on every rank)."""

    def newest(self, run: str, step: str, root: Any, branch: bool) -> list[Candidate]:
        """Collective: the generations of this tier a restore of ``root`` ("latest", a digest, None) tries,
        newest first; the same list on every rank (a refusal that stops the restore is a candidate too)."""

    def reader(self, candidate: Candidate, wanted: Callable[[Any], set[str]]) -> ContextManager[Reading | None]:
        """Collective: what a restore of ``candidate`` reads, once every rank has within reach what
        ``wanted(root manifest)`` names; None on every rank where that cannot be."""


def walk_order(per_tier: Sequence[list[Candidate]]) -> list[Candidate]:
    """The candidates of several tiers (given fastest tier first), newest first. Each tier's own order is
    kept; a later tier's candidate goes before an earlier tier's that is older by (epoch, update) or whose
    counters are unknown, and after it otherwise (on a tie the faster tier's goes first); one whose own
    counters are unknown (a refusal, a digest asked for by name) goes last. Pure."""
    walk: list[Candidate] = []
    for candidates in per_tier:
        for candidate in candidates:
            key = (candidate.epoch, candidate.update)
            at = len(walk)
            if None not in key:
                for i, earlier in enumerate(walk):
                    if earlier.tier != candidate.tier and (None in (earlier.epoch, earlier.update)
                                                           or (earlier.epoch, earlier.update) < key):
                        at = i
                        break
            walk.insert(at, candidate)
    return walk
