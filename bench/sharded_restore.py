"""A/B of sharded restores outside the sharded suite: one save and one restore per method and round.

Each round, every method in turn (the order rotates and reverses every other
round) saves the same ``Shard(0)`` DTensors (``--size-mib`` MiB in 16 float32
matrices of 1024 columns, as FSDP2 holds parameters and moments) into a fresh
directory, the page cache of that directory is evicted, each rank touches and
frees ``--prefault`` times its bytes of anonymous memory, and the checkpoint is
restored in place into NaN-poisoned DTensors, then compared with
``torch.equal`` and removed. Times are the slowest rank's (a barrier closes
each phase).

  ckpt     ``alpha_ckpt.Checkpointer(DIR, publisher="star")``; ``restore(dest, root="latest")``
  ckpt-bf  as ckpt, with the store's write mode forced to buffered
  dcp      ``dcp.save`` / ``dcp.load`` with DCP's default FileSystemWriter/Reader

It exists because the benchmark's sharded loads and these differ (see
docs/bench-log/2026-12.md, "Intervals on the ratios"); it prints per-method medians and
every round's seconds, and a JSON line.

With ``--resume-in-new-processes`` each round is a save and a resume, as a job
that stops and is started again: one set of rank processes saves with every
method and exits, the page cache of every checkpoint is evicted, and new rank
processes (their destination DTensors allocated afresh, as a restarted script
builds its model) restore each method in turn. No restore follows its own save
in the same processes, so no method inherits memory its save touched.

Usage::

    python -m bench sharded-restore --ranks 2 --rounds 8            # 1 GiB, about 3 minutes here
    python -m bench sharded-restore --ranks 2 --rounds 1 --size-mib 16   # smoke run
    python -m bench sharded-restore --ranks 2 --rounds 8 --resume-in-new-processes
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import alpha_ckpt
from alpha_ckpt.store import Store

from .checkpointer_rank import row_sharded_matrices
from .common import evicted, prefault
from .ranks import free_port

METHODS = ("ckpt", "ckpt-bf", "dcp")
COLS, MATRICES = 1024, 16


def join_ranks(rank: int, args: argparse.Namespace, port: int) -> tuple[dict, dict, int]:
    """Join the gloo world; this rank's source and NaN destination DTensors, and its bytes of them."""
    torch.set_num_threads(args.torch_threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh
    shape = (args.size_mib * (1 << 20) // (4 * MATRICES * COLS), COLS)
    mesh = init_device_mesh("cpu", (args.ranks,))
    src, dst = (side[0] for side in row_sharded_matrices(shape, MATRICES, {0: mesh}, seed=0))
    return src, dst, sum(t.to_local().nbytes for t in src.values())


def timed(fn) -> float:
    """Run ``fn`` between barriers; the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank_main(rank: int, args: argparse.Namespace, port: int, top: str, out: multiprocessing.Queue) -> None:
    src, dst, own_bytes = join_ranks(rank, args, port)
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in args.methods}

    methods = list(args.methods)
    for rnd in range(args.rounds):
        order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
        for method in order[::-1] if rnd % 2 else order:
            directory = os.path.join(top, f"{method}-{rnd}")
            ckpt = None
            if method.startswith("ckpt"):
                # ckpt-bf: buffered whatever the store's default is
                store = Store(directory, write_mode="buffered") if method == "ckpt-bf" else directory
                ckpt = alpha_ckpt.Checkpointer(store, run="ab", step="fit", publisher="star")
                ckpt.restore({"model": src}, root=None)  # a fresh start, untimed
                save_s = timed(lambda: ckpt.save({"model": src}, update=rnd + 1))
            else:
                save_s = timed(lambda: dcp.save(src, checkpoint_id=directory))
            for t in dst.values():
                t.to_local().fill_(float("nan"))
            dist.barrier()
            if rank == 0:
                evicted(directory)
            prefault(int(args.prefault * own_bytes))
            if ckpt is not None:
                load_s = timed(lambda: ckpt.restore({"model": dst}, root="latest"))
                ckpt.close()
            else:
                load_s = timed(lambda: dcp.load(dst, checkpoint_id=directory))
            if not all(torch.equal(dst[k].to_local(), src[k].to_local()) for k in src):
                raise SystemExit(f"{method}: rank {rank} restored tensors differ from the source")
            dist.barrier()
            if rank == 0:
                shutil.rmtree(directory)
                os.sync()
                times[method]["save"].append(round(save_s, 4))
                times[method]["load"].append(round(load_s, 4))
                print(f"  round {rnd}  {method:<8} save {save_s:6.3f} s   restore {load_s:6.3f} s", flush=True)
            dist.barrier()
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def resume_rank(rank: int, args: argparse.Namespace, port: int, top: str, rnd: int, phase: str,
                out: multiprocessing.Queue) -> None:
    """One rank of one phase of a --resume-in-new-processes round: "save" with every method, or
    "restore" every method's checkpoint into DTensors allocated by this new process."""
    src, dst, own_bytes = join_ranks(rank, args, port)
    times = {}
    methods = list(args.methods)
    order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
    for method in order[::-1] if rnd % 2 else order:
        directory = os.path.join(top, f"{method}-{rnd}")
        prefault(int(args.prefault * own_bytes))
        if phase == "save":
            if method.startswith("ckpt"):
                # ckpt-bf: buffered whatever the store's default is
                store = Store(directory, write_mode="buffered") if method == "ckpt-bf" else directory
                ckpt = alpha_ckpt.Checkpointer(store, run="ab", step="fit", publisher="star")
                ckpt.restore({"model": src}, root=None)  # a fresh start, untimed
                times[method] = timed(lambda: ckpt.save({"model": src}, update=rnd + 1))
                ckpt.close()
            else:
                times[method] = timed(lambda: dcp.save(src, checkpoint_id=directory))
            continue
        for t in dst.values():
            t.to_local().fill_(float("nan"))
        if method.startswith("ckpt"):
            ckpt = alpha_ckpt.Checkpointer(directory, run="ab", step="fit", publisher="star")
            times[method] = timed(lambda: ckpt.restore({"model": dst}, root="latest"))
            ckpt.close()
        else:
            times[method] = timed(lambda: dcp.load(dst, checkpoint_id=directory))
        if not all(torch.equal(dst[k].to_local(), src[k].to_local()) for k in src):
            raise SystemExit(f"{method}: rank {rank} restored tensors differ from the source")
    dist.barrier()
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def launch(ctx, args: argparse.Namespace, target, *extra) -> dict:
    """Fork ``args.ranks`` processes running ``target(rank, args, port, *extra, queue)``; rank 0's result."""
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, args, port, *extra, out)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=3600)
    for proc in procs:
        proc.join(timeout=600)
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"rank exit codes {[proc.exitcode for proc in procs]}")
    return result


