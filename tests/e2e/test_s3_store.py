"""The resume tests once more with the store on S3 (a real server, SeaweedFS): a DDP script killed and
resumed under alpha-run, the FSDP2 examples resharded on resume (the Checkpointer, and DCP with our
storage), and the built-in job against its oracle. Every one ends bit-identical to a run that never
stopped. Slow: CI runs them with -m slow (docs/TESTING.md)."""
import os
import signal
from pathlib import Path

import pytest

from alpha_ckpt.store.layout import ref_name
from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIG = str(ROOT / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _ok(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return launch.last_json(proc.stdout)


def _copy_store(server, url: str, to: str) -> str:
    """Every key of the store at ``url`` copied under ``to`` (a store is its keys: a second store at that
    generation)."""
    client = server.client()
    bucket, prefix = url[len("s3://"):].split("/", 1)
    target = to[len("s3://"):].split("/", 1)[1]
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            client.copy_object(Bucket=bucket, Key=target + item["Key"][len(prefix):],
                               CopySource={"Bucket": bucket, "Key": item["Key"]})
    return to


def _exists(client, bucket: str, key: str) -> bool:
    """One HEAD on a client made once: a poll quicker than a save (else the job may end before it is killed)."""
    try:
        client.head_object(Bucket=bucket, Key=key)
        return True
    except Exception:
        return False


def test_a_ddp_script_killed_and_resumed_on_s3_ends_as_one_that_never_stopped(tmp_path, s3_server, s3_store):
    example = EXAMPLES / "train_gpt_ddp.py"
    straight = _ok(launch.alpha_run("--nproc", 2, "--store", tmp_path / "posix", example, "--steps", 12, cwd=tmp_path))
    job = launch.alpha_run_start("--nproc", "2", "--store", s3_store, example, "--steps", "12", cwd=tmp_path,
                                 new_session=True)
    client = s3_server.client()
    bucket, _, prefix = s3_store[len("s3://"):].partition("/")
    ref_3 = f"{prefix}/refs/train-gpt-ddp/train/{ref_name(3)}"
    launch.wait_until(lambda: _exists(client, bucket, ref_3), timeout=300, what="generation 3 on S3")
    os.killpg(job.pid, signal.SIGKILL)  # the whole job, as a node agent does
    assert job.wait(30) == -signal.SIGKILL
    resumed = _ok(launch.alpha_run("--nproc", 2, "--store", s3_store, "--resume", "latest", example, "--steps", 12,
                                   cwd=tmp_path))
    assert resumed == straight
    latest = launch.alpha_ckpt_cli("latest", "--store", s3_store, "--run", "train-gpt-ddp", "--step", "train")
    assert latest.returncode == 0, latest.stderr
    verify = launch.alpha_ckpt_cli("verify", "--store", s3_store, latest.stdout.strip())
    assert verify.returncode == 0, verify.stderr


@pytest.mark.parametrize("example", ["train_fsdp2.py", "train_fsdp2_dcp_backend.py"])
def test_the_fsdp2_examples_resume_resharded_from_s3(tmp_path, s3_server, s3_store, example):
    def run(store, nproc, steps, resume=()):
        return _ok(launch.alpha_run("--nproc", nproc, "--store", store, *resume, EXAMPLES / example, "--steps", steps,
                                    timeout=300))
    whole = run(tmp_path / "posix", 2, 8)
    first = run(s3_store, 2, 4)
    resume = ("--resume", "latest") if example == "train_fsdp2.py" else ()
    # the 2-rank generation of step 4, copied to one store per world it is resharded to
    copies = {nproc: _copy_store(s3_server, s3_store, f"{s3_store}-to{nproc}") for nproc in (1, 3, 4)}
    resumed = run(s3_store, 2, 8, resume)
    assert resumed["state_sha256"] == whole["state_sha256"]
    assert first["losses"] + resumed["losses"] == whole["losses"]
    for nproc, store in copies.items():  # resharded 2 -> 1, 3, 4: resumed at step 4, on to 6
        more = run(store, nproc, 6, resume)
        assert more["step"] == 6 and len(more["losses"]) == 2, nproc
        assert more["losses"][0] == pytest.approx(whole["losses"][4], rel=1e-4), nproc


def test_the_built_in_job_on_s3_matches_its_oracle_and_publishes_its_output_there(tmp_path, s3_store):
    def job(*args):
        return _ok(launch.alpha_run("--nproc", 2, "--store", s3_store, *SMALL, *args, CONFIG, timeout=300))
    first = job("--updates", "2", "--checkpoint-every", "2")
    resumed = job("--updates", "3", "--resume", "latest")
    assert resumed["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "3", "--placements", "2", *SMALL)
    assert resumed["update"] == 3 and first["update"] == 2
    assert resumed["output"].startswith(s3_store + "/outputs/")
