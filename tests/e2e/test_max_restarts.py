"""alpha-run --max-restarts as a user runs it: a refusal is not restarted, a restarted worker learns
what failed and when, and the built-in job restarts into the newest generation with no flag added."""
import json
import os
import time
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]

REFUSING = """
import os, sys
from alpha_ckpt import Refusal, RefusalCode
with open(sys.argv[1], "a") as attempts:
    attempts.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
raise Refusal(RefusalCode.FOREIGN_LEARNER, "a checkpoint of another model")
"""

# Attempt 0: rank 1 notes the time and SIGKILLs itself; rank 0 waits to be stopped. Attempt 1: each
# rank writes the restart context it reads.
KILLED_ONCE = """
import dataclasses, json, os, signal, sys, time
from alpha_ckpt.runtime import launch_env
out, rank = sys.argv[1], int(os.environ["RANK"])
if launch_env.restart_attempt() == 0:
    if rank == 1:
        with open(os.path.join(out, "killed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    sys.exit(0)
context = launch_env.restart_context()
with open(os.path.join(out, f"context-{rank}.json"), "w") as f:
    json.dump({"context": dataclasses.asdict(context), "read_at": time.time()}, f)
"""


# argv: ATTEMPTS_FILE WHEN. Each rank notes its attempt, then fails with its own error: "before" any
# checkpoint call (a bad model size), "rank1-before" (rank 1 only, while rank 0 waits in its restore for
# it), or "after" its restore in the first attempt only (the restart then finishes).
OWN_ERROR = """
import os, sys
import torch, torch.distributed as dist
import alpha_ckpt
attempt, rank, when = os.environ["TORCHELASTIC_RESTART_COUNT"], int(os.environ["RANK"]), sys.argv[2]
with open(sys.argv[1], "a") as attempts:
    attempts.write(attempt + "\\n")
dist.init_process_group("gloo")
if when == "before" or (when == "rank1-before" and rank == 1):
    raise ValueError("hidden size must be positive, not -3")
ckpt = alpha_ckpt.Checkpointer.from_launcher_env()
ckpt.restore({"w": torch.zeros(4)})
if when == "after" and attempt == "0":
    raise ValueError("the loss diverged")
"""


def alpha_run(*args, cwd, env=None, timeout=200):
    return launch.alpha_run(*args, cwd=cwd, env=env, timeout=timeout)


@pytest.mark.timeout(120)
def test_a_refusal_under_max_restarts_exits_3_after_one_attempt(tmp_path):
    script = tmp_path / "refusing.py"
    script.write_text(REFUSING)
    attempts = tmp_path / "attempts"
    started = time.monotonic()
    run = alpha_run("--nproc", 2, "--store", tmp_path / "s", "--max-restarts", 3, script, attempts, cwd=tmp_path)
    assert run.returncode == 3, run.stderr[-2000:]
    # The first attempt's ranks, and no other attempt (a rank still starting when its peer refused is stopped
    # before it writes: a rank imports torch before its script, to beat).
    assert set(attempts.read_text().split()) == {"0"}
    assert time.monotonic() - started < 60
    assert run.stderr.count("a checkpoint of another model") == 1  # told once, naming both ranks, not per rank


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["before", "rank1-before"])
def test_a_scripts_own_error_before_any_checkpoint_call_exits_1_after_one_attempt(tmp_path, when):
    script = tmp_path / "own_error.py"
    script.write_text(OWN_ERROR)
    attempts = tmp_path / "attempts"
    run = alpha_run("--nproc", 2, "--store", tmp_path / "s", "--max-restarts", 3, script, attempts, when, cwd=tmp_path)
    assert run.returncode == 1, run.stderr[-2000:]
    # no restart spent on it (else alpha-run's lines say which rank's failure it took as the cause, and how)
    assert attempts.read_text().split() == ["0", "0"], run.stderr[-4000:]
    assert "hidden size must be positive, not -3" in run.stderr  # the script's own error is shown