def resume_rounds(ctx, args: argparse.Namespace, top: str) -> dict:
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in args.methods}
    for rnd in range(args.rounds):
        saved = launch(ctx, args, resume_rank, top, rnd, "save")
        for method in args.methods:
            evicted(os.path.join(top, f"{method}-{rnd}"))
        restored = launch(ctx, args, resume_rank, top, rnd, "restore")
        for method in args.methods:
            times[method]["save"].append(round(saved[method], 4))
            times[method]["load"].append(round(restored[method], 4))
            print(f"  round {rnd}  {method:<8} save {saved[method]:6.3f} s   restore in new processes "
                  f"{restored[method]:6.3f} s", flush=True)
            shutil.rmtree(os.path.join(top, f"{method}-{rnd}"))
        os.sync()
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench sharded-restore", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--size-mib", type=int, default=1024, help="the whole state (default 1024)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--prefault", type=float, default=2.0, help="times each rank's bytes (default 2, as the benchmark)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory on /work or /tmp)")
    p.add_argument("--resume-in-new-processes", action="store_true",
                   help="save in one set of processes, restore in new ones (as a restarted job)")
    args = p.parse_args(argv)
    if args.size_mib * (1 << 20) % (4 * MATRICES * COLS * args.ranks):
        p.error(f"--size-mib {args.size_mib} does not give whole rows to {args.ranks} ranks")
    base = args.dir or ("/work" if os.access("/work", os.W_OK) else None)
    top = tempfile.mkdtemp(prefix="bench-sharded-restore.", dir=base)
    try:
        ctx = multiprocessing.get_context("fork")  # before any torch thread: the ranks share the imports
        times = resume_rounds(ctx, args, top) if args.resume_in_new_processes else launch(ctx, args, rank_main, top)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return report(args, times)


def report(args: argparse.Namespace, times: dict) -> dict:
    medians = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    for m, med in medians.items():
        print(f"{m:<8} save median {med['save']:.3f} s   restore median {med['load']:.3f} s")
    return {"ranks": args.ranks, "rounds": args.rounds, "size_mib": args.size_mib, "prefault": args.prefault,
                      "torch_threads": args.torch_threads, "resume_in_new_processes": args.resume_in_new_processes,
            "median_s": medians, "times": times}
