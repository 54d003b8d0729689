"""Rank processes of the owners and checkpointer sections: one fresh interpreter runs the entry point
with ``--owner-process``, forks the other ranks and writes rank 0's result file."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import alpha_ckpt
from .record import REPO_ROOT



def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(args: argparse.Namespace, config: dict, section: str, result_name: str) -> dict:
    """Run ``config['world']`` rank processes of ``section`` (owners or checkpointer); return rank 0's result file."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(alpha_ckpt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # One fresh interpreter imports torch once and forks the other ranks (starting each with
    # spawn would import torch once per rank: seconds each on this machine).
    config = {**config, "section": section}
    proc = subprocess.Popen([sys.executable, "-m", "bench.save_restore", "--owner-process", json.dumps(config)], env=env)
    try:
        code = proc.wait(timeout=args.owners_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit(f"{section} section failed: the ranks did not finish within {args.owners_timeout:g} s") from None
    if code:
        raise SystemExit(f"{section} section failed: the rank processes exited with {code}")
    with open(os.path.join(config["dir"], result_name)) as f:
        return json.load(f)
