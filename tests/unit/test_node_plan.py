"""The deduplicated restore's plan: every object a rank needs is read once on its node, and every rank is served."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpha_ckpt.generation.node_plan import RankReads, plan_node_reads

PROPS = settings(max_examples=300, deadline=None)


def name(i: int) -> str:
    return f"{i:064x}"


@st.composite
def restores(draw):
    """(node of each rank, objects each rank needs): replicated, sharded and per-rank objects mixed."""
    world = draw(st.integers(1, 12))
    node_count = draw(st.integers(1, world))
    nodes = draw(st.lists(st.integers(0, node_count - 1), min_size=world, max_size=world))
    sizes = draw(st.lists(st.integers(0, 1 << 30), min_size=1, max_size=25))
    needs = [draw(st.lists(st.sampled_from(range(len(sizes))), max_size=25)) for _ in range(world)]
    return nodes, [[(name(i), sizes[i]) for i in need] for need in needs]


@PROPS
@given(restores())
def test_every_object_a_rank_needs_is_read_exactly_once_on_its_node_and_every_rank_is_served(restore):
    nodes, needs = restore
    plans = plan_node_reads(nodes, needs)
    read = {}  # (node, object) -> the ranks that read it from the store
    for rank, plan in enumerate(plans):
        for obj, _ in plan.own + plan.for_node:
            read.setdefault((nodes[rank], obj), []).append(rank)
    needed = {(nodes[rank], obj) for rank, need in enumerate(needs) for obj, _ in need}
    assert set(read) == needed and all(len(readers) == 1 for readers in read.values())
    for rank, need in enumerate(needs):
        plan = plans[rank]
        served = {obj for obj, _ in plan.own + plan.for_node} | set(plan.from_node)
        assert served == {obj for obj, _ in need}
        for obj, reader in plan.from_node.items():
            assert reader != rank and nodes[reader] == nodes[rank] and read[(nodes[rank], obj)] == [reader]
        # An object read for the node is one another rank of the node needs; one read alone is nobody else's.
        for obj, _ in plan.for_node:
            assert any(plans[r].from_node.get(obj) == rank for r in range(len(plans)))
        for obj, _ in plan.own:
            assert not any(nodes[r] == nodes[rank] and r != rank and obj in {o for o, _ in needs[r]}
                           for r in range(len(needs)))


@PROPS
@given(st.integers(1, 9), st.lists(st.integers(0, 1 << 30), max_size=40))
def test_a_replicated_state_is_spread_so_no_rank_reads_more_than_its_share_plus_one_object(ranks, sizes):
    objects = [(name(i), size) for i, size in enumerate(sizes)]
    plans = plan_node_reads([0] * ranks, [objects] * ranks)
    loads = [sum(s for _, s in p.own + p.for_node) for p in plans]
    assert sum(loads) == sum(sizes)
    assert max(loads) <= sum(sizes) / ranks + max(sizes, default=0)


def test_a_replicated_state_on_one_node_is_read_once_spread_over_its_ranks():
    objects = [(name(i), 100) for i in range(8)]
    plans = plan_node_reads([0, 0, 0, 0], [objects] * 4)
    assert sorted(len(p.for_node) for p in plans) == [2, 2, 2, 2] and not any(p.own for p in plans)
    assert all(len(p.from_node) == 6 for p in plans)


def test_on_two_nodes_each_node_reads_each_replicated_object_once():
    objects = [(name(i), 100) for i in range(4)]
    plans = plan_node_reads(["a", "a", "b", "b"], [objects] * 4)
    for node_ranks in ([0, 1], [2, 3]):
        read = [o for r in node_ranks for o, _ in plans[r].for_node]
        assert sorted(read) == sorted(o for o, _ in objects)
        assert all(plans[r].from_node.get(o) in node_ranks for r in node_ranks for o in plans[r].from_node)


def test_sharded_and_per_rank_objects_are_read_by_the_ranks_that_own_them():
    plans = plan_node_reads([0, 0], [[(name(1), 10), (name(9), 5)], [(name(2), 10), (name(9), 5)]])
    assert plans[0].own == [(name(1), 10)] and plans[1].own == [(name(2), 10)]
    assert [o for p in plans for o, _ in p.for_node] == [name(9)]


def test_an_object_needed_at_two_sizes_is_a_planning_error():
    with pytest.raises(ValueError):
        plan_node_reads([0, 0], [[(name(1), 10)], [(name(1), 11)]])


def test_a_plan_survives_its_json_form():
    plans = plan_node_reads([0, 0, 1], [[(name(1), 10), (name(2), 3)], [(name(1), 10)], [(name(2), 3)]])
    assert [RankReads.from_json(p.to_json()) for p in plans] == plans
