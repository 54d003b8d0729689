"""scripts/probe_sharded_saves.py: every method timed in every round, every restore checked, pairs reported.

No timing is asserted: only what the probe measured and verified, and its pure parts.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "probe_sharded_saves.py"


def load_probe():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("probe_sharded_saves", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_probe(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path), *args],
                          capture_output=True, text=True, env=env, timeout=240)


def test_the_probe_times_every_method_every_round_and_checks_every_restore(tmp_path):
    methods = ["dcp-alpha-s1-sh1", "ckpt", "dcp-t2"]
    # 2 ranks x 1024 rows: each rank's chunk of a matrix is 2 MiB, stored as two 1 MiB slices in 1 MiB shards
    run = run_probe(tmp_path, "--ranks", "2", "--rounds", "3", "--warmup", "0", "--rows", "1024",
                    "--prefault", "0", "--restore", "--sync", "--methods", *methods)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert list(out["times"]) == methods
    assert all(len(v) == 3 and min(v) > 0 for v in out["times"].values())
    assert out["verified_restores"] == 3 * len(methods)
    assert set(out["pairs"]) == {"dcp-alpha-s1-sh1 over ckpt", "dcp-alpha-s1-sh1 over dcp-t2", "ckpt over dcp-t2"}
    assert all(p["rounds"] == 3 and p["interval_90"] is None for p in out["pairs"].values())  # under 5 rounds
    assert list(tmp_path.iterdir()) == []  # its working directory is removed


@pytest.mark.parametrize("methods", [["dcp-alpha"], ["dcp", "dcp"], ["dcp", "dcp-alpha-x4"], ["dcp", "torch"]])
def test_the_probe_refuses_methods_it_cannot_pair(tmp_path, methods):
    run = run_probe(tmp_path, "--methods", *methods)
    assert run.returncode == 2
    assert list(tmp_path.iterdir()) == []


def test_every_method_leads_a_round_equally_often_over_a_full_rotation():
    probe = load_probe()
    methods = ["a", "b", "c", "d"]
    orders = [probe.rotated(methods, r) for r in range(8)]
    assert all(sorted(o) == methods for o in orders)
    assert sorted(o[0] for o in orders) == sorted(methods * 2)


def test_pair_stats_give_the_ratio_of_medians_the_rounds_won_and_the_geometric_mean():
    probe = load_probe()
    first, second = [1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 0.5, 2.0]
    s = probe.pair_stats(first, second)
    assert s["ratio"] == 2.0
    assert s["first_faster"] == 4 and s["rounds"] == 5
    assert math.isclose(s["geo_mean"], 2 ** 0.6)
    lo, hi = s["interval_90"]
    assert lo <= s["ratio"] <= hi
