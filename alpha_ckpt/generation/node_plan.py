"""Who reads which object of a restore (pure): each object once per node, by one of the ranks that need it.

A rank that alone on its node needs an object reads it for itself, as every rank did before
(sharded and per-rank objects: their owners). An object that several ranks of one node need
(replicated state) is read from the store by one of them into the node's memory, and the
others map it there: the store serves it once per node. The reader is the one of those ranks
with the fewest bytes to read so far, the largest objects placed first, so no rank reads much
more than its share.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence


@dataclass
class RankReads:
    """What one rank reads: ``own`` objects from the store for itself alone, ``for_node`` objects from the
    store into its node's memory (it uses them too), and ``from_node`` objects (name -> the rank of its
    node that reads each) that it maps from its node's memory. Each object as (name, size)."""
    own: list[tuple[str, int]] = field(default_factory=list)
    for_node: list[tuple[str, int]] = field(default_factory=list)
    from_node: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"own": [list(o) for o in self.own], "for_node": [list(o) for o in self.for_node],
                "from_node": [[name, rank] for name, rank in sorted(self.from_node.items())]}

    @classmethod
    def from_json(cls, data: dict) -> "RankReads":
        return cls([(str(n), int(s)) for n, s in data["own"]], [(str(n), int(s)) for n, s in data["for_node"]],
                   {str(n): int(r) for n, r in data["from_node"]})


def plan_node_reads(nodes: Sequence[Hashable], needs: Sequence[Sequence[tuple[str, int]]]) -> list[RankReads]:
    """Rank r (``nodes[r]`` its node, ``needs[r]`` the (name, size) objects it opens) -> what it reads.

    Every object a rank needs is read exactly once on its node: by the rank itself (``own`` or
    ``for_node``) or by another rank of its node (``from_node``), which reads it ``for_node``.
    """
    if len(nodes) != len(needs):
        raise ValueError(f"{len(nodes)} node keys for {len(needs)} ranks")
    plans = [RankReads() for _ in needs]
    load = [0] * len(needs)  # bytes each rank reads from the store so far
    wanting: dict[tuple[Hashable, str], list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, objects in enumerate(needs):
        for name, size in dict.fromkeys((str(n), int(s)) for n, s in objects):
            if sizes.setdefault(name, size) != size:
                raise ValueError(f"object {name} is needed at sizes {sizes[name]} and {size}")
            wanting.setdefault((nodes[rank], name), []).append(rank)
    for (_, name), ranks in wanting.items():
        if len(ranks) == 1:
            plans[ranks[0]].own.append((name, sizes[name]))
            load[ranks[0]] += sizes[name]
    # Shared objects, largest first, each to the least loaded of the ranks that need it (lowest rank on ties).
    shared = sorted(((key, ranks) for key, ranks in wanting.items() if len(ranks) > 1),
                    key=lambda item: (-sizes[item[0][1]], item[0][1], min(item[1])))
    for (_, name), ranks in shared:
        reader = min(ranks, key=lambda r: (load[r], r))
        load[reader] += sizes[name]
        plans[reader].for_node.append((name, sizes[name]))
        for rank in ranks:
            if rank != reader:
                plans[rank].from_node[name] = reader
    return plans
