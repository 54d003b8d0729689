"""scripts/bench_store.py runs every section end to end on a small state and says what it verified.

No timing is asserted: only that each section measured every method, checked
every restore (or, for the stall section, every saved snapshot) against the
values it should hold, and reported the medians and ratios in its JSON line.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_store.py"

STORE_METHODS = {"ours", "torch", "dcp", "dcp-t2", "raw"}
STALL_METHODS = {"ours-sync", "ours-async", "ours-async-deferred", "dcp-sync", "dcp-async", "dcp-async-staged"}
OWNER_METHODS = {"ours", "dcp", "dcp-t2", "raw"}


def test_every_section_runs_verifies_and_reports_its_medians_and_ratios(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--section", "all", "--size-mib", "16", "--tensors", "4", "--reps", "1",
         "--warmup", "0", "--prefault", "0", "--compute-s", "0.02", "--owners", "1", "2", "4", "--dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["sections"] == ["store", "stall", "owners"]
    assert list(tmp_path.iterdir()) == []  # the working directory is removed

    # store: the keys it always had, at the top level
    assert set(result["median_s"]) == STORE_METHODS
    assert all(set(v) == {"save", "load"} for v in result["median_s"].values())
    assert {"ours_save/dcp_save", "ours_save/dcp_t2_save", "ours_load/dcp_load"} <= set(result["ratios"])
    assert set(result["targets_met"]) <= set(result["ratios"])
    assert result["verified_restores"] == 4  # every method but raw, one repetition

    stall = result["stall"]
    assert set(stall["median_s"]) == STALL_METHODS
    assert all(set(v) == {"stall", "call", "fence", "compute", "save"} for v in stall["median_s"].values())
    assert {f"{m}_stall/ours-sync_save" for m in STALL_METHODS} <= set(stall["ratios"])
    assert {f"{m}_stall/dcp-async_stall" for m in STALL_METHODS} <= set(stall["ratios"])
    assert set(stall["targets_met"]) == {"ours-async_stall/ours-sync_save", "ours-async_stall/dcp-async_stall",
                                         "ours-async-deferred_stall/ours-sync_save",
                                         "ours-async-deferred_stall/dcp-async_stall"}
    assert stall["verified_saves"] == len(STALL_METHODS)  # every snapshot read back and compared
    assert stall["compute_matmuls"] >= 1

    owners = result["owners"]
    assert owners["counts"] == [1, 2, 4]
    for n in ("1", "2", "4"):
        assert set(owners["median_s"][n]) == OWNER_METHODS
        assert set(owners["median_GBps"][n]) == OWNER_METHODS
        assert set(owners["targets_met"][n]) == {"ours_save_GBps/dcp_save_GBps", "ours_save_GBps/dcp_t2_save_GBps",
                                                 "ours_restore_GBps/dcp_load_GBps"}
        assert set(owners["targets_met"][n]) <= set(owners["ratios"][n])
    assert owners["verified_restores"] == 3 * 3  # ours, dcp and dcp-t2 at each of the three counts


def test_the_store_section_alone_is_still_the_default(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    run = subprocess.run([sys.executable, str(SCRIPT), "--size-mib", "8", "--tensors", "2", "--reps", "1", "--warmup",
                          "0", "--prefault", "0", "--dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["sections"] == ["store"] and "stall" not in result and "owners" not in result
    assert set(result["median_s"]) == STORE_METHODS and result["verified_restores"] == 4
