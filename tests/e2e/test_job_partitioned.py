"""The built-in job with partitioned parameters on more owners than a region has words: it resumes."""
import json
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "forecast.toml")
# The smallest job that still gives an owner an empty share: b2 has horizon_days = 3 words, 4 owners.
SMALL = ["--set", "batch=24", "--set", "hidden=16", "--set", "stores=2", "--set", "items=4",
         "--set", "horizon_days=3", "--set", "parameters=partitioned"]


def alpha_run(store, *args):
    return launch.alpha_run("--nproc", "4", "--store", store, *SMALL, *args, CONFIG, timeout=240)


def final(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(400)
def test_the_partitioned_job_on_more_owners_than_a_region_has_words_resumes_latest_to_the_oracle(tmp_path):
    store = tmp_path / "store"
    first = final(alpha_run(store, "--updates", "1", "--checkpoint-every", "1"))
    resumed = final(alpha_run(store, "--updates", "2", "--resume", "latest"))
    assert (resumed["update"], resumed["epoch"], resumed["owners"]) == (2, 1, 4)
    assert resumed["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "2", "--placements", "4", *SMALL)
    assert first["last_generation"] != resumed["last_generation"]
