"""``python -m bench recovery``: its timing from the training script's logs, and (full set) a quick run end to end.

No timing is asserted: only that the recovery time and its parts follow from the logged
timestamps, that a run missing a milestone is reported as failed, and that the quick run
recovers every method and reports its medians and ratios in the run's record.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.recovery_parse import MILESTONES, PARTS, RECOVERY_METHODS, read_logs, recovery_of  # noqa: E402

KILL_AFTER = 3


def run_logs(kill_t: float, restarted: list[list[float]], first_attempt_t: float = 0.0) -> dict:
    """Logs of a run whose rank r, restarted, reached MILESTONES at the times restarted[r] (seconds after the kill)."""
    ranks = {}
    for rank, gaps in enumerate(restarted):
        events = [{"event": m, "attempt": 0, "t": first_attempt_t + i} for i, m in enumerate(MILESTONES)]
        t = kill_t
        for milestone, gap in zip(MILESTONES, gaps):
            t += gap
            fields = {"step": KILL_AFTER} if milestone == "restored" else {"step": KILL_AFTER + 1, "loss": 2.5} \
                if milestone == "step" else {}
            events.append({"event": milestone, "attempt": 1, "t": t, **fields})
        ranks[rank] = events
    return {"kill": {"t": kill_t, "rank": len(restarted) - 1, "step": KILL_AFTER}, "ranks": ranks}


gaps = st.lists(st.floats(min_value=0.0, max_value=30.0, allow_nan=False), min_size=len(MILESTONES),
                max_size=len(MILESTONES))


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1e9, max_value=2e9, allow_nan=False), st.lists(gaps, min_size=1, max_size=8))
def test_recovery_is_the_slowest_first_step_after_the_kill_and_its_parts_add_up_to_it(kill_t, restarted):
    result = recovery_of(run_logs(kill_t, restarted), len(restarted), KILL_AFTER)
    slowest_step = max(kill_t + sum(g) for g in restarted)
    assert math.isclose(result["recovery_s"], slowest_step - kill_t, abs_tol=1e-6)
    assert list(result["parts_s"]) == list(PARTS)
    assert all(p >= -1e-6 for p in result["parts_s"].values())
    assert math.isclose(sum(result["parts_s"].values()), result["recovery_s"], abs_tol=1e-5)
    assert result["first_losses"] == [2.5] * len(restarted)


def test_a_rank_that_never_restarted_or_resumed_elsewhere_makes_the_run_a_failure():
    logs = run_logs(100.0, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    assert recovery_of(logs, 3, KILL_AFTER)["error"]  # a rank's log is missing
    gone = {**logs, "ranks": {0: logs["ranks"][0], 1: [e for e in logs["ranks"][1] if e["attempt"] == 0]}}
    assert "recovery_s" not in recovery_of(gone, 2, KILL_AFTER)
    assert "recovery_s" not in recovery_of(logs, 2, KILL_AFTER + 1)  # resumed at another step
    assert "recovery_s" not in recovery_of({**logs, "kill": None}, 2, KILL_AFTER)
    no_step = {**logs, "ranks": {0: logs["ranks"][0], 1: [e for e in logs["ranks"][1] if e["event"] != "step"]}}
    assert "recovery_s" not in recovery_of(no_step, 2, KILL_AFTER)


def test_logs_are_read_per_rank_and_a_line_cut_short_by_the_kill_is_dropped(tmp_path):
    logs = run_logs(50.0, [[1, 2, 3, 4, 5, 6], [2, 2, 2, 2, 2, 2]])
    for rank, events in logs["ranks"].items():
        text = "".join(json.dumps(e) + "\n" for e in events)
        (tmp_path / f"rank{rank}.jsonl").write_text(text + ('{"event": "st' if rank == 1 else ""))
    (tmp_path / "kill.json").write_text(json.dumps(logs["kill"]))
    assert read_logs(str(tmp_path)) == logs
    assert recovery_of(read_logs(str(tmp_path)), 2, KILL_AFTER)["recovery_s"] == pytest.approx(21.0)


@pytest.mark.full
@pytest.mark.timeout(600)
def test_the_quick_run_recovers_every_method_from_its_checkpoint_and_reports_medians_and_ratios(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "bench", "recovery", "--quick", "--dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=540)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert record["bench"] == ["recovery"] and record["code"]["source_sha256"] and record["machine"]["cpus"] >= 1
    result = record["result"]
    block = result["recovery"]["2"]
    assert set(block["methods"]) == set(RECOVERY_METHODS)
    for method, row in block["methods"].items():
        assert row["failed"] == [] and row["median_s"] > 0, (method, row)
        assert math.isclose(sum(row["parts_median_s"].values()), row["median_s"], rel_tol=1e-6)
    assert block["same_first_loss_after_recovery"]
    assert block["methods"]["torchrun-dcp"]["ratio_to_torchrun_dcp"] == 1.0
    assert block["methods"]["alpha-run-memory"]["restored"]["tier"] == "memory"
    assert block["methods"]["alpha-run-memory"]["restored"]["bytes_from_store"] == 0
    assert block["methods"]["alpha-run"]["restored"]["tier"] == "durable"
    stall = result["stall"]
    assert set(stall["median_stall_s"]) == {"memory", "memory-async", "ours-async", "dcp-async"}
    assert stall["memory_held_bytes_all_ranks"] >= stall["state_bytes_per_rank"] * stall["world"]
    assert result["raw_disk_GBps"] > 0
    assert list(tmp_path.iterdir()) == []  # the working directory is removed
