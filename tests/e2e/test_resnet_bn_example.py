"""examples/train_resnet_bn_ddp.py (DDP, BatchNorm, an EMA model, a StatefulDataLoader with its default
generator, per_rank= patterns) killed at a random step and resumed under alpha-run."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_resnet_bn_ddp.py"
STEPS = 20


def alpha_run(*args, cwd, timeout=240):
    return subprocess.run([sys.executable, "-m", "alpha_ckpt.launcher", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_a_ddp_batchnorm_ema_script_killed_at_a_random_step_resumes_bit_identical(tmp_path):
    straight = alpha_run("--nproc", 2, "--store", tmp_path / "a", EXAMPLE, "--steps", STEPS, cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]
    expected = _last_json(straight.stdout)
    assert expected["step"] == STEPS and expected["state_sha256"][0] != expected["state_sha256"][1]

    store = tmp_path / "b"
    kill_after = random.Random(37).randint(3, STEPS - 3)  # generations published before the kill
    job = subprocess.Popen([sys.executable, "-m", "alpha_ckpt.launcher", "--nproc", "2", "--store", str(store),
                            str(EXAMPLE), "--steps", str(STEPS)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    refs = store / "refs" / "train-resnet-bn-ddp" / "train"
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and len(list(refs.glob("*")) if refs.exists() else []) < kill_after:
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)  # the whole job, mid-step
    job.wait(30)
    assert job.returncode == -signal.SIGKILL
    assert kill_after <= len(list(refs.glob("*"))) < STEPS  # killed before the end

    resumed = alpha_run("--nproc", 2, "--store", store, "--resume", "latest", EXAMPLE, "--steps", STEPS,
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _last_json(resumed.stdout) == expected  # every rank's tensors and values, every rank's losses
