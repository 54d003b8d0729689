"""Paired probe: sharded saves only, several ways, in the benchmark's balanced method orders.

The sharded suite (``python -m bench sharded``) runs every method's save and restore
in a fixed balanced design and reports against DCP. This probe answers narrower
questions, such as "does a slice size, a shard size or the benchmark's surroundings
change the DCP backend's saves?", by timing saves of the same state in the same
processes, one method after another. Each round takes the next of the benchmark's
balanced orders (``bench.common.balanced_orders``: every method directly follows every
other equally often over a full cycle, so what one method leaves behind does not
always land on the same other). Each round's times are paired, so what slowed a
whole round moves both sides of a ratio together.

The state: 16 float32 matrices of ``--rows`` x 1024 as DTensors placed ``Shard(0)``
on a 1-D mesh of ``--ranks`` gloo ranks (the default 16384 rows: 1 GiB), each
method saving into a fresh directory that is removed after the round. Methods:

  dcp-alpha[-sN][-shM][-wK]  ``dcp.save`` with ``alpha_ckpt.dcp.StorageWriter``; ``-sN``:
                        slices of N MiB (default: the backend's), ``-shM``: shards of
                        at most M MiB (default: the backend's), ``-wK``: K files written
                        at once (the store's ``write_threads`` for that save; default the store's)
  ckpt                  ``alpha_ckpt.Checkpointer.save`` (synchronous, star; built, and its
                        fresh store opened, before the timer, as the benchmark does)
  dcp, dcp-t2           ``dcp.save`` with DCP's ``FileSystemWriter`` (one thread, two)
  raw                   the disk's control: each rank writes its own shards' bytes, straight from
                        the tensors, into one file with ``os.write`` and fsyncs it (no hashing,
                        no rename, no collective)

Optional, as the benchmark does: ``--restore`` (load each save back into poisoned
DTensors, untimed, and check it with ``torch.equal``), ``--sync`` (``os.sync()``
after each ``mkdir`` and ``rmtree``), ``--phases`` (where each save's time goes: see
:func:`save_phases`), ``--prefault X`` (touch and free X times each
rank's bytes before every save and restore; default 2, as the benchmark). As the
benchmark, it freezes the garbage collector's view of the state once and collects
before every timed save.

    python -m bench sharded-saves --ranks 4 --rounds 30 --methods dcp-alpha dcp-alpha-s16 ckpt dcp-t2

Prints each method's median save (the slowest rank's seconds), then every pair's
ratio of medians with a 90 % paired-bootstrap interval and the rounds each side
won; the run's record holds every round's times.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter

import alpha_ckpt
import alpha_ckpt.dcp as alpha_dcp
from alpha_ckpt.store import Store

from .common import MiB, balanced_orders, paired_ratio_interval, prefault, process_cpu_s
from .ranks import free_port

COLS = 1024
TENSORS = 16
BACKEND = re.compile(r"^dcp-alpha(?:-s(?P<slice>[1-9]\d*))?(?:-sh(?P<shard>[1-9]\d*))?(?:-w(?P<threads>[1-9]\d*))?$")


def method_ok(name: str) -> bool:
    return name in ("ckpt", "dcp", "dcp-t2", "raw") or BACKEND.match(name) is not None


def round_order(methods: list[str], rnd: int) -> tuple[str, ...]:
    """Round ``rnd``'s order of the methods: the next of the benchmark's balanced orders."""
    orders = balanced_orders(methods)
    return orders[rnd % len(orders)]


def pair_stats(first: list[float], second: list[float]) -> dict:
    """How much faster ``first`` saved than ``second`` (paired seconds of the same rounds): the ratio
    of medians (>1: first faster), its 90 % paired-bootstrap interval (None under 5 rounds), the
    geometric mean of the per-round ratios, and the rounds in which first was faster."""
    ratio = statistics.median(second) / statistics.median(first)
    interval = paired_ratio_interval(first, second) if len(first) >= 5 else None
    geo = math.exp(statistics.fmean(math.log(b / a) for a, b in zip(first, second)))
    return {"ratio": ratio, "interval_90": interval, "geo_mean": geo,
            "first_faster": sum(a < b for a, b in zip(first, second)), "rounds": len(first)}


CKPT_PHASES = ("capture", "agree", "durable.write", "durable.commit")
BACKEND_PHASES = ("backend set_up", "backend plan", "backend write", "backend finish", "dcp own")


def phase_labels(method: str) -> tuple[str, ...]:
    """The phases ``--phases`` reports for ``method`` (the same on every rank: a rank that skips one reports 0)."""
    return CKPT_PHASES if method == "ckpt" else BACKEND_PHASES if BACKEND.match(method) else ()


def save_phases(method: str, seconds: float, ckpt_result, writer) -> dict[str, float]:
    """Where this rank's save of ``method`` spent ``seconds``, as the product reports it: the Checkpointer's
    ``SaveResult.phases`` (capture, agree, durable.write, durable.commit), or the DCP backend's
    ``StorageWriter.phases`` (set_up, plan, write, finish) with what is left of ``dcp.save`` as
    ``dcp own`` (DCP's planning and collectives). DCP's own writer and the raw control report none."""
    if ckpt_result is not None:
        phases = dict(ckpt_result.phases)
    elif writer is not None:
        phases = {f"backend {k}": v for k, v in writer.phases.items()}
        phases["dcp own"] = max(0.0, seconds - sum(phases.values()))
    else:
        return {}
    return phases


def raw_save(state: dict, directory: str) -> None:
    """Write this rank's local bytes of ``state`` to one file and fsync it: the disk's rate, as a control."""
    rank = dist.get_rank()
    fd = os.open(os.path.join(directory, f"raw-{rank}.bin"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for t in state.values():
            view = memoryview(t.to_local().reshape(-1).view(torch.uint8).numpy())
            while view:
                view = view[os.write(fd, view[:RAW_CHUNK]):]
        os.fsync(fd)
    finally:
        os.close(fd)


RAW_CHUNK = 16 * MiB


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated (numpy's default)."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def save(method: str, state: dict, directory: str, rnd: int, ckpt) -> tuple[str | None, object, object]:
    """Save with ``method``; (what restores it, the Checkpointer's SaveResult, the DCP backend's writer)."""
    if method == "raw":
        raw_save(state, directory)
        return None, None, None
    if method == "ckpt":
        result = ckpt.save({"model": state}, update=rnd + 1, cursor=rnd + 1)
        return result.root, result, None
    if method == "dcp":
        dcp.save(state, checkpoint_id=directory)
        return None, None, None
    if method == "dcp-t2":
        dcp.save(state, storage_writer=FileSystemWriter(directory, thread_count=2))
        return None, None, None
    m = BACKEND.match(method)
    slice_bytes = int(m["slice"]) * MiB if m["slice"] else alpha_dcp.SLICE_BYTES
    shard_bytes = int(m["shard"]) * MiB if m["shard"] else alpha_dcp.SHARD_BYTES
    # -wK: a store opened with that many files written at once, handed to the writer
    store = Store(directory, write_threads=int(m["threads"])) if m["threads"] else None
    try:
        writer = alpha_dcp.StorageWriter(directory if store is None else store, run="probe", step="fit",
                                         update=rnd + 1, slice_bytes=slice_bytes, shard_bytes=shard_bytes)
        return dcp.save(state, storage_writer=writer).storage_meta.checkpoint_id, None, writer
    finally:
        if store is not None:
            store.close()


def restore(method: str, dest: dict, directory: str, handle, ckpt) -> None:
    if method == "raw":
        return  # the control is not restored
    if method == "ckpt":
        ckpt.restore({"model": dest}, root=handle)
    elif method in ("dcp", "dcp-t2"):
        dcp.load(dest, checkpoint_id=directory)
    else:
        dcp.load(dest, storage_reader=alpha_dcp.StorageReader(directory, handle))



def rank_main(rank: int, config: dict) -> None:
    from torch.distributed.tensor import DeviceMesh, distribute_tensor, Shard
    world, methods = config["ranks"], config["methods"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", list(range(world)))
    generator = torch.Generator().manual_seed(0)
    state = {f"m{i:02d}": distribute_tensor(torch.randn(config["rows"], COLS, generator=generator), mesh, [Shard(0)])
             for i in range(TENSORS)}
    dest = {k: distribute_tensor(torch.zeros(config["rows"], COLS), mesh, [Shard(0)]) for k in state}
    own_bytes = sum(t.to_local().nbytes for t in state.values())
    times: dict[str, list[float]] = {m: [] for m in methods}
    # files each save stored: the backend's objects, the raw control's files
    objects: dict[str, list[int]] = {m: [] for m in methods if m.startswith("dcp-alpha") or m == "raw"}
    # per label, per timed save: the slowest rank's
    phases = {m: {label: [] for label in phase_labels(m)} for m in methods} if config["phases"] else None
    cpu: dict[str, list[float]] = {m: [] for m in methods}  # per timed save: the busiest rank's process CPU seconds
    verified = 0
    gc.freeze()  # the collections before each save then scan only what the methods left
    for rnd in range(config["warmup"] + config["rounds"]):
        for method in round_order(methods, rnd - config["warmup"]):
            directory = os.path.join(config["dir"], f"{method}-{rnd}")
            if rank == 0:
                os.mkdir(directory)
                if config["sync"]:
                    os.sync()
            dist.barrier()
            ckpt = None
            if method == "ckpt":
                ckpt = alpha_ckpt.Checkpointer(directory, run="probe", step="fit", save="sync", publisher="star")
                ckpt.restore({"model": state}, root=None)  # a fresh start, untimed (collective)
            gc.collect()
            prefault(int(config["prefault"] * own_bytes))
            dist.barrier()
            started, cpu_started = time.perf_counter(), sum(process_cpu_s())
            handle, ckpt_result, writer = save(method, state, directory, rnd, ckpt)
            measured = [time.perf_counter() - started, sum(process_cpu_s()) - cpu_started]
            steps = save_phases(method, measured[0], ckpt_result, writer)
            labels = phase_labels(method) if phases is not None else ()
            slowest = torch.tensor(measured + [steps.get(label, 0.0) for label in labels], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rnd >= config["warmup"]:
                times[method].append(float(slowest[0].item()))
                cpu[method].append(float(slowest[1].item()))
                if phases is not None:
                    for label, seconds in zip(labels, slowest[2:].tolist()):
                        phases[method][label].append(seconds)
                if rank == 0 and method in objects:
                    stored = directory if method == "raw" else os.path.join(directory, "objects")
                    objects[method].append(sum(len(files) for _, _, files in os.walk(stored)))
            if config["restore"]:
                for t in dest.values():
                    t.to_local().fill_(float("nan"))
                prefault(int(config["prefault"] * own_bytes))
                dist.barrier()
                restore(method, dest, directory, handle, ckpt)
                differ = torch.tensor([0 if method == "raw" else
                                       sum(not torch.equal(dest[k].to_local(), state[k].to_local()) for k in state)])
                dist.all_reduce(differ)
                if int(differ.item()):
                    raise SystemExit(f"{method} round {rnd}: {int(differ.item())} restored tensor(s) differ")
                verified += method != "raw"
            if ckpt is not None:
                ckpt.close()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(directory)
                if config["sync"]:
                    os.sync()
    if rank == 0:
        left = sorted(os.listdir(config["dir"]))  # every round's directory is removed
        with open(os.path.join(config["dir"], "times.json"), "w") as f:
            json.dump({"times": times, "cpu": cpu, "objects": objects, "verified_restores": verified,
                       "left_behind": left, "phases": phases}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench sharded-saves", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--rows", type=int, default=16384, help="rows of each of the 16 matrices (default 16384: 1 GiB)")
    parser.add_argument("--methods", nargs="+", default=["dcp-alpha", "ckpt", "dcp-t2"])
    parser.add_argument("--restore", action="store_true", help="restore and check every save (untimed)")
    parser.add_argument("--sync", action="store_true", help="os.sync() after each mkdir and rmtree")
    parser.add_argument("--phases", action="store_true", help="where each save's time went, as the product reports it (see save_phases)")
    parser.add_argument("--prefault", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="where the saves go (default: a new directory under /tmp)")
    args = parser.parse_args(argv)
    bad = [m for m in args.methods if not method_ok(m)]
    if bad or len(set(args.methods)) != len(args.methods) or len(args.methods) < 2:
        parser.error(f"--methods: two or more distinct of ckpt, dcp, dcp-t2, dcp-alpha[-sN][-shM][-wK] "
                     f"(not {bad or args.methods})")
    if args.ranks < 1 or args.rounds < 1 or args.warmup < 0 or args.prefault < 0 or args.rows % args.ranks:
        parser.error("--ranks and --rounds at least 1, --warmup and --prefault at least 0, --rows a multiple of --ranks")
    top = tempfile.mkdtemp(prefix="bench-sharded-saves.", dir=args.dir)
    config = {"ranks": args.ranks, "rounds": args.rounds, "warmup": args.warmup, "rows": args.rows,
              "methods": args.methods, "restore": args.restore, "sync": args.sync, "prefault": args.prefault,
              "phases": args.phases,
              "dir": top, "port": free_port()}
    try:
        mp.spawn(rank_main, args=(config,), nprocs=args.ranks)
        with open(os.path.join(top, "times.json")) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    times = result["times"]
    gib = TENSORS * args.rows * COLS * 4 / (1 << 30)
    print(f"probe: {args.ranks} rank(s), {gib:.3f} GiB of Shard(0) DTensors, {args.rounds} timed round(s) after "
          f"{args.warmup}, balanced method orders; restores {'checked' if args.restore else 'off'}, "
          f"sync {'on' if args.sync else 'off'}, prefault {args.prefault:g}x")
    for m, v in times.items():
        print(f"  {m:<20} median save {statistics.median(v):7.3f} s  p90 {percentile(v, 0.9):7.3f} s  "
              f"(min {min(v):.3f}, max {max(v):.3f}), "
              f"busiest rank's CPU {statistics.median(result['cpu'][m]):.3f} s")
    if result["phases"] is not None:
        print("  where each save's time went (median over saves of the slowest rank's seconds; steps nest):")
        for m, steps in result["phases"].items():
            median_save = statistics.median(times[m])
            shown = sorted(((statistics.median(v), label) for label, v in steps.items()), reverse=True)
            print(f"    {m}: " + (", ".join(f"{label} {s:.3f} s ({100 * s / median_save:.0f}%)"
                                            for s, label in shown if s >= 0.0005) or "(reports none)"))
    if result["phases"] is not None:
        print("  per round (seconds; for each method its three largest steps):")
        for rnd in range(args.rounds):
            cells = []
            for m in args.methods:
                steps = sorted(((v[rnd], label) for label, v in result["phases"][m].items() if v[rnd] >= 0.0005),
                               reverse=True)[:3]
                inner = ", ".join(f"{label} {s:.2f}" for s, label in steps)
                cells.append(f"{m} {times[m][rnd]:.3f}" + (f" [{inner}]" if inner else ""))
            print(f"    {rnd:>3}: " + "; ".join(cells))
    if "raw" in times:
        print("  against the disk (target: p90 at most 1.25x raw's p90) and DCP thread_count=2 (median at most):")
        for m in args.methods:
            if m in ("raw", "dcp", "dcp-t2"):
                continue
            p90 = percentile(times[m], 0.9) / percentile(times["raw"], 0.9)
            line = f"    {m}: p90 {p90:.2f}x raw's p90"
            if "dcp-t2" in times:
                line += f", median {statistics.median(times[m]) / statistics.median(times['dcp-t2']):.2f}x dcp-t2's"
            print(line)
    pairs = {}
    for i, a in enumerate(args.methods):
        for b in args.methods[i + 1:]:
            s = pairs[f"{a} over {b}"] = pair_stats(times[a], times[b])
            interval = "" if s["interval_90"] is None else " 90% [{:.3f}, {:.3f}]".format(*s["interval_90"])
            print(f"  {a} over {b}: {s['ratio']:.3f}x{interval}, geometric mean {s['geo_mean']:.3f}, "
                  f"faster in {s['first_faster']} of {s['rounds']} rounds")
    out = {"config": {k: v for k, v in config.items() if k not in ("dir", "port")}, "times": times,
           "cpu": result["cpu"], "phases": result["phases"], "pairs": pairs,
           "objects": result["objects"], "verified_restores": result["verified_restores"],
           "left_behind": result["left_behind"]}
    return out
