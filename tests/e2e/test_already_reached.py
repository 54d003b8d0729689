"""A resume whose generation is at --updates already trains nothing, publishes nothing and exits 0."""
import json
import os
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch
from test_job import store_hash

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]


def alpha_run(cwd, *args):
    # --store is relative: the output path printed must be absolute all the same.
    return launch.alpha_run("--nproc", "2", "--store", "store", *SMALL, *args, CONFIG, cwd=cwd, timeout=240)


def final(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(400)
def test_a_resume_at_or_past_updates_exits_0_naming_that_generation_without_training_or_publishing(tmp_path):
    first = final(alpha_run(tmp_path, "--updates", "2", "--checkpoint-every", "2"))
    assert os.path.isabs(first["output"]) and os.path.isfile(first["output"])
    store = tmp_path / "store"
    before = store_hash(store)
    for args in (["--updates", "2", "--resume-from", first["last_generation"]], ["--updates", "1", "--resume", "latest"]):
        again = final(alpha_run(tmp_path, *args))
        # The same generation and state, reported as they were published: no continuation ran.
        assert {k: again[k] for k in ("last_generation", "state_digest", "update", "cursor", "epoch", "output")} == \
            {k: first[k] for k in ("last_generation", "state_digest", "update", "cursor", "epoch", "output")}
        assert store_hash(store) == before  # no generation, no output, nothing written
