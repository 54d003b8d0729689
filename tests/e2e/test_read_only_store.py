"""A store that cannot be written is refused before any owner trains: exit 2, one line naming the store."""
import json
import subprocess
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch
from test_job import store_hash

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]


def alpha_run(store, *args, timeout=120):
    return launch.alpha_run("--nproc", "1", "--store", store, *SMALL, *args, CONFIG, timeout=timeout)


@pytest.fixture
def mount_point(mount_tmpfs):
    """A tmpfs of our own, to be remounted read-only."""
    return mount_tmpfs("64m")


@pytest.mark.timeout(300)
def test_resuming_on_a_read_only_mount_exits_2_before_any_owner_trains(mount_point):
    store = mount_point / "store"
    first = alpha_run(store, "--updates", "1", "--checkpoint-every", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    root = json.loads(first.stdout.strip().splitlines()[-1])["last_generation"]
    subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True, capture_output=True, timeout=30)
    before = store_hash(store)
    for resume in (["--resume-from", root], ["--resume", "latest"], []):
        proc = launch.alpha_run_checks("--nproc", "1", "--store", store, *SMALL, "--updates", "2", *resume, CONFIG)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert len(proc.stderr.splitlines()) == 1 and str(store) in proc.stderr, proc.stderr[-3000:]
        assert proc.stdout == ""
    assert store_hash(store) == before
