"""Two tiers: which save goes to memory and which to the durable store, every="auto" planning both intervals
(Young/Daly per tier), the options that set them, and the record that carries the plan to every rank."""
import io
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from alpha_ckpt import CheckpointerOptions, Refusal, RefusalCode, UsageError
from alpha_ckpt.collective.schedule import DEFAULT_DURABLE_EVERY, Schedule, save_event_fields, save_tier
from alpha_ckpt.tiers.seam import DURABLE, MEMORY
from alpha_ckpt.runtime.interval import saves_per_durable, young_daly
from alpha_ckpt.runtime.progress import emit
from alpha_ckpt.tiers.durable import messages
from alpha_ckpt.tiers.durable.messages import Interval


def tiers_of(schedule: Schedule, saves: int) -> list[str]:
    """The tier of each of ``saves`` saves, recorded as a Checkpointer records them."""
    out = []
    for _ in range(saves):
        tier = schedule.next_tier()
        schedule.saved(0.1, tier)
        out.append(tier)
    return out


@settings(max_examples=200, deadline=None)
@given(durable_every=st.integers(1, 40), saves=st.integers(0, 300))
def test_a_fixed_k_makes_the_first_save_and_one_in_every_k_durable_the_same_on_every_run(durable_every, saves):
    sequence = tiers_of(Schedule(1, memory=True, durable_every=durable_every), saves)
    assert sequence == tiers_of(Schedule(1, memory=True, durable_every=durable_every), saves)  # every rank alike
    assert sequence == [save_tier(n, durable_every) for n in range(1, saves + 1)]
    assert sequence.count(DURABLE) == math.ceil(saves / durable_every)
    assert saves == 0 or sequence[0] == DURABLE
    for start in range(0, max(0, saves - durable_every + 1)):  # any K consecutive saves hold exactly one durable
        assert sequence[start:start + durable_every].count(DURABLE) == 1


def test_without_the_memory_tier_every_save_is_durable_and_a_memory_save_is_refused():
    schedule = Schedule(2)
    assert tiers_of(schedule, 7) == [DURABLE] * 7 and schedule.durable_every == 1
    with pytest.raises(ValueError):
        schedule.saved(0.1, MEMORY)


def test_a_fixed_schedule_with_the_memory_tier_makes_one_save_in_the_default_k_durable():
    assert tiers_of(Schedule(3, memory=True), 11) == [save_tier(n, DEFAULT_DURABLE_EVERY) for n in range(1, 12)]
    assert tiers_of(Schedule(None, memory=True), 6).count(DURABLE) == 2  # the script decides when; K still holds


def test_a_skipped_save_counts_toward_no_tier():
    schedule = Schedule(1, memory=True, durable_every=2)
    schedule.saved(0.1, schedule.next_tier())  # durable
    schedule.saved(None, schedule.next_tier())  # skipped on every rank
    assert schedule.next_tier() == MEMORY and schedule.saves == 1


@settings(max_examples=100, deadline=None)
@given(durable_every=st.integers(1, 12), before=st.integers(0, 30), after=st.integers(1, 30))
def test_after_a_restore_a_rank_that_kept_its_process_names_the_tiers_a_new_process_names(durable_every, before,
                                                                                          after):
    survivor = Schedule(1, memory=True, durable_every=durable_every)
    tiers_of(survivor, before)
    survivor.restored()
    replacement = Schedule(1, memory=True, durable_every=durable_every)
    replacement.restored()
    assert tiers_of(survivor, after) == tiers_of(replacement, after)
    assert [survivor.due(u) for u in range(1, 10)] == [replacement.due(u) for u in range(1, 10)]


def test_auto_after_a_restore_measures_again_on_every_rank_alike():
    survivor, replacement = (Schedule("auto", mtbf="1h", memory=True) for _ in range(2))
    assert survivor.due(1) is True
    survivor.saved(20.0, survivor.next_tier())
    survivor.update_seconds = [1.0]
    survivor.apply_interval(1, survivor.decision(1))
    for schedule in (survivor, replacement):
        schedule.restored()
    assert [survivor.due(u) for u in (5, 6)] == [replacement.due(u) for u in (5, 6)] == [True, False]
    # Both wait for a plan with as many updates timed: the Checkpointer's collective re-plan starts on both.
    assert survivor.needs_plan() and replacement.needs_plan()
    assert len(survivor.update_seconds) == len(replacement.update_seconds) == 1
    assert survivor.next_tier() == replacement.next_tier() == DURABLE