@pytest.mark.timeout(180)
def test_a_scripts_error_after_a_checkpoint_call_is_retried(tmp_path):
    script = tmp_path / "own_error.py"
    script.write_text(OWN_ERROR)
    attempts = tmp_path / "attempts"
    run = alpha_run("--nproc", 2, "--store", tmp_path / "s", "--max-restarts", 1, script, attempts, "after",
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert attempts.read_text().split() == ["0", "0", "1", "1"]


@pytest.mark.timeout(120)
def test_a_restarted_worker_learns_the_attempt_the_failed_rank_and_when_the_failure_was_seen(tmp_path):
    script = tmp_path / "killed_once.py"
    script.write_text(KILLED_ONCE)
    run = alpha_run("--nproc", 2, "--store", tmp_path / "s", "--max-restarts", 1, script, tmp_path, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    killed_at = float((tmp_path / "killed_at").read_text())
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"context-{rank}.json").read_text())
        context = seen["context"]
        assert (context["attempt"], context["failed_rank"], context["failed_exit"], context["resume"]) == \
            (1, 1, -9, "latest")
        # The kill, then the launcher's detection, then this restarted process (the kernel's start time,
        # to its 10 ms tick), then the worker reading its context.
        assert killed_at < context["detected_at"] < context["process_started_at"] < seen["read_at"]


def final(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def job(store, *flags, kill=None, cwd):
    env = dict(os.environ, **({"ALPHA_CKPT_KILL_OWNER": kill} if kill else {}))
    return alpha_run("--nproc", 2, "--store", store, *SMALL, "--timeout", 30, *flags, CONFIG, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    return final(job(tmp / "s", "--updates", 6, cwd=tmp))


@pytest.mark.timeout(300)
def test_the_job_restarts_into_the_newest_generation_without_resume_latest(tmp_path, straight):
    # Owner 1 dies after update 3 of the first attempt; the restart resumes update 2 and ends as a
    # run that never stopped, in the epoch after the first attempt's.
    restarted = final(job(tmp_path / "s", "--updates", 6, "--checkpoint-every", 2, "--max-restarts", 1,
                          kill="1:3:0", cwd=tmp_path))
    assert restarted["state_digest"] == straight["state_digest"]
    assert (restarted["update"], restarted["epoch"]) == (6, 1)


def generations(store) -> list[dict]:
    listed = launch.alpha_ckpt_cli("list", "--store", store, "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)["generations"]


@pytest.mark.timeout(400)
def test_a_restart_after_resume_from_goes_back_to_root_until_its_continuation_publishes_then_resumes_that(
        tmp_path, straight):
    store = tmp_path / "s"
    final(job(store, "--updates", 4, "--checkpoint-every", 2, cwd=tmp_path))
    at_2 = next(g["root"] for g in generations(store) if g["update"] == 2)
    # Back to update 2 (the newest is 4); killed after update 3, before the continuation published: the
    # restart resumes update 2 again, not the newest generation, and its epoch publishes 4 and 6.
    rolled_back = final(job(store, "--updates", 6, "--checkpoint-every", 2, "--resume-from", at_2,
                            "--max-restarts", 1, kill="1:3:0", cwd=tmp_path))
    assert rolled_back["state_digest"] == straight["state_digest"] and rolled_back["epoch"] == 1
    assert [g["update"] for g in generations(store) if g["epoch"] == 1] == [4, 6]
    # From update 6, killed after update 9, once the continuation published update 8: the restart
    # resumes that (ROOT is stale by then), in the epoch after it.
    at_6 = rolled_back["last_generation"]
    on = final(job(store, "--updates", 10, "--checkpoint-every", 2, "--resume-from", at_6, "--max-restarts", 1,
                   kill="1:9:0", cwd=tmp_path))
    assert (on["update"], on["epoch"]) == (10, 3)
    assert [g["update"] for g in generations(store) if g["epoch"] == 2] == [8]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_nodes_restart_together_into_the_newest_generation(tmp_path, straight):
    # Each node's launcher chooses from the same store once its ranks stopped, and both choose alike.
    port = _free_port()
    env = dict(os.environ, ALPHA_CKPT_KILL_OWNER="1:3:0")
    nodes = [launch.alpha_run_start("--nnodes", "2", "--node-rank", n, "--nproc", "1", "--rdzv-backend", "c10d",
                                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restarts",
                                    "--max-restarts", "1", "--store", tmp_path / "s", *SMALL, "--updates", "6",
                                    "--checkpoint-every", "2", "--timeout", "30", CONFIG, cwd=tmp_path, env=env)
             for n in (0, 1)]
    outs = [node.result(timeout=240) for node in nodes]
    assert [out.returncode for out in outs] == [0, 0], outs[0].stderr[-2000:] + outs[1].stderr[-2000:]
    done = json.loads(outs[0].stdout.strip().splitlines()[-1])
    assert done["state_digest"] == straight["state_digest"] and (done["update"], done["epoch"]) == (6, 1)
