"""A hung rank (SIGSTOP) under alpha-run: found by its silent heartbeat, killed, named and replaced, bit-exact;
a rank that is slow but beats within the limit is left alone; --timeout bounds every process group."""
import json
import signal
import time
from pathlib import Path

import pytest

from alpha_ckpt.testing.launch import alpha_run
from test_in_place_recovery import events, final_state, process_started  # the same training script's result line and events

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "in_place_training.py"
STEPS, STOP_AT = 8, 3
TIMEOUT, LIMIT = 30, 5  # --timeout and --heartbeat-limit (its period: a quarter of it, at most 1 s)


def stopped_run(tmp_path, *flags):
    """alpha-run of the training script with rank 1 SIGSTOPped at step STOP_AT, its events under tmp_path/ev."""
    (tmp_path / "ev").mkdir()
    return alpha_run("--nproc", 2, *flags, "--timeout", TIMEOUT, "--heartbeat-limit", LIMIT, "--store", tmp_path / "s",
                     SCRIPT, "--steps", STEPS, "--stop-rank", 1, "--stop-at", STOP_AT, "--events", tmp_path / "ev",
                     cwd=tmp_path)


def restores(recorded: list[dict]) -> list[dict]:
    """Every main() call's restore of one rank: pid, round, the step resumed and the restart context read."""
    return [e for e in recorded if "resumed_at" in e]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("straight")
    proc = alpha_run("--nproc", 2, "--store", tmp / "s", SCRIPT, "--steps", STEPS, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return final_state(proc)["state_sha256"]


def assert_the_stopped_rank_was_named_and_replaced_in_time(recorded: dict[int, list[dict]]) -> None:
    [stopped_at] = [e["stopped_at"] for e in recorded[1] if "stopped_at" in e]
    for rank, seen in recorded.items():
        first, second = restores(seen)  # one restart, no more
        assert (first["resumed_at"], second["resumed_at"]) == (0, STOP_AT), rank
        context = second["restart"]
        assert (context["failed_rank"], context["failed_exit"]) == (1, -9), rank  # the stopped rank, SIGKILLed
        # Found by its silence: not before the limit (less the period, the last beat's age when it stopped), and
        # soon after it; every rank resumed well within --timeout of the stop.
        assert LIMIT - 1.5 <= context["detected_at"] - stopped_at < LIMIT + 4, (rank, context, stopped_at)
        assert second["restored"] - stopped_at < TIMEOUT, rank
    assert not [e for e in recorded[1] if "continued_at" in e]  # the stopped process never ran again


@pytest.mark.timeout(300)
def test_a_stopped_rank_under_in_place_is_killed_named_and_replaced_alone_bit_exact(tmp_path, uninterrupted):
    proc = stopped_run(tmp_path, "--max-restarts", 1, "--in-place")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted
    recorded = events(tmp_path / "ev")
    assert_the_stopped_rank_was_named_and_replaced_in_time(recorded)
    survivor, replaced = restores(recorded[0]), restores(recorded[1])
    assert survivor[0]["pid"] == survivor[1]["pid"]  # the healthy rank kept its process
    assert replaced[0]["pid"] != replaced[1]["pid"]
    [stopped_at] = [e["stopped_at"] for e in recorded[1] if "stopped_at" in e]
    assert process_started(recorded[1], replaced[1]["pid"]) < stopped_at  # a spare, waiting before the stop


@pytest.mark.timeout(300)
def test_a_stopped_rank_under_max_restarts_is_killed_named_and_every_rank_restarts_bit_exact(tmp_path, uninterrupted):
    proc = stopped_run(tmp_path, "--max-restarts", 1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted
    recorded = events(tmp_path / "ev")
    assert_the_stopped_rank_was_named_and_replaced_in_time(recorded)
    assert all(len({e["pid"] for e in restores(seen)}) == 2 for seen in recorded.values())  # torch's agent: all new


@pytest.mark.timeout(300)
def test_a_stopped_rank_with_no_restart_left_exits_75_naming_it_within_the_timeout(tmp_path):
    proc = stopped_run(tmp_path)
    ended_at = time.time()
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "rank 1 " in proc.stderr.strip().splitlines()[-1]
    [stopped_at] = [e["stopped_at"] for e in events(tmp_path / "ev")[1] if "stopped_at" in e]
    assert ended_at - stopped_at < TIMEOUT


@pytest.mark.timeout(300)
def test_a_rank_stopped_for_less_than_the_limit_is_left_alone_and_ends_bit_exact(tmp_path, uninterrupted):
    (tmp_path / "ev").mkdir()
    # Stopped 2 s (its heartbeat silent that long, and its peer waiting in a collective), then continued;
    # the limit is 5 s: no restart.
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--timeout", TIMEOUT, "--heartbeat-limit", LIMIT,
                     "--store", tmp_path / "s", SCRIPT, "--steps", STEPS, "--stop-rank", 1, "--stop-at", STOP_AT,
                     "--stop-for", 2, "--events", tmp_path / "ev", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted
    recorded = events(tmp_path / "ev")
    [stopped_at] = [e["stopped_at"] for e in recorded[1] if "stopped_at" in e]
    [continued_at] = [e["continued_at"] for e in recorded[1] if "continued_at" in e]
    assert continued_at - stopped_at >= 2
    for rank, seen in recorded.items():
        [only] = restores(seen)  # one process, one call of main(), no restart
        assert only["restart"] is None and len({e["pid"] for e in seen}) == 1, rank


ONE_RANK_ENDS_FIRST = """
import dataclasses, json, os, signal, sys, time
from alpha_ckpt.runtime import launch_env
rank = int(os.environ["RANK"])
if launch_env.restart_attempt() == 0:
    if rank == 1:
        time.sleep(float(sys.argv[2]))
        os.kill(os.getpid(), signal.SIGUSR1)  # a signal's death is restarted (an exit before any checkpoint is not)
    sys.exit(0)
with open(os.path.join(sys.argv[1], f"context-{rank}.json"), "w") as f:
    json.dump(dataclasses.asdict(launch_env.restart_context()), f)
"""


@pytest.mark.timeout(200)
def test_a_rank_that_ended_while_the_others_run_is_not_taken_for_hung(tmp_path):
    # Attempt 0: rank 0 exits 0 at once and beats no more; rank 1 runs on for three limits, then dies (SIGUSR1).
    script = tmp_path / "ends_first.py"
    script.write_text(ONE_RANK_ENDS_FIRST)
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--timeout", 20, "--heartbeat-limit", 2,
                     "--store", tmp_path / "s", script, tmp_path, 6, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # the restart names rank 1 and its signal, not rank 0 as hung (SIGKILL)
        context = json.loads((tmp_path / f"context-{rank}.json").read_text())
        assert (context["failed_rank"], context["failed_exit"]) == (1, -signal.SIGUSR1), rank


GROUP_TIMEOUTS = """
import json, sys
import torch
import torch.distributed as dist
import alpha_ckpt

def main():
    groups = [dist.group.WORLD, dist.new_group()]
    print(json.dumps([g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]))

if sys.argv[1] == "run_resilient":
    alpha_ckpt.run_resilient(main, backend="gloo")
else:
    dist.init_process_group("gloo")
    main()
dist.destroy_process_group()
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("joins", ["run_resilient", "init_process_group"])
def test_timeout_bounds_every_process_group_of_a_script_however_it_joins(tmp_path, joins):
    script = tmp_path / "groups.py"
    script.write_text(GROUP_TIMEOUTS)
    proc = alpha_run("--nproc", 1, "--timeout", 42, "--store", tmp_path / "s", script, joins, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [42.0, 42.0]  # the default group and a new one