def test_auto_plans_the_memory_interval_and_k_from_each_tiers_measured_cost():
    schedule = Schedule("auto", mtbf=3600, memory=True)  # mtbf_durable: ten times mtbf
    assert schedule.due(1) is True and schedule.next_tier() == DURABLE  # the first save measures, durably
    schedule.saved(20.0, DURABLE)
    schedule.update_seconds = [1.0] * 5
    # No memory save measured yet: the durable cost stands for one, and K = 2 so the next save measures one.
    first = schedule.decision(1)
    assert first == Interval(math.ceil(math.sqrt(2 * 20 * 3600)), 2)
    assert schedule.planned["cost_source"] == DURABLE and schedule.planned["tier"] == MEMORY
    schedule.apply_interval(1, first)
    assert schedule.next_tier() == MEMORY
    schedule.saved(2.0, MEMORY)
    # Memory: sqrt(2 x 2 s x 3600 s) = 120 s = 120 updates; durable: sqrt(2 x 20 s x 36000 s) = 1200 s: K = 10.
    second = schedule.decision(381)
    assert second == Interval(120, 10)
    planned = schedule.planned
    assert (planned["interval_s"], planned["durable_interval_s"]) == (120.0, 1200.0)
    assert (planned["cost_source"], planned["durable_cost_source"]) == ("measured", "measured")
    assert (planned["durable_mtbf_s"], planned["durable_every"], planned["every_updates"]) == (36000.0, 10, 120)
    schedule.apply_interval(381, second)
    assert schedule.due(500) is False and schedule.due(501) is True
    assert tiers_of(schedule, 10) == [MEMORY] * 8 + [DURABLE, MEMORY]  # 1 durable + 1 memory saved before
    assert "durable" in schedule.describe() and "10" in schedule.describe()


def planned_k(memory_cost: float, durable_cost: float = 20.0, **options) -> int:
    schedule = Schedule("auto", mtbf=3600, memory=True, **options)
    schedule.saved(durable_cost, DURABLE)
    schedule.saved(memory_cost, MEMORY)
    schedule.update_seconds = [1.0]
    return schedule.decision(1).durable_every


def test_k_grows_as_a_memory_save_gets_cheaper_than_a_durable_one():
    ks = [planned_k(cost) for cost in (19.0, 10.0, 5.0, 2.0, 0.5, 0.05)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert planned_k(0.2, mtbf_durable=3600) == 10  # sqrt(20 / 0.2): the same mtbf for both tiers


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.floats(0.001, 200), min_size=2, max_size=2, unique=True), durable_cost=st.floats(0.01, 100),
       mtbf=st.floats(1, 1e6), factor=st.floats(0.1, 100))
def test_a_cheaper_memory_save_never_plans_a_smaller_k(costs, durable_cost, mtbf, factor):
    cheaper, dearer = sorted(costs)
    durable = young_daly(durable_cost, factor * mtbf)
    assert saves_per_durable(young_daly(cheaper, mtbf), durable) >= saves_per_durable(young_daly(dearer, mtbf), durable)


@pytest.mark.parametrize("memory_cost", [20.0, 25.0])
def test_k_is_one_when_a_memory_save_costs_as_much_as_a_durable_one(memory_cost):
    assert planned_k(memory_cost) == 1


@settings(max_examples=200, deadline=None)
@given(memory_cost=st.floats(0.001, 100), durable_cost=st.floats(0.001, 100), mtbf=st.floats(1, 1e6),
       factor=st.floats(0.1, 100))
def test_k_is_young_dalys_ratio_of_the_two_intervals_rounded_half_up(memory_cost, durable_cost, mtbf, factor):
    memory, durable = young_daly(memory_cost, mtbf), young_daly(durable_cost, factor * mtbf)
    k = saves_per_durable(memory, durable)
    if memory_cost >= durable_cost:
        assert k == 1
    else:
        ratio = math.sqrt(durable_cost * factor / memory_cost)
        assert k == max(1, math.floor(ratio + 0.5)) or abs(ratio - math.floor(ratio) - 0.5) < 1e-9


