"""alpha-run --memory: a rank SIGKILLed at a random step recovers from its peers' memory, bit-identical,
reading nothing from the store, whether the survivors are restarted or recover in place (--in-place);
a whole-job loss recovers from the store."""
import json
import os
import random
import signal
import subprocess
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

EXAMPLES = Path(__file__).parents[2] / "examples"
pytestmark = pytest.mark.timeout(600)


def _alpha_run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return launch.alpha_run(*args, timeout=timeout)


def _events(stderr: str, name: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                out.append(event)
    return out


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _uninterrupted_digest(once_per_run, script: list[str], nproc: int) -> str:
    """The final state's digest of a run that never failed (made once per test run, script and world size)."""
    key = "-".join([Path(script[0]).stem, *script[1:], str(nproc)])
    return once_per_run(f"memory-recovery-{key}", lambda folder: _result(
        _alpha_run("--nproc", str(nproc), "--store", str(folder / "whole"), *script))["state_sha256"])


# The 4-rank jobs are long-haul runs that CI runs with -m slow; the 2-rank one runs by default.
SLOW = pytest.mark.slow
JOBS = [("train_gpt_ddp.py", 2, 8, "--save-every"),
        pytest.param("train_gpt_ddp.py", 4, 8, "--save-every", marks=SLOW),
        pytest.param("train_fsdp2.py", 4, 8, "--every", marks=SLOW)]


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "restarted"])
@pytest.mark.parametrize("example,nproc,steps,every_flag", JOBS)
def test_a_rank_killed_at_a_random_step_recovers_from_memory_bit_identical_with_nothing_read_from_the_store(
        tmp_path, once_per_run, example, nproc, steps, every_flag, in_place):
    fail_at = random.Random(f"{example}{nproc}").randint(2, steps - 1)  # random, and the same in every run
    script = [str(EXAMPLES / example), "--steps", str(steps), every_flag, "1"]
    whole = _uninterrupted_digest(once_per_run, script, nproc)
    proc = _alpha_run("--nproc", str(nproc), "--store", str(tmp_path / "s"), "--memory", "--durable-every", "4",
                      "--max-restarts", "1", *(["--in-place"] if in_place else []), *script, "--fail-at", str(fail_at))
    recovered = _result(proc)
    assert recovered["state_sha256"] == whole
    [event] = _events(proc.stderr, "recovered")
    assert event["tier"] == "memory" and event["update"] == fail_at
    assert event["bytes_from_store"] == 0 and event["failed_rank"] == nproc - 1
    assert all(event[k] >= 0 for k in ("restart_s", "rendezvous_s", "restore_s", "first_step_s"))
    if in_place:  # the survivors rejoined within seconds, none waiting out a collective's timeout
        assert event["total_s"] < 60
    tiers = {e["update"]: e["tier"] for e in _events(proc.stderr, "checkpoint_saved")}
    assert tiers[fail_at] == ("durable" if fail_at % 4 == 1 else "memory")  # memory only, unless also durable


def test_a_whole_job_killed_with_sigkill_recovers_from_the_store(tmp_path):
    script = [str(EXAMPLES / "train_gpt_ddp.py"), "--steps", "9", "--save-every", "1"]
    whole = _result(_alpha_run("--nproc", "2", "--store", str(tmp_path / "whole"), *script))
    store = str(tmp_path / "s")
    launcher = launch.alpha_run_start("--nproc", "2", "--store", store, "--memory", "--durable-every", "3", *script,
                                      new_session=True)
    try:  # kill everything once update 5 is held in memory (4 went to the store)
        launch.wait_until(lambda: [e for e in _events(launcher.output()[1], "checkpoint_saved") if e["update"] >= 5],
                          timeout=300, what="update 5 saved", every=0.01)
        os.killpg(launcher.pid, signal.SIGKILL)
    finally:
        launcher.wait(timeout=60)
    proc = _alpha_run("--nproc", "2", "--store", store, "--memory", "--durable-every", "3", *script)
    resumed = _result(proc)
    [restored] = _events(proc.stderr, "restored")
    assert restored["update"] >= 4 and restored["update"] % 3 == 1  # the store's newest: a durable save
    assert restored["bytes_read"] > 0
    assert resumed["state_sha256"] == whole["state_sha256"]
