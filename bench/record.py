"""What every benchmark record carries besides its figures: the code measured and the machine that measured it.

A ratio means little without both, and a result file read months later has nothing else to go on.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess

import alpha_ckpt

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_under_test() -> dict:
    """Which alpha_ckpt was measured: its git commit, the uncommitted files under alpha_ckpt/ and a digest of
    every one of its Python sources (which names the code even outside a git checkout)."""
    pkg = os.path.dirname(os.path.abspath(alpha_ckpt.__file__))
    h = hashlib.sha256()
    for directory, dirs, names in os.walk(pkg):
        dirs.sort()
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                h.update(os.path.relpath(path, pkg).encode() + b"\0" + f.read() + b"\0")
    info = {"version": alpha_ckpt.__version__, "source_sha256": h.hexdigest()[:16], "commit": None, "dirty": None}
    try:
        git = ["git", "-C", os.path.dirname(pkg)]
        info["commit"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--", pkg], capture_output=True, text=True,
                               check=True).stdout.split("\n")
        info["dirty"] = sorted(line[3:] for line in dirty if line.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def machine() -> dict:
    """The machine and the software stack under the figures."""
    import torch  # the suites import it anyway; imported here so record stays cheap to import

    info = {"host": platform.node(), "system": platform.platform(), "processor": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def record(suites: list[str], argv: list[str], started: datetime.datetime, seconds: float, result) -> dict:
    """One machine-readable record of a run: what ran, with which options, on what code and machine, and its figures."""
    return {"bench": suites, "argv": argv, "started_utc": started.isoformat(timespec="seconds"),
            "seconds": round(seconds, 3), "code": code_under_test(), "machine": machine(), "result": result}
