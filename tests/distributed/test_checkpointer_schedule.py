"""What Checkpointer saves write and keep: every=K, every="auto" (Young/Daly), keep=K, in_flight="skip",
unchanged regions carried instead of written again."""
import time

import pytest
import torch

from alpha_ckpt import Checkpointer
from alpha_ckpt.collective.schedule import Schedule
from alpha_ckpt.generation.reader import verify_generation
from alpha_ckpt.store import RefRecord, Store
from ranks import run_ranks


def state(value):
    return {"w": torch.full((1000,), float(value)), "step": value}


def every_and_keep(rank, world, store):
    import alpha_ckpt.upkeep.gc
    # No clock slack (2 s: the disagreement gc allows between file times and its clock) in this process,
    # whose saves are its only writers: a dropped generation's objects are older than it at once, so they go too.
    alpha_ckpt.upkeep.gc.CLOCK_SLACK_S = 0.0
    ckpt = Checkpointer(store, run="k", every=2, keep=2)
    ckpt.restore(state(0), root=None)
    due = []
    for update in range(1, 11):
        due.append(ckpt.due(update))
        if due[-1]:
            ckpt.save(state(update), update=update, cursor=update)
    dest = state(-1)
    counters = ckpt.restore(dest, root="latest")
    ckpt.close()
    return {"due": due, "update": counters.update, "restored": dest["step"]}


@pytest.mark.timeout(120)
def test_every_k_saves_the_same_updates_on_every_rank_and_keep_retains_the_newest_complete_ones(tmp_path):
    results = run_ranks(2, every_and_keep, str(tmp_path / "s"), tmp=tmp_path)
    assert results[0]["due"] == results[1]["due"] == [u % 2 == 0 for u in range(1, 11)]
    assert [r["update"] for r in results] == [10, 10] and [r["restored"] for r in results] == [10, 10]
    with Store(tmp_path / "s", create=False) as s:
        refs = [r for r in s.list_refs("k", "train") if isinstance(r, RefRecord)]
        assert [r.prefix.update for r in refs] == [8, 10]  # 2, 4 and 6 were removed, with their objects
        for r in refs:
            verify_generation(s, r.root)
        from alpha_ckpt.upkeep.gc import plan_gc
        # Seen from later, when every object is past the clock slack: none is left that no generation reaches.
        assert plan_gc(s, grace=0.0, now=time.time() + 60).objects == []
        assert len(list(s.iter_objects(lambda *a: None))) >= 4  # the kept generations' objects are there


def auto_schedule(rank, world, store):
    ckpt = Checkpointer(store, run="a", every="auto", mtbf=0.5)
    ckpt.restore(state(0), root=None)
    due = []
    for update in range(1, 13):
        time.sleep(0.02)  # an update's work
        due.append(ckpt.due(update))
        if due[-1]:
            ckpt.save(state(update), update=update, cursor=update)
    ckpt.close()
    return {"due": due}


@pytest.mark.timeout(120)
def test_auto_interval_is_planned_by_rank_0_and_applied_alike_on_every_rank(tmp_path):
    results = run_ranks(2, auto_schedule, str(tmp_path / "s"), tmp=tmp_path)
    due = results[0]["due"]
    assert results[1]["due"] == due
    assert due[0] is True  # the first update measures what a checkpoint costs
    assert sum(due) >= 2 and not all(due)  # then a planned interval of more than one update


def test_young_daly_turns_the_measured_cost_into_whole_updates():
    schedule = Schedule("auto", mtbf="1h")
    assert schedule.due(1) is True and schedule.due(2) is False  # the first update measures; then a plan is awaited
    assert schedule.decide(2) is None  # no cost known yet
    schedule.update_seconds = [2.0] * 5
    schedule.saved(8.0)
    # sqrt(2 x 8 s x 3600 s) = 240 s = 120 updates of 2 s
    assert schedule.decide(2) == 120 and schedule.planned["cost_source"] == "measured"
    assert schedule.decide(2, floor_s=400.0) == 200  # an async save's interval is at least one save
    schedule.apply(2, 120)
    assert schedule.due(121) is False and schedule.due(122) is True
    assumed = Schedule("auto", mtbf="1h", checkpoint_cost="60")
    assert assumed.due(1) is False  # a cost is assumed: no measuring checkpoint
    assumed.update_seconds = [1.0]
    assert assumed.decide(1) == 658 and assumed.planned["cost_source"] == "assumed"  # ceil(sqrt(2 x 60 x 3600) / 1)
    for bad in [("auto",), (0,), (3, 10), (True,), ("auto", -1), ("auto", "6h", "0")]:
        with pytest.raises(ValueError):
            Schedule(*bad)


def skip_in_flight(rank, world, store):
    import threading
    ckpt = Checkpointer(store, run="f", save="async", in_flight="skip")
    ckpt.restore(state(0), root=None)
    exchange = ckpt._exchange
    asked = threading.Event()

    def slow(*args):
        asked.wait(60)  # a save still in flight on every rank until the second is asked for
        return exchange(*args)
    ckpt._exchange = slow
    first = ckpt.save(state(1), update=1, cursor=1)
    second = ckpt.save(state(2), update=2, cursor=2)  # the first is still in flight: skipped everywhere
    asked.set()
    ckpt.wait()
    third = ckpt.save(state(3), update=3, cursor=3)
    ckpt.close()
    return {"first": first.root, "second": [second.skipped, second.done(), second.root], "third": third.root,
            "skipped": ckpt.skipped}


@pytest.mark.timeout(120)
def test_in_flight_skip_skips_on_every_rank_and_publishes_the_rest(tmp_path):
    results = run_ranks(2, skip_in_flight, str(tmp_path / "s"), tmp=tmp_path)
    assert [r["second"] for r in results] == [[True, True, None]] * 2 and [r["skipped"] for r in results] == [1, 1]
    assert results[0]["first"] == results[1]["first"] and results[0]["third"] == results[1]["third"]
    with Store(tmp_path / "s", create=False) as s:
        assert [r.prefix.update for r in s.list_refs("f", "train")] == [1, 3]


def frozen_table(rank, world, store, publisher):
    table = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB that never changes (a frozen embedding)
    ckpt = Checkpointer(store, run="c", publisher=publisher)
    ckpt.restore({"table": table, "w": torch.zeros(10)}, root=None)
    written = []
    for update in (1, 2, 3):
        ckpt.save({"table": table, "w": torch.full((10,), float(update))}, update=update, cursor=update)
        written.append(ckpt.last_save["bytes_written"])
    dest = {"table": torch.zeros(1_000_000), "w": torch.zeros(10)}
    counters = ckpt.restore(dest, root="latest")
    ckpt.close()
    return {"written": written, "update": counters.update, "equal": torch.equal(dest["table"], table),
            "w": dest["w"].tolist()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_an_unchanged_region_is_carried_not_written_again(tmp_path, publisher):
    results = run_ranks(2, frozen_table, str(tmp_path / "s"), publisher, tmp=tmp_path)
    written = results[0]["written"]
    assert results[1]["written"] == written  # every rank learns the publish's total
    assert written[0] > 4_000_000 and written[1] < 100_000 and written[2] < 100_000, written
    assert all(r["update"] == 3 and r["equal"] and r["w"] == [3.0] * 10 for r in results)
