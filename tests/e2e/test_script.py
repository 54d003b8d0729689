"""alpha-run launching a user's own training script (examples/train_gpt_ddp.py) and resuming it."""
import json
import os
import signal
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt_ddp.py"


def alpha_run(*args, cwd, timeout=240):
    return launch.alpha_run(*args, cwd=cwd, timeout=timeout)


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def straight(once_per_run):
    """12 steps that never stopped, and the store they saved into (tests only read it)."""
    def make(folder):
        run = alpha_run("--nproc", 2, "--store", folder / "a", EXAMPLE, "--steps", 12, cwd=folder)
        assert run.returncode == 0, run.stderr[-2000:]
        return [str(folder / "a"), _last_json(run.stdout)]
    store, result = once_per_run("script-straight", make)
    return Path(store), result


@pytest.mark.timeout(400)
@pytest.mark.parametrize("publisher,save", [("star", "sync"), ("tree", "async"),
                                            pytest.param("star", "async", marks=pytest.mark.full),
                                            pytest.param("tree", "sync", marks=pytest.mark.full)])
def test_a_killed_script_resumed_latest_ends_equal_to_one_that_never_stopped(tmp_path, straight, publisher, save):
    store = tmp_path / "b"
    how = ["--publisher", publisher, "--save", save]
    job = launch.alpha_run_start("--nproc", "2", "--store", store, *how, EXAMPLE, "--steps", "12", cwd=tmp_path,
                                 new_session=True)
    refs = store / "refs" / "train-gpt-ddp" / "train"
    launch.wait_until(lambda: len(list(refs.glob("*")) if refs.exists() else []) >= 3, timeout=200,
                      what="generation 3 (update 6's checkpoint)")
    os.killpg(job.pid, signal.SIGKILL)  # the whole job, as a node agent does
    assert job.wait(30) == -signal.SIGKILL
    resumed = alpha_run("--nproc", 2, "--store", store, *how, "--resume", "latest", EXAMPLE, "--steps", 12,
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _last_json(resumed.stdout) == straight[1]
    from alpha_ckpt.generation.reader import open_generation
    from alpha_ckpt.store import Store
    with Store(store, create=False) as s:
        newest = s.newest_ref("train-gpt-ddp", "train")
        with open_generation(s, newest.root, role=0, wanted=[]) as g:
            assert g.manifest.publisher.kind == publisher


@pytest.mark.timeout(300)
def test_scripts_exit_3_on_a_refusal_and_2_on_usage_errors(tmp_path, straight):
    store = straight[0]
    # Exit codes for scripts, as for the job: a refusal 3 (a generation that is not one of this run's),
    # usage errors 2, whether alpha-run finds them (no such script) or the script's own parser does.
    assert alpha_run("--nproc", 2, "--store", store, "--resume-from", "0" * 64, EXAMPLE, "--steps", 12,
                     cwd=tmp_path).returncode == 3
    assert launch.alpha_run_checks("--nproc", 2, "--store", store, tmp_path / "missing.py").returncode == 2
    assert alpha_run("--nproc", 2, "--store", store, "--resume", "latest", EXAMPLE, "--steps", "x",
                     cwd=tmp_path).returncode == 2
    assert launch.alpha_run_checks("--nproc", 2, "--store", store, "--updates", 3, EXAMPLE).returncode == 2
    assert launch.alpha_run_checks("--nproc", 2, "--store", store, "--fanout", 0, EXAMPLE).returncode == 2
