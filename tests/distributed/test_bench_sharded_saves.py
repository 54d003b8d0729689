"""``python -m bench sharded-saves``: every method timed in every round, every restore checked, pairs reported.

No timing is asserted: only what the probe measured, stored and verified, and its pure parts.
"""
import json
import math
import sys
from collections import Counter
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the bench package lives at the repository's root
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def probe():
    from bench import sharded_saves
    return sharded_saves


def run_probe(tmp_path, *args):
    return launch.python_m("bench", "sharded-saves", "--dir", tmp_path, *args, cwd=ROOT, timeout=240)


def probe_result(run) -> dict:
    """The figures of the run's record (its last line), which names the code and the machine."""
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert record["bench"] == ["sharded-saves"] and record["code"]["source_sha256"] and record["machine"]["cpus"]
    return record["result"]


@pytest.mark.slow  # a long-haul run: CI runs it (python -m pytest -n 2 -m slow)
def test_the_probe_times_every_method_every_round_stores_each_layout_asked_and_checks_every_restore(tmp_path):
    methods = ["dcp-alpha-s1-sh1", "dcp-alpha", "ckpt", "dcp"]
    # 2 ranks x 1024 rows: each rank holds 16 chunks of 2 MiB (32 MiB).
    run = run_probe(tmp_path, "--ranks", "2", "--rounds", "4", "--warmup", "0", "--rows", "1024",
                    "--prefault", "0", "--restore", "--sync", "--methods", *methods)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = probe_result(run)
    assert list(out["times"]) == methods
    assert all(len(v) == 4 for v in out["times"].values())
    assert out["verified_restores"] == 4 * len(methods)
    # 1 MiB slices in 1 MiB shards: 32 shard files per rank and the root manifest. The backend's
    # defaults after it (32 MiB shards): one shard per rank and the manifest.
    assert out["objects"] == {"dcp-alpha-s1-sh1": [65] * 4, "dcp-alpha": [3] * 4}
    assert out["left_behind"] == []  # each round's directory was removed as the probe went
    assert len(out["pairs"]) == 6 and all(p["rounds"] == 4 for p in out["pairs"].values())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # a long-haul run: CI runs it (python -m pytest -n 2 -m slow)
def test_phases_are_what_the_checkpointer_and_the_dcp_backend_report_and_fit_inside_each_save(tmp_path):
    methods = ["dcp-alpha-w1", "dcp-alpha-s1-sh1-w3", "ckpt", "dcp"]
    run = run_probe(tmp_path, "--ranks", "2", "--rounds", "2", "--warmup", "0", "--rows", "1024",
                    "--prefault", "0", "--phases", "--methods", *methods)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = probe_result(run)
    phases, times = out["phases"], out["times"]
    # The Checkpointer's SaveResult.phases and the backend's StorageWriter.phases: no product function wrapped.
    assert set(phases["ckpt"]) == {"capture", "agree", "durable.write", "durable.commit"}
    for m in ("dcp-alpha-w1", "dcp-alpha-s1-sh1-w3"):
        assert set(phases[m]) == {"backend set_up", "backend plan", "backend write", "backend finish", "dcp own"}
        assert all(s > 0 for label in ("backend write", "backend finish") for s in phases[m][label])
    assert phases["dcp"] == {}  # DCP's own writer reports no phases
    assert all(s > 0 for s in phases["ckpt"]["durable.write"])
    for m in methods:  # per round, the slowest rank's phases; each within the slowest rank's save
        assert all(len(v) == 2 for v in phases[m].values())
        for label, v in phases[m].items():
            assert all(0 <= s <= t for s, t in zip(v, times[m])), (m, label)
    assert all(len(out["cpu"][m]) == 2 and all(c > 0 for c in out["cpu"][m]) for m in methods)


@pytest.mark.parametrize("args", [["--methods", "dcp-alpha"], ["--methods", "dcp", "dcp"],
                                  ["--methods", "dcp", "dcp-alpha-s0"], ["--methods", "dcp", "dcp-alpha-w0"], ["--methods", "dcp", "torch"],
                                  ["--rows", "10", "--ranks", "4"], ["--prefault", "-1"]])
def test_the_probe_refuses_what_it_cannot_run_before_starting_ranks(tmp_path, args):
    run = run_probe(tmp_path, *args)
    assert run.returncode == 2, run.stderr[-2000:]


def test_over_a_full_cycle_every_method_directly_follows_every_other_equally_often(probe):
    for methods in (["a", "b", "c", "d"], ["a", "b", "c"]):
        cycle = len(probe.balanced_orders(methods))
        orders = [probe.round_order(methods, r) for r in range(cycle)]
        assert all(sorted(o) == methods for o in orders)
        follows = Counter((o[i], o[i + 1]) for o in orders for i in range(len(o) - 1))
        assert set(follows) == {(a, b) for a in methods for b in methods if a != b}
        assert len(set(follows.values())) == 1


def test_pair_stats_give_the_ratio_of_medians_the_rounds_won_and_the_geometric_mean(probe):
    first, second = [1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 0.5, 2.0]
    s = probe.pair_stats(first, second)
    assert s["ratio"] == 2.0
    assert s["first_faster"] == 4 and s["rounds"] == 5
    assert math.isclose(s["geo_mean"], 2 ** 0.6)
    lo, hi = s["interval_90"]
    assert lo <= s["ratio"] <= hi
    assert probe.pair_stats(first[:4], second[:4])["interval_90"] is None  # too few rounds to claim one


@pytest.mark.slow  # a long-haul run: CI runs it (python -m pytest -n 2 -m slow)
def test_the_raw_control_writes_each_ranks_bytes_to_one_file_and_is_never_restored(tmp_path, probe):
    methods = ["raw", "ckpt"]
    run = run_probe(tmp_path, "--ranks", "2", "--rounds", "2", "--warmup", "0", "--rows", "256",
                    "--prefault", "0", "--restore", "--phases", "--methods", *methods)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = probe_result(run)
    assert all(len(out["times"][m]) == 2 for m in methods)
    assert out["verified_restores"] == 2  # the Checkpointer's saves; the control's bytes are not read back
    assert out["objects"]["raw"] == [2, 2]  # one file per rank, each round
    assert out["phases"]["raw"] == {}  # no Checkpointer or backend phase: neither ran for the control
    assert out["left_behind"] == []


def test_percentile_interpolates_between_ranks_as_numpy_does(probe):
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert probe.percentile(values, 0.5) == 3.0
    assert probe.percentile(values, 0.0) == 1.0 and probe.percentile(values, 1.0) == 5.0
    assert math.isclose(probe.percentile(values, 0.9), 4.6)
    assert probe.percentile([7.0], 0.9) == 7.0
