"""Run a function on N gloo ranks (processes from a fork server, a file rendezvous); collect their JSON results.

A rank's result is what the function returns (JSON), or ``{"refusal": code, "message": ...}``
when it raises a Refusal; any other exception fails the run with its traceback.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import traceback
import uuid
from datetime import timedelta
from pathlib import Path


def _rank_main(fn, args, rank: int, world: int, rendezvous: str, out: str, pg_timeout: float = 60.0) -> None:
    import torch.distributed as dist
    from alpha_ckpt import Refusal
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        # A file rendezvous: no port to race for with tests running beside this one.
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        try:
            result = fn(rank, world, *args)
        except Refusal as refusal:
            result = {"refusal": refusal.code.value, "message": refusal.message}
        dist.barrier()
        dist.destroy_process_group()
        Path(out).write_text(json.dumps(result))
        os._exit(0)
    except BaseException:  # noqa: BLE001 - reported to the parent
        Path(out).write_text(json.dumps({"crash": traceback.format_exc()}))
        os._exit(1)


def run_ranks(world: int, fn, *args, tmp: Path, timeout: float = 120.0, pg_timeout: float = 60.0) -> list:
    """Every rank's result, in rank order. ``pg_timeout``: how long a collective waits for a missing rank."""
    # Not fork: a test process has live threads (torch's intra-op pool, thread pools of earlier tests), and a
    # forked child can inherit one of their locks held, and hang. The fork server is a clean process that
    # imported torch once; its children start in milliseconds.
    ctx = multiprocessing.get_context("forkserver")
    # DTensor's first from_local imports torch._dynamo (most of a second): once here, not in every child.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
                                "alpha_ckpt", "alpha_ckpt.collective"])
    run = uuid.uuid4().hex[:12]
    rendezvous = str(tmp / f"rendezvous-{run}")
    outs = [str(tmp / f"rank{r}-{run}.json") for r in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, world, rendezvous, outs[r], pg_timeout)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} ranks still running after {timeout} s"
    results = [json.loads(Path(o).read_text()) for o in outs]
    crashes = [r["crash"] for r in results if isinstance(r, dict) and "crash" in r]
    assert not crashes, crashes[0]
    return results
