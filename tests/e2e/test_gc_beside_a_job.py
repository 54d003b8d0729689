"""gc beside a running job: `alpha-ckpt gc --keep 2 --grace 0` in a tight loop never breaks a generation."""
import io
import json
import time
from pathlib import Path

import pytest

from alpha_ckpt.launch import cli
from alpha_ckpt.store.leases import CLOCK_SLACK_S
from alpha_ckpt.store import RefRecord, Store
from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]
UPDATES = 40  # a checkpoint each: with gc competing for the two cores, several seconds of publishing


def _job(store, *args):
    # Its output goes to files, not pipes: hundreds of "committed" lines would fill a pipe nobody reads meanwhile.
    return launch.alpha_run_start("--nproc", "2", "--store", store, *SMALL, *args, CONFIG)


def _gc_pass(store) -> tuple[int, dict | None]:
    out = io.StringIO()
    code = cli.main(["gc", "--store", str(store), "--keep", "2", "--grace", "0", "--json"], out=out)
    return code, json.loads(out.getvalue()) if code == 0 else None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("publisher", [pytest.param("star", marks=pytest.mark.full), "tree"])
def test_gc_looping_beside_a_publishing_job_keeps_every_generation_whole(tmp_path, publisher):
    store = tmp_path / "store"
    job = _job(store, "--updates", str(UPDATES), "--checkpoint-every", "1", "--publisher", publisher)
    passes, removed_refs, removed_objects, beside_a_publish = 0, 0, 0, 0
    try:
        while job.poll() is None:
            if not (store / "objects").exists():
                time.sleep(0.05)  # the job has not created its store yet
                continue
            code, report = _gc_pass(store)
            assert code == 0
            passes += 1
            removed_refs += len(report["refs"])
            removed_objects += report["objects"]
            beside_a_publish += report["live_leases"] > 0
    finally:
        if job.poll() is None:
            job.kill()
    done = job.result(timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    final = launch.last_json(done.stdout)
    # gc really ran against the live job: it removed generations, some passes while a publish was pending.
    assert removed_refs > 0 and beside_a_publish > 0, (passes, removed_refs, beside_a_publish)

    # The objects of dropped generations go once they are older than gc's clock slack; a fast job can
    # finish within it, so passes go on until one finds them (and every kept generation stays whole).
    def objects_removed():
        nonlocal removed_objects
        code, report = _gc_pass(store)
        assert code == 0
        removed_objects += report["objects"]
        return removed_objects > 0
    launch.wait_until(objects_removed, timeout=CLOCK_SLACK_S + 30, what="a dropped generation's objects removed",
                      every=0.1)

    with Store(store, create=False) as s:
        records = s.list_refs("nightly", "fit")
    assert all(isinstance(r, RefRecord) for r in records)
    assert records[-1].root == final["last_generation"] and records[-1].prefix.update == UPDATES
    for record in records:
        out = io.StringIO()
        assert cli.main(["verify", "--store", str(store), record.root], out=out) == 0, out.getvalue()

    resumed = launch.alpha_run("--nproc", "2", "--store", store, *SMALL, "--updates", UPDATES + 1, "--resume", "latest",
                               "--publisher", publisher, CONFIG, timeout=100)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["update"] == UPDATES + 1
