"""Pure planning and coverage: word ranges, not byte counts."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.format.records import RegionDecl
from alpha_ckpt.state.manifest import check_coverage
from alpha_ckpt.generation.planner import Copy, PlanError, Piece, SavedSlice, WantedSlice, pack_shards, plan_restore

REGIONS = [RegionDecl(0, "w", "float32", (10,)), RegionDecl(1, "b", "int8", (4,))]


def test_complete_coverage_passes():
    check_coverage(REGIONS, [(0, 0, 6, "s1"), (0, 6, 10, "s2"), (1, 0, 4, "s1")], "m")


@pytest.mark.parametrize("slices, words", [
    ([(0, 0, 6, "s1"), (0, 7, 10, "s2"), (1, 0, 4, "s1")], "[6, 7)"),        # gap
    ([(0, 0, 6, "s1"), (0, 5, 10, "s2"), (1, 0, 4, "s1")], "saved twice"),  # overlap
    ([(0, 0, 10, "s1")], "'b' words [0, 4)"),                                 # region missing
    ([(0, 0, 10, "s1"), (1, 0, 4, "s1"), (2, 0, 1, "s1")], "ordinal 2"),     # unknown region
    ([(0, 0, 11, "s1"), (1, 0, 4, "s1")], "[0, 11)"),                         # beyond the region
])
def test_incomplete_or_overlapping_coverage_is_refused(slices, words):
    with pytest.raises(Refusal) as info:
        check_coverage(REGIONS, slices, "m")
    assert info.value.code == RefusalCode.COVERAGE and words in info.value.message


def test_byte_counts_that_add_up_do_not_hide_an_overlap():
    # 6 + 4 words add up to 10, but words [4, 6) are saved twice and [8, 10) never.
    with pytest.raises(Refusal):
        check_coverage(REGIONS[:1], [(0, 0, 6, "s1"), (0, 4, 8, "s2")], "m")


def test_plan_joins_splits_and_changed_boundaries():
    saved = [SavedSlice(0, 6, 10, "B", 0), SavedSlice(0, 0, 6, "A", 1)]  # physical order swapped
    wanted = [WantedSlice(0, 0, 3, 0), WantedSlice(0, 3, 8, 1), WantedSlice(0, 8, 10, 2)]
    plan = plan_restore(saved, wanted)
    assert plan.copies == (
        Copy("A", 1, 0, 0, 0, 3),
        Copy("A", 1, 3, 1, 0, 3), Copy("B", 0, 0, 1, 3, 2),  # a join across two saved slices
        Copy("B", 0, 2, 2, 0, 2),
    )
    assert plan.sources == ("A", "B")


def test_plan_refuses_a_word_nobody_saved():
    with pytest.raises(PlanError):
        plan_restore([SavedSlice(0, 0, 5, "A", 0)], [WantedSlice(0, 0, 6, 0)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 100), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=6),
       st.integers(1, 64))
def test_pack_shards_keeps_every_word_once_within_the_cap(regions, cap):
    pieces = [Piece(i, 0, n, size) for i, (_, n, size) in enumerate(regions)]
    if max(p.itemsize for p in pieces) > cap:
        with pytest.raises(ValueError):
            pack_shards(pieces, cap)
        return
    shards = pack_shards(pieces, cap)
    for shard in shards:
        assert sum(p.nbytes for p in shard) <= cap
    covered = {}
    for shard in shards:
        for p in shard:
            covered.setdefault(p.ordinal, []).append((p.lo, p.hi))
    for p in pieces:
        spans = sorted(covered[p.ordinal])
        assert spans[0][0] == 0 and spans[-1][1] == p.hi
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