def test_a_fixed_k_with_auto_plans_only_the_memory_interval():
    schedule = Schedule("auto", mtbf=3600, memory=True, durable_every=4)
    schedule.saved(20.0, DURABLE)
    schedule.saved(2.0, MEMORY)
    schedule.update_seconds = [1.0]
    assert schedule.decision(1) == Interval(120, 4) and "durable_interval_s" not in schedule.planned


def test_without_the_memory_tier_auto_plans_as_before_and_names_the_durable_tier():
    schedule = Schedule("auto", mtbf="1h")
    schedule.saved(8.0)
    schedule.update_seconds = [2.0]
    assert schedule.decision(2) == Interval(120, None)  # sqrt(2 x 8 s x 3600 s) = 240 s = 120 updates of 2 s
    assert schedule.planned["tier"] == DURABLE and schedule.planned["cost_source"] == "measured"
    assert schedule.describe() == schedule.plan.describe()


@pytest.mark.parametrize("bad", [
    {"durable_every": 2}, {"durable_every": 0, "memory": True}, {"durable_every": True, "memory": True},
    {"replicas": 0, "memory": True}, {"replicas": True, "memory": True}, {"replicas": 1.5, "memory": True},
    {"replicas": 2}, {"memory": ""}, {"memory": 5},
    {"memory": True, "every": 3, "mtbf_durable": "30d"},
    {"memory": True, "mtbf_durable": "30d"},
    {"every": "auto", "mtbf": "6h", "mtbf_durable": "30d"},
    {"memory": True, "every": "auto", "mtbf": "6h", "mtbf_durable": "30d", "durable_every": 3},
    {"memory": True, "every": "auto", "mtbf": "6h", "mtbf_durable": 0},
])
def test_a_tier_option_that_cannot_be_is_a_usage_error(tmp_path, bad):
    with pytest.raises(UsageError):
        CheckpointerOptions(store=str(tmp_path / "s"), run="r", **bad)


def test_tier_options_are_normalized_and_reach_the_schedule(tmp_path):
    off = CheckpointerOptions(store="s", run="r", memory=False, durable_every=1)
    assert off.memory is None and not off.schedule().memory and off.schedule().durable_every == 1
    on = CheckpointerOptions(store="s", run="r", memory=tmp_path / "holders", replicas=2, every=4)
    assert on.memory == str(tmp_path / "holders") and on.schedule().durable_every == DEFAULT_DURABLE_EVERY
    auto = CheckpointerOptions(store="s", run="r", memory=True, every="auto", mtbf="6h", mtbf_durable="30d")
    assert auto.schedule().mtbf_durable_s == 30 * 86400.0
    assert CheckpointerOptions(store="s", run="r", memory=True, every="auto", mtbf="6h").schedule().mtbf_durable_s \
        == 10 * 6 * 3600.0


@pytest.mark.parametrize("record", [Interval(7, 3), Interval(7), Interval(None)])
def test_the_interval_record_reads_back_with_its_k_and_another_version_is_refused(record):
    assert Interval.from_json(json.loads(json.dumps(record.to_json()))) == record
    with pytest.raises(Refusal) as refused:
        Interval.from_json({**record.to_json(), "v": messages.VERSION + 1})
    assert refused.value.code is RefusalCode.FORMAT


def test_an_interval_record_without_k_reads_as_none():
    assert Interval.from_json({"v": messages.VERSION, "kind": "interval", "every": 5}) == Interval(5, None)


def test_a_saves_event_fields_are_what_the_checkpoint_saved_event_promises():
    out = io.StringIO()
    emit("checkpoint_saved", out, **save_event_fields("r", "train", 12, "ab" * 32, MEMORY, 0.25))
    line = json.loads(out.getvalue())
    assert (line["tier"], line["update"], line["seconds"]) == (MEMORY, 12, 0.25)
    with pytest.raises(ValueError):
        save_event_fields("r", "train", 12, "ab" * 32, "disk", 0.25)


def test_the_events_page_names_the_tier_of_every_save():
    page = (Path(__file__).resolve().parents[2] / "docs" / "EVENTS.md").read_text()
    assert "`checkpoint_saved`" in page and "`tier`" in page
