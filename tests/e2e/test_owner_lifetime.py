"""Owners die with their launcher, however it dies, and the job still resumes to the uninterrupted state."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alpha_ckpt.lifeline import OUTLIVE_BOUND_S

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]
UPDATES = 120


def owners_of(store: Path) -> list[int]:
    """Live owner processes of this store (a zombie's cmdline is empty, so it does not count)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"alpha_ckpt.worker" in cmdline and str(store).encode() in cmdline:
            pids.append(int(pid))
    return pids


def generations(store: Path) -> list[Path]:
    return list((store / "refs").glob("*/*/*"))


def launch(store: Path) -> subprocess.Popen:
    # Until --resume latest starts fresh on an empty run/step, a round resumes only what exists.
    resume = ["--resume", "latest"] if generations(store) else []
    cmd = [sys.executable, "-m", "alpha_ckpt.launcher", "--nproc", "2", "--store", str(store), *SMALL,
           "--updates", str(UPDATES), "--checkpoint-every", "1", *resume, CONFIG]
    # A session of its own, so the whole launcher process group can be SIGKILLed at once.
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kill_group_and_time_the_owners(proc: subprocess.Popen, store: Path) -> tuple[bool, float]:
    """SIGKILL the launcher's process group; (owners were alive, seconds until none was)."""
    alive = bool(owners_of(store))
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait(timeout=30)
    while owners_of(store) and time.monotonic() - killed < OUTLIVE_BOUND_S:
        time.sleep(0.01)
    return alive, time.monotonic() - killed


@pytest.mark.timeout(240)
def test_owners_die_within_the_bound_after_their_launcher_is_sigkilled_and_resume_latest_finishes_the_same_state(
        tmp_path):
    rng = random.Random(20261129)
    store = tmp_path / "store"
    outlived, hit_live_owners = [], []
    try:
        for round_ in range(3):
            proc = launch(store)
            try:
                if round_ == 0:
                    # The first kill comes while the owners train and publish: once a generation is
                    # committed (so the later rounds have one to resume), at a random moment after.
                    deadline = time.monotonic() + 120
                    while not generations(store) and time.monotonic() < deadline and proc.poll() is None:
                        time.sleep(0.02)
                    assert generations(store), "no generation was committed"
                    time.sleep(rng.uniform(0.0, 1.0))
                elif round_ == 1:
                    # While the owners start up (importing torch takes them seconds): the kill can
                    # come before an owner could ask to die with its launcher.
                    deadline = time.monotonic() + 120
                    while not owners_of(store) and time.monotonic() < deadline and proc.poll() is None:
                        time.sleep(0.005)
                    time.sleep(rng.uniform(0.0, 0.5))
                else:
                    # Any moment from the launch on: before the owners exist, while they start, or train.
                    time.sleep(rng.uniform(0.5, 4.0))
                assert proc.poll() is None, "the job finished before it could be killed"
                alive, seconds = kill_group_and_time_the_owners(proc, store)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
            hit_live_owners.append(alive)
            outlived.append(seconds)
            assert owners_of(store) == [], f"owners outlived their launcher by more than {OUTLIVE_BOUND_S} s"
        assert hit_live_owners[0] and hit_live_owners[1], "the first two kills must find owners running"
        print(f"owners outlived their launcher by {[round(s, 3) for s in outlived]} s "
              f"(owners alive at the kill: {hit_live_owners})")
    finally:
        for pid in owners_of(store):  # only if the assertion above failed: leave nothing running
            os.kill(pid, signal.SIGKILL)

    resumed = subprocess.run([sys.executable, "-m", "alpha_ckpt.launcher", "--nproc", "2", "--store", str(store),
                              *SMALL, "--updates", str(UPDATES), "--checkpoint-every", "1", "--resume", "latest",
                              CONFIG], capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    oracle = subprocess.run([sys.executable, "-m", "alpha_ckpt.oracle", CONFIG, "--updates", str(UPDATES),
                             "--placements", "2", *SMALL], capture_output=True, text=True, timeout=120)
    assert oracle.returncode == 0, oracle.stderr[-2000:]
    result = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert result["update"] == UPDATES
    assert result["state_digest"] == json.loads(oracle.stdout)["state_digest"]
