"""examples/train_resnet_bn_ddp.py (DDP, BatchNorm, an EMA model, a StatefulDataLoader with its default
generator, per_rank= patterns) killed at a random step and resumed under alpha-run."""
import json
import os
import random
import signal
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_resnet_bn_ddp.py"
STEPS = 20


def alpha_run(*args, cwd, timeout=240):
    return launch.alpha_run(*args, cwd=cwd, timeout=timeout)


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
    job = launch.alpha_run_start("--nproc", "2", "--store", store, EXAMPLE, "--steps", STEPS, cwd=tmp_path,
                                 new_session=True)
    refs = store / "refs" / "train-resnet-bn-ddp" / "train"
    launch.wait_until(lambda: len(list(refs.glob("*")) if refs.exists() else []) >= kill_after, timeout=200,
                      what=f"{kill_after} generations published", every=0.005)
    os.killpg(job.pid, signal.SIGKILL)  # the whole job, mid-step
    assert job.wait(30) == -signal.SIGKILL
    assert kill_after <= len(list(refs.glob("*"))) < STEPS  # killed before the end

    resumed = alpha_run("--nproc", 2, "--store", store, "--resume", "latest", EXAMPLE, "--steps", STEPS,
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _last_json(resumed.stdout) == expected  # every rank's tensors and values, every rank's losses
