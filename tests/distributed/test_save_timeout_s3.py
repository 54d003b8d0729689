"""save_timeout on an S3 store (a real server, SeaweedFS, behind a proxy that holds the part uploads): a save
whose upload stalls fails on every rank within the bound, the stalled upload is aborted, and nothing of
the failed save is resumable; the next save, with the server well again, publishes."""
import os
import time

import pytest

import alpha_ckpt
from alpha_ckpt import Checkpointer
from alpha_ckpt.testing.s3_proxy import Fault, S3Proxy
from ranks import run_ranks
from test_checkpointer import IDENTITY, MASKS, Script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BOUND_S = 3.0


def stalled_save(rank, world, env, url):
    os.environ.update(env)  # a rank comes from the fork server, not from this test's environment
    script = Script(rank, world)
    ckpt = Checkpointer(url, run="r", identity=IDENTITY, allow_nonfinite=MASKS, save_timeout=BOUND_S)
    ckpt.restore(script.state(), root=None)
    script.train(1)
    started = time.monotonic()
    try:
        ckpt.save(script.state(), update=1, cursor=4 * world)
        return {"saved": True}
    except Exception as exc:  # noqa: BLE001 - what each rank is told
        return {"saved": False, "error": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - started}


def test_a_stalled_upload_fails_the_save_on_every_rank_within_save_timeout(tmp_path, s3_server, s3_store,
                                                                          monkeypatch):
    config = tmp_path / "aws-config"  # objects above 64 KiB go in parts: every rank's shard is a multipart upload
    config.write_text("[default]\ns3 =\n  multipart_threshold = 64KB\n  multipart_chunksize = 5MB\n")
    with S3Proxy(s3_server.endpoint) as proxy:
        env = {**s3_server.environment(), "AWS_ENDPOINT_URL": proxy.endpoint, "AWS_CONFIG_FILE": str(config)}
        held = proxy.inject(Fault("stall", method="PUT", key_contains="/objects/", seconds=60, times=1))
        results = run_ranks(2, stalled_save, env, s3_store, tmp=tmp_path, timeout=240)
        assert held.hits == 1
        for r in results:
            assert not r["saved"] and r["seconds"] < BOUND_S + 20, r  # the stall lasts 60 s
        for r in results:  # every rank is told which rank failed, on which object, and why
            assert r["error"] == "PublishFailed" and "rank " in r["message"] and "/objects/" in r["message"] \
                and "deadline" in r["message"], r
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert alpha_ckpt.latest(s3_store, "r", "train") is None  # nothing of it is resumable
        client = s3_server.client()
        bucket, prefix = s3_store[len("s3://"):].split("/", 1)
        assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
