"""Write tests/stores/format1/: stores as format version 1 writes them, kept so that every later
version is tested against them (tests/e2e/test_old_stores.py). Run once per format version, from
the repository root: ``python tests/stores/make_format1.py``; never regenerate an existing one."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import old_state  # noqa: E402

import alpha_ckpt  # noqa: E402
from alpha_ckpt.dcp import StorageWriter  # noqa: E402
from alpha_ckpt.testing.launch import job_argv

CONFIG = str(HERE.parents[1] / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]


def job(store: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "alpha_ckpt.launch.launcher",
           *job_argv(["--nproc", "2", "--store", str(store), *SMALL, *args, CONFIG])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    out = HERE / "format1"
    if out.exists():
        raise SystemExit(f"{out} exists: a written format's stores are never regenerated")
    expected = {"format_version": 1, "alpha_ckpt": alpha_ckpt.__version__, "torch": torch.__version__}
    # The forecasting job: 3 updates with a generation every 2 (updates 2 and 3), 2 owners.
    first = job(out / "job", "--updates", "3", "--checkpoint-every", "2")
    shutil.rmtree(out / "job" / "outputs")
    scratch = HERE / "scratch-uninterrupted"
    straight = job(scratch, "--updates", "5", "--checkpoint-every", "2")
    shutil.rmtree(scratch)
    expected["job"] = {"updates_3": {k: first[k] for k in ("state_digest", "last_generation", "update", "cursor")},
                       "updates_5": {k: straight[k] for k in ("state_digest", "update", "cursor")}}
    # The one-process API: every kind of value a state may hold.
    root = alpha_ckpt.save(old_state.state(), store=out / "state", run="old", step="s", update=7, cursor=70, epoch=0)
    expected["state"] = {"root": root, "bits": old_state.bits_digest(old_state.state())}
    # DCP with alpha_ckpt's storage backend, one process.
    dcp.save(old_state.dcp_state(), storage_writer=StorageWriter(out / "dcp", run="old", update=1))
    expected["dcp"] = {"root": alpha_ckpt.latest(out / "dcp", "old", "train"),
                       "bits": old_state.bits_digest(old_state.dcp_state())}
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
