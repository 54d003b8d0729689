"""The memory tier in front of an S3 store (a real server, SeaweedFS): memory every save, S3 every third; a
restart recovers the newest generation from memory first, reading nothing from S3, and falls back to
S3's newest when the memory is gone. Both end bit-identical to a run that never stopped."""
import os
import shutil

import pytest

from ranks import run_ranks
from test_memory_tier import resume, save_steps, straight

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _with(env: dict, fn, rank: int, world: int, *args):
    os.environ.update(env)  # a rank comes from the fork server, not from this test's environment
    return fn(rank, world, *args)


def s3_save_steps(rank, world, env, *args):
    return _with(env, save_steps, rank, world, *args)


def s3_resume(rank, world, env, *args):
    return _with(env, resume, rank, world, *args)


def test_memory_saves_in_front_of_s3_recover_from_memory_first_then_from_s3(tmp_path, s3_server, s3_store):
    env = s3_server.environment()
    memory = tmp_path / "memory"
    saved = run_ranks(2, s3_save_steps, env, s3_store, str(memory), 5, 3, tmp=tmp_path, timeout=240)
    assert [s["tier"] for s in saved[0]["saves"]] == ["durable", "memory", "memory", "durable", "memory"]
    reference = run_ranks(2, straight, 8, tmp=tmp_path)

    from_memory = run_ranks(2, s3_resume, env, s3_store, str(memory), 8, tmp=tmp_path, timeout=240)
    for r in range(2):
        assert from_memory[r]["tier"] == "memory" and from_memory[r]["update"] == 5
        assert from_memory[r]["from_store"] == 0
        assert saved[r]["losses"] + from_memory[r]["losses"] == reference[r]["losses"]
        assert from_memory[r]["digest"] == reference[r]["digest"]

    shutil.rmtree(memory)  # the node's memory is gone: S3's newest generation (update 4) it is
    from_s3 = run_ranks(2, s3_resume, env, s3_store, str(memory), 8, tmp=tmp_path, timeout=240)
    for r in range(2):
        assert from_s3[r]["tier"] == "durable" and from_s3[r]["update"] == 4 and from_s3[r]["from_store"] > 0
        assert saved[r]["losses"][:4] + from_s3[r]["losses"] == reference[r]["losses"]
        assert from_s3[r]["digest"] == reference[r]["digest"]
