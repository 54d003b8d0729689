"""Section "many-tensors": one process, states of many small tensors, ours against torch.save and DCP."""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import time

import torch
import torch.distributed as dist

import alpha_ckpt

from .common import check_equal, evicted, median, open_store, print_ratios, targets_met
from .methods import dcp_restore, dcp_save, ours_restore, ours_save, torch_save

# One process, states of many small tensors (an MoE model's experts with their per-parameter
# optimizer state): what costs per tensor, not per byte, shows here.

MANY_METHODS = ("ckpt", "ours", "torch", "dcp")


def many_tensors_state(count: int, seed: int) -> dict:
    """``count`` tensors, mostly tiny: per expert a [32, 16] weight, a [32] bias, their Adam moments and a
    0-dim step counter, in a model and an optimizer dict (float32; the steps int64)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((32, 16), (32,))  # weight, bias; each has exp_avg, exp_avg_sq and a step: 8 tensors per expert
    model, optim = {}, {}
    for i in range(count):
        expert, slot = divmod(i, 8)
        param, kind = divmod(slot, 4)
        shape = shapes[param]
        name = f"experts.{expert}.{'weight' if param == 0 else 'bias'}"
        if kind == 0:
            model[name] = torch.randn(shape, generator=gen)
        elif kind == 3:
            optim[f"{name}.step"] = torch.tensor(expert, dtype=torch.int64)
        else:
            optim[f"{name}.{'exp_avg' if kind == 1 else 'exp_avg_sq'}"] = torch.randn(shape, generator=gen)
    return {"model": model, "optim": optim}


def nested_tensors(state: dict) -> list[tuple[str, torch.Tensor]]:
    return [(f"{k}.{n}", t) for k, part in state.items() for n, t in part.items()]


def many_save_restore(name: str, top: str):
    """(save(state, workdir, rep) -> handle, restore(dest, workdir, handle)) of a many-tensors method."""
    if name == "ckpt":
        def save(state, workdir, rep):
            ckpt = alpha_ckpt.Checkpointer(open_store(workdir), run="bench", step="fit")  # untimed: created once per job
            ckpt.restore(state, None)
            t = time.perf_counter()
            root = ckpt.save(state, update=rep).root
            elapsed = time.perf_counter() - t
            return (ckpt, root), elapsed

        def restore(dest, workdir, handle):
            ckpt, root = handle
            try:
                ckpt.restore(dest, root)
            finally:
                ckpt.close()
        return save, restore
    if name == "ours":
        return ours_save, ours_restore
    if name == "torch":
        def torch_restore_nested(dest, workdir, path):
            loaded = torch.load(path, weights_only=True)
            with torch.no_grad():
                for k, part in dest.items():
                    for n, t in part.items():
                        t.copy_(loaded[k][n])
        return torch_save, torch_restore_nested
    return dcp_save, dcp_restore


def run_many_tensors(args: argparse.Namespace, top: str) -> dict:
    counts = sorted(set(args.many_counts))
    methods = tuple(m for m in MANY_METHODS if m in (args.many_methods or MANY_METHODS))
    # The Checkpointer is collective: one rank of gloo, set up here and torn down at the end.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(top, 'many-rendezvous')}", rank=0, world_size=1)
    times = {n: {m: {"save": [], "load": []} for m in methods} for n in counts}
    nbytes, verified = {}, 0
    print()
    print(f"== section many-tensors: {', '.join(f'{n:,}' for n in counts)} small tensors, one process (the "
          f"Checkpointer on a 1-rank gloo group); methods {', '.join(methods)}, each round in the next rotation of "
          f"that order; every save hashed and fsynced as always (ours), torch.save fsyncs its file and directory",
          flush=True)
    try:
        for n in counts:
            state = many_tensors_state(n, args.seed)
            dest = {k: {name: torch.empty_like(t) for name, t in part.items()} for k, part in state.items()}
            flat_src, flat_dest = dict(nested_tensors(state)), dict(nested_tensors(dest))
            nbytes[n] = sum(t.numel() * t.element_size() for t in flat_src.values())
            for rnd in range(args.warmup + args.reps):
                timed = rnd >= args.warmup
                label = f"rep {rnd - args.warmup}" if timed else "warm-up"
                order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
                for name in order:
                    save, restore = many_save_restore(name, top)
                    workdir = os.path.join(top, f"many-{n}-{name}-{rnd}")
                    os.mkdir(workdir)
                    os.sync()
                    gc.collect()
                    t = time.perf_counter()
                    handle = save(state, workdir, rnd)
                    save_s = time.perf_counter() - t
                    if name == "ckpt":
                        handle, save_s = handle
                    for t in flat_dest.values():
                        t.fill_(-1)
                    if args.cold:
                        evicted(workdir)
                    gc.collect()
                    t = time.perf_counter()
                    restore(dest, workdir, handle)
                    load_s = time.perf_counter() - t
                    check_equal(name, flat_src, flat_dest)
                    verified += 1
                    if timed:
                        times[n][name]["save"].append(save_s)
                        times[n][name]["load"].append(load_s)
                    shutil.rmtree(workdir)
                    os.sync()
                    print(f"  {n:>7,}  {label:<7}  {name:<5} save {save_s:8.3f} s   restore {load_s:8.3f} s", flush=True)
    finally:
        dist.destroy_process_group()
    return report_many_tensors(args, counts, nbytes, times, verified)


def report_many_tensors(args: argparse.Namespace, counts: list[int], nbytes: dict, times: dict, verified: int) -> dict:
    methods = tuple(times[counts[0]])
    med = {n: {m: {k: median(v) for k, v in times[n][m].items()} for m in methods} for n in counts}
    ours = [m for m in ("ckpt", "ours") if m in methods]
    ratios, met = {}, {}
    targets = {f"{m}_{p}/torch_{p}": ("<=", 3.0) for m in ours for p in ("save", "load")}
    print()
    print(f"many-tensors: medians over {args.reps} rep(s), seconds")
    print(f"{'tensors':>8} {'MB':>8}  " + "  ".join(f"{m + ' save':>10} {m + ' load':>10}" for m in methods))
    for n in counts:
        print(f"{n:>8,} {nbytes[n] / 1e6:8.2f}  " + "  ".join(f"{med[n][m]['save']:10.3f} {med[n][m]['load']:10.3f}"
                                                           for m in methods))
    for n in counts:
        ratios[n] = {f"{m}_{p}/{b}_{p}": med[n][m][p] / med[n][b][p]
                     for m in ours for b in ("torch", "dcp") if b in methods for p in ("save", "load")}
        met[n] = targets_met(ratios[n], targets)
        print()
        print(f"many-tensors: {n:,} tensors, ratios (of medians)")
        print_ratios(ratios[n], targets)
    keys = {n: str(n) for n in counts}
    return {"counts": counts, "methods": list(methods), "reps": args.reps, "warmup": args.warmup, "bytes": {keys[n]: nbytes[n] for n in counts},
            "median_s": {keys[n]: med[n] for n in counts}, "ratios": {keys[n]: ratios[n] for n in counts},
            "targets_met": {keys[n]: met[n] for n in counts}, "verified_restores": verified}
