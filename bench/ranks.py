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


def fork_ranks(world: int, rank_main, timeout: float, suite: str):
    """``rank_main(rank, port, out)`` on ``world`` processes forked from this one (they share its imports), gloo
    rendezvous on ``port``; what the first rank to finish puts on the queue ``out`` (rank 0, by the suites'
    convention). Killed after ``timeout`` seconds; a rank that exits with an error fails the suite."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        result = out.get(timeout=timeout)
    except Exception:
        for proc in procs:
            proc.kill()
        raise SystemExit(f"{suite}: {world} rank(s) gave no result within {timeout:g} s; exit codes "
                         f"{[proc.exitcode for proc in procs]}") from None
    for proc in procs:
        proc.join(timeout=120)
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"{suite}: rank exit codes {[proc.exitcode for proc in procs]}")
    return result


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
