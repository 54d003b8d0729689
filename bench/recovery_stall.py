"""The stall section of the recovery benchmark (``python -m bench recovery``): one rank of a torchrun job.

The model of bench/recovery_train.py under DDP, trained step by step; after each step one
checkpoint method saves the state, the methods taking turns in a balanced order. The stall is the
time the training loop is blocked: inside the save call (an asynchronous save returns once its
snapshot is taken). Then, untimed, the save is drained so that saves never pile up. Rank 0 writes
one JSON object to ``--out``: every stall per method and rank, and the memory the tier holds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # torchrun runs this file by path

import alpha_ckpt  # noqa: E402
from bench.common import balanced_orders  # noqa: E402
from bench.recovery_train import BATCH, CONTEXT, GPT, VOCAB, width_for  # noqa: E402

STALL_METHODS = ("memory", "memory-async", "ours-async", "dcp-async")


def tree_bytes(path: str) -> int:
    total = 0
    for where, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(where, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--memory-dir", required=True)
    parser.add_argument("--params", type=float, default=2e6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--methods", default=",".join(STALL_METHODS),
                        help="a subset of " + ",".join(STALL_METHODS) + " (each memory method's tier holds two "
                             "generations in /dev/shm: at 100M parameters both at once need more than 23 GiB)")
    args = parser.parse_args()
    methods = tuple(m for m in STALL_METHODS if m in args.methods.split(","))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(width_for(args.params)))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
    gen = torch.Generator().manual_seed(rank)

    def train_step() -> None:
        seq = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=gen)
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()

    train_step()  # the optimizer's moments exist: the state is the full one
    state = {"model": model, "optim": optim, "sched": sched}
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in optim.state_dict()["state"].values() for v in s.values()
        if torch.is_tensor(v))

    def checkpointer(name: str, **options) -> alpha_ckpt.Checkpointer:
        return alpha_ckpt.Checkpointer(os.path.join(args.dir, name), run="bench", step="stall",
                                       identity={"model": "gpt-bench"}, **options)

    # the first save of the memory tier goes to the store too (the warm-up below takes it)
    memory = checkpointer("memory", memory=os.path.join(args.memory_dir, "sync"), durable_every=1_000_000) \
        if "memory" in methods else None
    memory_async = checkpointer("memory-async", memory=os.path.join(args.memory_dir, "async"),
                                durable_every=1_000_000, save="async") if "memory-async" in methods else None
    ours_async = checkpointer("ours-async", save="async") if "ours-async" in methods else None
    dcp_group = dist.new_group(backend="gloo")  # DCP's background collectives never meet DDP's
    dcp_pending: list = []

    def dcp_state() -> dict:
        model_sd, optim_sd = get_state_dict(model, optim)
        return {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}

    def save(method: str, n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if method == "memory":
            memory.save(state, update=n)
        elif method == "memory-async":
            memory_async.save(state, update=n)
        elif method == "ours-async":
            ours_async.save(state, update=n)
        else:
            dcp_pending.append(dcp.async_save(dcp_state(), checkpoint_id=os.path.join(args.dir, "dcp", str(n)),
                                              process_group=dcp_group))
        stall = time.perf_counter() - t0
        train_step()
        # drained, untimed: the next save starts with nothing in flight
        if method in ("ours-async", "memory-async"):
            (ours_async if method == "ours-async" else memory_async).wait()
        elif method == "dcp-async":
            dcp_pending.pop().result()
            shutil.rmtree(os.path.join(args.dir, "dcp", str(n)), ignore_errors=True) if rank == 0 else None
        dist.barrier()
        return stall

    stalls: dict[str, list[list[float]]] = {m: [] for m in methods}
    n = 0
    for method in methods:  # warm-up, untimed
        n += 1
        save(method, n)
    orders = balanced_orders(methods)
    for rep in range(args.reps):
        for method in orders[rep % len(orders)]:
            n += 1
            mine = torch.tensor([save(method, n)], dtype=torch.float64)
            every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(every, mine)
            stalls[method].append([float(x.item()) for x in every])

    tier = memory or memory_async  # the tier whose holdings are reported
    held = torch.tensor([tier.last_save.get("memory_held_bytes", 0) if tier else 0], dtype=torch.int64)
    dist.all_reduce(held)
    if rank == 0:
        result = {"world": world, "state_bytes_per_rank": state_bytes,
                  "params": sum(p.numel() for p in model.parameters()), "stalls_s": stalls,
                  "memory_held_bytes_all_ranks": int(held.item()), "memory_held_by": "memory" if memory else
                  "memory-async" if tier else None,
                  "memory_dir_bytes": tree_bytes(os.path.join(args.memory_dir, "sync" if memory else "async")),
                  "memory_last_save": {k: v for k, v in tier.last_save.items() if k != "root"} if tier else None}
        with open(args.out, "w") as f:
            json.dump(result, f)
    for ckpt in (memory, memory_async, ours_async):
        if ckpt is not None:
            ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
