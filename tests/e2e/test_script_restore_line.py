"""alpha-run says in one line what a script restored (update, root, bytes read) or that it starts fresh;
with neither --resume nor --resume-from a script resumes the newest generation."""
import json

import pytest

from alpha_ckpt.testing import launch

SCRIPT = """
import sys
import torch
import torch.distributed as dist
from alpha_ckpt import Checkpointer

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(32, 32)
ckpt = Checkpointer.from_launcher_env()
counters = ckpt.restore({"model": model})
start = counters.update if counters else 0
ckpt.save({"model": model}, update=start + 1)
ckpt.close()
dist.destroy_process_group()
"""


def _events(stderr: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return [e for e in out if e.get("event") in ("restored", "fresh_start")]


def alpha_run(*args, cwd):
    return launch.alpha_run(*args, cwd=cwd, timeout=180)


@pytest.mark.timeout(400)
def test_alpha_run_reports_a_fresh_start_and_then_the_update_root_and_bytes_a_script_restored(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    store = tmp_path / "s"
    fresh = alpha_run("--nproc", 2, "--store", store, script, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert [e["event"] for e in _events(fresh.stderr)] == ["fresh_start"]
    resumed = alpha_run("--nproc", 2, "--store", store, "--resume", "latest", script, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    [event] = _events(resumed.stderr)
    assert event["event"] == "restored" and event["update"] == 1 and event["run"] == "tiny"
    assert len(event["root"]) == 64 and event["bytes_read"] >= (32 * 32 + 32) * 4  # the weights, read by some rank
    # Neither flag: the newest generation, as --resume latest (and as under torchrun).
    again = alpha_run("--nproc", 2, "--store", store, script, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    [event] = _events(again.stderr)
    assert event["event"] == "restored" and event["update"] == 2
