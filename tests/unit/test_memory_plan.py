"""The memory tier's plans: replication leaves every object with its copies, fetches satisfy every need."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpha_ckpt.tiers.memory.plan import (FetchPlan, Transfer, peer_order, plan_fetch, plan_replication, replica_targets,
                                   network_needs, split_by_reach, transfer_windows, under_held)

PROPS = settings(max_examples=200, deadline=None)


def digest(i: int) -> str:
    return f"{i:064x}"


@st.composite
def worlds(draw):
    """(world, stride): strides that divide the world, share a factor with it, or neither."""
    world = draw(st.integers(1, 64))
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    stride = draw(st.sampled_from(divisors) | st.integers(1, 2 * world + 1))
    return world, stride


@st.composite
def held_objects(draw, world: int):
    """Objects (digest, size) and who holds each: no one, one rank, or several."""
    n = draw(st.integers(0, 30))
    objects = [(digest(i), draw(st.integers(0, 1000))) for i in range(n)]
    holders = {d: frozenset(draw(st.sets(st.integers(0, world - 1), max_size=min(world, 4))) |
                            draw(st.sets(st.integers(0, world - 1), max_size=1) | st.just(frozenset())))
               for d, _ in objects}
    return objects, holders


def apply(transfers: list[Transfer], holders: dict[str, frozenset[int]]) -> dict[str, set[int]]:
    after = {d: set(h) for d, h in holders.items()}
    for t in transfers:
        after.setdefault(t.digest, set()).add(t.dst)
    return after


@PROPS
@given(st.data())
def test_replica_targets_are_the_full_count_of_distinct_other_ranks_in_the_stride_order(data):
    world, stride = data.draw(worlds())
    holder = data.draw(st.integers(0, world - 1))
    copies = data.draw(st.integers(1, 4))
    targets = replica_targets(holder, world, copies, stride)
    assert len(targets) == len(set(targets)) == min(copies, world) - 1
    assert holder not in targets and all(0 <= t < world for t in targets)
    order = list(peer_order(holder, world, stride))
    assert sorted(order) == [r for r in range(world) if r != holder]  # every other rank, once
    assert targets == order[:len(targets)]
    first_cycle = [(holder + k * stride) % world for k in range(1, world)]
    cycle = first_cycle[:first_cycle.index(holder)] if holder in first_cycle else first_cycle
    assert order[:len(cycle)] == cycle  # the stride's own cycle first


@PROPS
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 4), st.data())
def test_with_the_node_size_as_stride_the_first_targets_lie_on_distinct_other_nodes(nnodes, nproc, copies, data):
    world = nnodes * nproc
    holder = data.draw(st.integers(0, world - 1))
    targets = replica_targets(holder, world, copies, stride=nproc)
    first = targets[:min(copies, nnodes) - 1]
    nodes = [t // nproc for t in first]
    assert len(set(nodes)) == len(nodes) and holder // nproc not in nodes


@PROPS
@given(st.data())
def test_replication_leaves_every_held_object_with_its_copies_sending_only_from_holders_to_new_ranks(data):
    world, stride = data.draw(worlds())
    copies = data.draw(st.integers(1, 4))
    objects, holders = data.draw(held_objects(world))
    everywhere = frozenset(d for d, _ in objects if data.draw(st.booleans()))
    transfers = plan_replication(objects, holders, world, copies, stride, everywhere)
    assert transfers == plan_replication(list(reversed(objects)), dict(holders), world, copies, stride,
                                         set(everywhere))  # the same plan however the inputs are listed
    sizes = dict(objects)
    seen = set()
    for t in transfers:
        assert t.src in holders[t.digest] and t.src == min(holders[t.digest])
        assert t.dst not in holders[t.digest] and t.dst != t.src and 0 <= t.dst < world
        assert t.size == sizes[t.digest]
        assert (t.digest, t.dst) not in seen
        seen.add((t.digest, t.dst))
    after = apply(transfers, holders)
    for d, _ in objects:
        if not holders[d]:
            assert after[d] == set()  # no holder, no copy: the caller counts it missing
            continue
        wanted = world if d in everywhere else min(copies, world)
        assert len(after[d]) == max(wanted, len(holders[d]))
    assert under_held([d for d, _ in objects], after, min(copies, world)) == \
        sorted(d for d, _ in objects if not holders[d])


@PROPS
@given(st.data())
def test_a_lone_holders_new_copies_go_to_its_replica_targets(data):
    world, stride = data.draw(worlds())
    copies = data.draw(st.integers(1, 4))
    writer = data.draw(st.integers(0, world - 1))
    transfers = plan_replication([(digest(1), 10)], {digest(1): frozenset({writer})}, world, copies, stride)
    assert [t.dst for t in transfers] == replica_targets(writer, world, copies, stride)


@st.composite
def fetch_cases(draw):
    world = draw(st.integers(1, 16))
    n = draw(st.integers(0, 20))
    sizes = {digest(i): draw(st.integers(0, 1000)) for i in range(n)}
    holders = {d: frozenset(draw(st.sets(st.integers(0, world - 1), max_size=4))) for d in sizes}
    unknown = [digest(1000 + i) for i in range(draw(st.integers(0, 3)))]  # needed, never listed anywhere
    names = list(sizes) + unknown
    needs = {r: frozenset(draw(st.sets(st.sampled_from(names), max_size=10)) if names else frozenset())
             for r in draw(st.sets(st.integers(0, world - 1)))}
    return sizes, holders, needs


def sent_by(transfers: list[Transfer]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in transfers:
        out[t.src] = out.get(t.src, 0) + t.size
    return out


@PROPS
@given(fetch_cases())
def test_a_fetch_satisfies_every_need_once_from_a_holder_or_names_exactly_the_unheld_objects(case):
    sizes, holders, needs = case
    plan = plan_fetch(sizes, holders, needs)
    assert plan == plan_fetch(dict(sizes), dict(holders), {r: set(n) for r, n in reversed(needs.items())})
    pulled = [(t.dst, t.digest) for t in plan.transfers]
    assert len(pulled) == len(set(pulled))
    assert set(pulled) == {(r, d) for r, ds in needs.items() for d in ds if holders.get(d) and r not in holders[d]}
    for t in plan.transfers:
        assert t.src in holders[t.digest] and t.size == sizes[t.digest]
    assert plan.missing == sorted({d for ds in needs.values() for d in ds if not holders.get(d)})


@PROPS
@given(fetch_cases())
def test_each_fetch_goes_to_the_holder_that_had_sent_the_least_so_far(case):
    sizes, holders, needs = case
    sent: dict[int, int] = {}
    for t in plan_fetch(sizes, holders, needs).transfers:
        assert all((sent.get(t.src, 0), t.src) <= (sent.get(h, 0), h) for h in holders[t.digest])
        sent[t.src] = sent.get(t.src, 0) + t.size


@PROPS
@given(st.integers(1, 8), st.lists(st.integers(0, 1000), max_size=30), st.integers(1, 8))
def test_objects_all_held_by_the_same_ranks_load_no_holder_past_its_fair_share_and_one_object(
        nholders, object_sizes, nranks):
    # The greedy rule's bound: the busiest holder was the least loaded when it took its last object.
    sizes = {digest(i): s for i, s in enumerate(object_sizes)}
    source = frozenset(range(nholders))
    needs = {nholders + r: frozenset(sizes) for r in range(nranks)}
    plan = plan_fetch(sizes, {d: source for d in sizes}, needs)
    total = sum(t.size for t in plan.transfers)
    assert max(sent_by(plan.transfers).values(), default=0) <= total / nholders + max(object_sizes, default=0)


@PROPS
@given(st.lists(st.integers(0, 5), max_size=20), st.integers(0, 4))
def test_under_held_names_exactly_the_objects_with_too_few_holders(counts, minimum):
    holders = {digest(i): frozenset(range(c)) for i, c in enumerate(counts)}
    objects = list(holders) + [digest(999)]  # one no one holds
    assert under_held(reversed(objects), holders, minimum) == sorted(
        [d for d, c in zip(holders, counts) if c < minimum] + ([digest(999)] if minimum > 0 else []))


@PROPS
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 100)), max_size=30),
       st.integers(0, 300))
def test_windows_cover_the_transfers_in_order_each_as_long_as_the_budget_allows(rows, budget):
    transfers = [Transfer(digest(i), size, src, dst) for i, (src, dst, size) in enumerate(rows) if src != dst]
    windows = transfer_windows(transfers, budget)
    assert [i for a, b in windows for i in range(a, b)] == list(range(len(transfers)))

    def loads(ts):
        load: dict[int, list[int]] = {}
        for t in ts:
            load.setdefault(t.src, []).append(t.size)
            load.setdefault(t.dst, []).append(t.size)
        return load

    for a, b in windows:
        assert b > a
        for sizes in loads(transfers[a:b]).values():
            assert sum(sizes) <= budget or len(sizes) == 1  # past the budget only by one transfer alone
        if b < len(transfers):  # the next transfer would have put a rank past the budget
            assert any(sum(sizes) > budget for sizes in loads(transfers[a:b + 1]).values())


def test_one_rank_needs_no_transfer():
    objects = [(digest(1), 5), (digest(2), 7)]
    holders = {digest(1): frozenset({0}), digest(2): frozenset({0})}
    assert replica_targets(0, 1, 3) == []
    assert plan_replication(objects, holders, 1, 3, everywhere={digest(2)}) == []


def test_more_copies_than_ranks_put_a_copy_on_every_rank():
    assert replica_targets(1, 3, copies=4) == [2, 0]
    transfers = plan_replication([(digest(1), 9)], {digest(1): frozenset({1})}, world=3, copies=4)
    assert transfers == [Transfer(digest(1), 9, 1, 2), Transfer(digest(1), 9, 1, 0)]


def test_a_stride_that_shares_a_factor_with_the_world_continues_from_the_next_rank():
    assert replica_targets(0, 6, copies=6, stride=4) == [4, 2, 5, 3, 1]
    assert replica_targets(1, 8, copies=4, stride=4) == [5, 6, 2]  # two nodes of 4: the other node first


def test_an_object_no_rank_holds_is_left_to_the_caller():
    assert plan_replication([(digest(1), 9)], {}, world=4, copies=2) == []
    assert plan_fetch({}, {}, {0: {digest(1)}}) == FetchPlan([], [digest(1)])


def test_a_rank_that_holds_what_it_needs_pulls_nothing():
    assert plan_fetch({digest(1): 3}, {digest(1): frozenset({0, 1})}, {0: {digest(1)}}) == FetchPlan([], [])


def test_fetches_spread_over_the_holders():
    sizes = {digest(i): 10 for i in range(4)}
    plan = plan_fetch(sizes, {d: frozenset({0, 1}) for d in sizes}, {2: set(sizes)})
    assert [t.src for t in plan.transfers] == [0, 1, 0, 1]


@pytest.mark.parametrize("bad", [dict(world=0, copies=1), dict(world=2, copies=0), dict(world=2, copies=1, stride=0)])
def test_a_world_copies_or_stride_below_one_is_refused(bad):
    with pytest.raises(ValueError):
        replica_targets(0, bad["world"], bad["copies"], bad.get("stride", 1))


def test_a_holder_outside_the_world_is_refused():
    with pytest.raises(ValueError):
        plan_replication([(digest(1), 9)], {digest(1): frozenset({4})}, world=4, copies=2)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)).filter(lambda p: p[0] != p[1]), max_size=12),
       st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3))))
def test_transfers_split_by_reach_partition_the_plan_in_order(pairs, readable):
    transfers = [Transfer(f"{i:064x}", i, src, dst) for i, (src, dst) in enumerate(pairs)]
    through_files, over_network = split_by_reach(transfers, readable)
    assert all((t.dst, t.src) in readable for t in through_files)
    assert all((t.dst, t.src) not in readable for t in over_network)
    assert sorted(through_files + over_network, key=lambda t: t.size) == transfers  # each once, order kept
    assert through_files == [t for t in transfers if t in through_files]


@given(st.dictionaries(st.integers(0, 3), st.sets(st.sampled_from("abcde"))),
       st.dictionaries(st.sampled_from("abcde"), st.sets(st.integers(0, 3))),
       st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3))))
def test_a_rank_pulls_over_the_network_exactly_what_neither_it_nor_a_holder_it_reads_holds(needs, holders, readable):
    far = network_needs(needs, holders, readable)
    for rank, wanted in needs.items():
        for digest in wanted:
            in_reach = any(h == rank or (rank, h) in readable for h in holders.get(digest, ()))
            assert (digest in far[rank]) == (not in_reach)
        assert far[rank] <= wanted
