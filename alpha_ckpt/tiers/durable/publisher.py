"""The one interface of the publishers: :class:`~alpha_ckpt.tiers.durable.star.StarPublisher` and
:class:`~alpha_ckpt.tiers.durable.tree.TreePublisher` turn every rank's :class:`Contribution` to one
save into one generation, and return the same :class:`~alpha_ckpt.tiers.durable.messages.Completion`
on every rank.

Call order, on every rank of the group, once the ranks agreed on the save's layout: build the
rank's contribution, call ``publish`` with it. Every rank writes its own shards durably; the
publisher compares the ranks' replica digests and outcomes (one verdict), writes the manifests
and the ref, and tells every rank the root, or the same failure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from alpha_ckpt.format.records import CapturePrefix, RegionDecl
from alpha_ckpt.generation.planner import Piece
from alpha_ckpt.tiers.durable.messages import Completion, Layout


@dataclass
class Contribution:
    """What one rank brings to one publish."""

    prefix: CapturePrefix
    regions: tuple[RegionDecl, ...]         # the agreed region list
    layout: Layout                          # the agreed layout (skeleton, devices, write mode)
    parts: list[tuple[Piece, memoryview, str]]  # this rank's own words: (piece, bytes, compression)
    metadata: Mapping[str, Any]             # the root manifest's metadata (what rank 0 records)
    replica_digests: Callable[[Mapping[tuple, str]], dict[str, str]]  # given the write's digests: every replica's
    follows: int | None                     # rank 0: the generation this history continues
    group: Any = None                       # the torch.distributed group the ranks talk over
    # given the write's digests: [name, lo, hi, digest] of every shared piece (words other ranks hold too)
    shared_digests: Callable[[Mapping[tuple, str]], list] = lambda written: []
    # rank 0: (generation, root) of the store's generation this history continues, where known (the memory
    # tier records it, so that a memory generation is taken only by a store it descends from)
    ancestor: tuple[int, str] | None = None


class Publisher(Protocol):
    def publish(self, contribution: Contribution) -> Completion:
        """Collective: publish the ranks' contributions as one generation (the same completion on every rank)."""
        ...


def shard_lists(parts: Sequence[tuple[Piece, memoryview, str]]) -> list:
    """This rank's parts as the writer takes them: one shard list, or none."""
    return [list(parts)] if parts else []
