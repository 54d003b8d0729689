"""alpha-run --in-place --spares K: failed ranks are taken by processes that were waiting before the failure,
the pool is refilled, and nothing of it outlives the launcher."""
import os
import signal

import pytest

from alpha_ckpt.testing import launch
from test_in_place_recovery import (SCRIPT, STEPS, alpha_run, calls, events, final_state, process_started,  # noqa: F401
                                    uninterrupted)

pytestmark = pytest.mark.slow  # each runs a DDP GPT job under alpha-run and kills ranks (CI's slow set)


def replacements(recorded: dict[int, list[dict]], ranks) -> list[int]:
    """The pid of each of ``ranks``' second process (the one that took its number after it died)."""
    out = []
    for rank in ranks:
        pids = list(dict.fromkeys(pid for pid, _ in calls(recorded[rank])))
        assert len(pids) == 2, (rank, pids)  # one death, one replacement
        out.append(pids[1])
    return out


def death(recorded: dict[int, list[dict]], ranks) -> float:
    """The first moment one of ``ranks`` killed itself."""
    return min(e["killed_at"] for rank in ranks for e in recorded[rank] if "killed_at" in e)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spares", [1, 2])
def test_ranks_failing_together_take_the_waiting_spares_and_new_processes_for_the_rest(tmp_path, uninterrupted, spares):
    (tmp_path / "ev").mkdir()
    proc = alpha_run("--nproc", 3, "--max-restarts", 1, "--in-place", "--spares", spares, "--store", tmp_path / "s",
                     SCRIPT, "--steps", STEPS, "--kill-rank", 1, "--kill-rank", 2, "--kill-at", 3,
                     "--events", tmp_path / "ev", cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(3)
    recorded = events(tmp_path / "ev")
    failed = death(recorded, (1, 2))
    warm = [process_started(recorded[rank], pid) < failed
            for rank, pid in zip((1, 2), replacements(recorded, (1, 2)))]
    assert sorted(warm) == ([False, True] if spares == 1 else [True, True]), warm
    survivor = calls(recorded[0])
    assert [pid for pid, _ in survivor] == [survivor[0][0]] * 2  # rank 0 kept its process


@pytest.mark.timeout(600)
def test_two_failures_in_a_row_are_each_taken_by_a_spare(tmp_path, uninterrupted):
    (tmp_path / "ev").mkdir()
    proc = alpha_run("--nproc", 2, "--max-restarts", 2, "--in-place", "--spares", 2, "--store", tmp_path / "s",
                     SCRIPT, "--steps", STEPS, "--kill-rank", 1, "--kill-at", 3, "--kills", 2,
                     "--events", tmp_path / "ev", cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(2)
    recorded = events(tmp_path / "ev")[1]
    pids = list(dict.fromkeys(pid for pid, _ in calls(recorded)))
    kills = [e["killed_at"] for e in recorded if "killed_at" in e]
    assert len(pids) == 3 and len(kills) == 2  # rank 1 died twice, two processes took its number
    assert process_started(recorded, pids[1]) < kills[0] and process_started(recorded, pids[2]) < kills[1]


@pytest.mark.timeout(600)
def test_a_spare_that_dies_while_waiting_is_replaced_and_the_job_is_undisturbed(tmp_path, uninterrupted):
    (tmp_path / "ev").mkdir()
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--in-place", "--spares", 1, "--store", tmp_path / "s",
                     SCRIPT, "--steps", STEPS, "--kill-spare-at", 2, "--kill-rank", 1, "--kill-at", 5,
                     "--events", tmp_path / "ev", cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(2)
    recorded = events(tmp_path / "ev")
    [killed_spare] = [e["killed_spare"] for e in recorded[0] if "killed_spare" in e]
    [replacement] = replacements(recorded, (1,))
    assert replacement != killed_spare
    assert process_started(recorded[1], replacement) < death(recorded, (1,))  # the spare started in its place
    for rank in (0, 1):  # neither rank noticed the spare's death: one round, one restore each after it
        assert [e["resumed_at"] for e in recorded[rank] if "resumed_at" in e] == [0, 5]


def spares_of(launcher_pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            command = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if ppid == launcher_pid and b"--spare" in command:
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(300)
def test_a_sigkilled_launcher_leaves_no_spare_behind(tmp_path):
    run = launch.alpha_run_start("--nproc", 2, "--max-restarts", 2, "--in-place", "--spares", 2,
                                 "--store", tmp_path / "s", SCRIPT, "--steps", 1000, "--step-seconds", 0.2,
                                 cwd=tmp_path)
    try:
        spares = launch.wait_until(lambda: spares_of(run.pid) if len(spares_of(run.pid)) == 2 else None,
                                   timeout=180, what="two spares waiting")
    finally:
        os.kill(run.pid, signal.SIGKILL)
    launch.wait_until(lambda: not any(alive(pid) for pid in spares), timeout=30,
                      what="the spares gone with their launcher")
    run.wait(30)
    assert run.returncode == -signal.SIGKILL


@pytest.mark.timeout(600)
def test_a_script_that_prepares_is_taken_over_by_a_spare_whose_model_was_built_before_the_failure(tmp_path,
                                                                                                  uninterrupted):
    (tmp_path / "ev").mkdir()
    # Steps of 0.8 s: the spare, started after the first, has imported torch and built the model by step 5.
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--in-place", "--spares", 1, "--store", tmp_path / "s",
                     SCRIPT, "--prepare", "--steps", STEPS, "--step-seconds", 0.8, "--kill-rank", 1, "--kill-at", 5,
                     "--events", tmp_path / "ev", cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(2)  # the same as building the model in main()
    recorded = events(tmp_path / "ev")
    [killed_at] = [e["killed_at"] for e in recorded[1] if "killed_at" in e]
    first, replacement = [e for e in recorded[1] if "prepared_at" in e]  # one per process of rank 1
    assert replacement["process_started"] < killed_at and replacement["prepared_at"] < killed_at
    assert first["prepared_at"] < replacement["prepared_at"]
    survivor = [e for e in recorded[0] if "prepared_at" in e]
    assert len(survivor) == 1  # rank 0 built its model once and kept it through the recovery


@pytest.mark.timeout(600)
def test_a_spare_whose_script_reads_the_rank_before_run_resilient_runs_it_again_once_it_has_one(tmp_path,
                                                                                                uninterrupted):
    (tmp_path / "ev").mkdir()
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--in-place", "--spares", 1, "--store", tmp_path / "s",
                     SCRIPT, "--prepare", "--read-rank-at-import", "--steps", STEPS, "--step-seconds", 0.8,
                     "--kill-rank", 1, "--kill-at", 5, "--events", tmp_path / "ev", cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(2)
    recorded = events(tmp_path / "ev")
    [killed_at] = [e["killed_at"] for e in recorded[1] if "killed_at" in e]
    _, replacement = [e for e in recorded[1] if "prepared_at" in e]
    # The spare's process was waiting, but its script could not run without a rank: built after the failure.
    assert replacement["process_started"] < killed_at < replacement["prepared_at"]
