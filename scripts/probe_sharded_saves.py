#!/usr/bin/env python3
"""Paired probe: sharded saves only, several ways, in the benchmark's balanced method orders.

``scripts/bench_store.py --section sharded`` runs every method's save and restore
in a fixed balanced design and reports against DCP. This probe answers narrower
questions, such as "does a slice size, a shard size or the benchmark's surroundings
change the DCP backend's saves?", by timing saves of the same state in the same
processes, one method after another. Each round takes the next of the benchmark's
balanced orders (``bench_store.balanced_orders``: every method directly follows every
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
:class:`PhaseClock`), ``--prefault X`` (touch and free X times each
rank's bytes before every save and restore; default 2, as the benchmark). As the
benchmark, it freezes the garbage collector's view of the state once and collects
before every timed save.

    python scripts/probe_sharded_saves.py --ranks 4 --rounds 30 --methods dcp-alpha dcp-alpha-s16 ckpt dcp-t2

Prints each method's median save (the slowest rank's seconds), then every pair's
ratio of medians with a 90 % paired-bootstrap interval and the rounds each side
won, then one JSON line with every round's times.
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
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_store import MiB, balanced_orders, free_port, paired_ratio_interval, prefault, process_cpu_s  # noqa: E402

import alpha_ckpt  # noqa: E402
import alpha_ckpt.dcp as alpha_dcp  # noqa: E402
from alpha_ckpt.store import Store  # noqa: E402

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


class PhaseClock:
    """Wall-clock seconds a save spends in each named step, in this process (``--phases``).

    Wraps, for the probe's lifetime, the steps where the methods differ: the DCP backend's
    hooks, DCP's collectives (pickled objects over the process group), the ``Checkpointer``'s
    layout agreement, shard writes and root publish, and the store's batched durable commit
    (``put_objects``: writes, BLAKE3, fsyncs and renames), which the backend and the
    ``Checkpointer`` share. ``fsync`` is every ``os.fsync`` of the save, DCP's writer's included,
    summed over the threads that ran them (so it can exceed the save). ``write_threads`` is not a
    time: the most files one durable commit of the save wrote at once. Steps nest (``put_objects``
    runs inside the backend's ``write_data``); what a method never calls is 0.
    """

    def __init__(self) -> None:
        import alpha_ckpt.collective.agreement as agreement
        import alpha_ckpt.tiers.durable.star as star
        import alpha_ckpt.store.durable as durable
        import alpha_ckpt.store as store
        from torch.distributed.checkpoint import utils as dcp_utils
        self.steps = [
            ("backend set_up", alpha_dcp.StorageWriter, "set_up_storage_writer"),
            ("backend prepare_global_plan", alpha_dcp.StorageWriter, "prepare_global_plan"),
            ("backend write_data", alpha_dcp.StorageWriter, "write_data"),
            ("backend finish", alpha_dcp.StorageWriter, "finish"),
            ("dcp gather_object", dcp_utils._DistWrapper, "gather_object"),
            ("dcp scatter_object", dcp_utils._DistWrapper, "scatter_object"),
            ("dcp broadcast_object", dcp_utils._DistWrapper, "broadcast_object"),
            ("ckpt agree_layout", agreement, "agree_layout"),
            ("ckpt write_or_fail", star, "write_or_fail"),
            ("ckpt publish_root", star.StarPublisher, "_publish_root"),
            ("store put_objects", store.Store, "put_objects"),
            ("fsync", os, "fsync"),  # every caller's, DCP's writer's included
        ]
        self.labels = [label for label, _, _ in self.steps] + ["write_threads"]
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()  # fsyncs and writes run on several threads at once
        for label, owner, name in self.steps:
            setattr(owner, name, self._timed(label, getattr(owner, name)))
        commit_all = durable.durable_commit_all

        def counted(tmp_dir, commits, write_threads=1):
            with self._lock:
                self._seconds["write_threads"] = max(self._seconds.get("write_threads", 0),
                                                     min(write_threads, len(commits)))
            return commit_all(tmp_dir, commits, write_threads)
        durable.durable_commit_all = counted

    def _timed(self, label: str, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                with self._lock:
                    self._seconds[label] = self._seconds.get(label, 0.0) + elapsed
        return timed

    def start(self) -> None:
        self._seconds = {}

    def take(self) -> list[float]:
        """This save's seconds per label (and its write_threads), in :attr:`labels` order."""
        return [float(self._seconds.get(label, 0.0)) for label in self.labels]


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


def save(method: str, state: dict, directory: str, rnd: int, ckpt) -> str | None:
    if method == "raw":
        raw_save(state, directory)
        return None
    if method == "ckpt":
        return ckpt.save({"model": state}, update=rnd + 1, cursor=rnd + 1).root
    if method == "dcp":
        dcp.save(state, checkpoint_id=directory)
        return None
    if method == "dcp-t2":
        dcp.save(state, storage_writer=FileSystemWriter(directory, thread_count=2))
        return None
    m = BACKEND.match(method)
    slice_bytes = int(m["slice"]) * MiB if m["slice"] else alpha_dcp.SLICE_BYTES
    default_shard_bytes = alpha_dcp.SHARD_BYTES
    alpha_dcp.SHARD_BYTES = int(m["shard"]) * MiB if m["shard"] else default_shard_bytes  # read by write_data
    # -wK: a store opened with that many files written at once, handed to the writer
    store = Store(directory, write_threads=int(m["threads"])) if m["threads"] else None
    try:
        writer = alpha_dcp.StorageWriter(directory if store is None else store, run="probe", step="fit",
                                         update=rnd + 1, slice_bytes=slice_bytes)
        return dcp.save(state, storage_writer=writer).storage_meta.checkpoint_id
    finally:
        if store is not None:
            store.close()
        alpha_dcp.SHARD_BYTES = default_shard_bytes


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
    objects: dict[str, list[int]] = {m: [] for m in methods if m.startswith("dcp-alpha")}  # files each save stored
    clock = PhaseClock() if config["phases"] else None
    # per label, per timed save: the slowest rank's
    phases = {m: {label: [] for label in clock.labels} for m in methods} if clock is not None else None
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
            if clock is not None:
                clock.start()
            started, cpu_started = time.perf_counter(), sum(process_cpu_s())
            handle = save(method, state, directory, rnd, ckpt)
            measured = [time.perf_counter() - started, sum(process_cpu_s()) - cpu_started]
            slowest = torch.tensor(measured + (clock.take() if clock is not None else []), dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rnd >= config["warmup"]:
                times[method].append(float(slowest[0].item()))
                cpu[method].append(float(slowest[1].item()))
                if clock is not None:
                    for label, seconds in zip(clock.labels, slowest[2:].tolist()):
                        phases[method][label].append(seconds)
                if rank == 0 and method in objects:
                    objects[method].append(sum(len(files) for _, _, files in os.walk(os.path.join(directory, "objects"))))
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    parser.add_argument("--rows", type=int, default=16384, help="rows of each of the 16 matrices (default 16384: 1 GiB)")
    parser.add_argument("--methods", nargs="+", default=["dcp-alpha", "ckpt", "dcp-t2"])
    parser.add_argument("--restore", action="store_true", help="restore and check every save (untimed)")
    parser.add_argument("--sync", action="store_true", help="os.sync() after each mkdir and rmtree")
    parser.add_argument("--phases", action="store_true", help="time each save's steps (see PhaseClock)")
    parser.add_argument("--prefault", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="where the saves go (default: a new directory under /tmp)")
    args = parser.parse_args(argv)
    bad = [m for m in args.methods if not method_ok(m)]
    if bad or len(set(args.methods)) != len(args.methods) or len(args.methods) < 2:
        parser.error(f"--methods: two or more distinct of ckpt, dcp, dcp-t2, dcp-alpha[-sN][-shM][-wK] "
                     f"(not {bad or args.methods})")
    if args.ranks < 1 or args.rounds < 1 or args.warmup < 0 or args.prefault < 0 or args.rows % args.ranks:
        parser.error("--ranks and --rounds at least 1, --warmup and --prefault at least 0, --rows a multiple of --ranks")
    top = tempfile.mkdtemp(prefix="probe_sharded_saves.", dir=args.dir)
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
            shown = sorted(((statistics.median(v), label) for label, v in steps.items() if label != "write_threads"),
                           reverse=True)
            print(f"    {m}: " + ", ".join(f"{label} {s:.3f} s ({100 * s / median_save:.0f}%)"
                                           for s, label in shown if s >= 0.0005)
                  + (f"; files written at once {max(steps['write_threads']):g}" if max(steps["write_threads"]) else ""))
    if result["phases"] is not None:
        print("  per round (seconds; for each method its three largest steps):")
        for rnd in range(args.rounds):
            cells = []
            for m in args.methods:
                steps = sorted(((v[rnd], label) for label, v in result["phases"][m].items()
                                if label != "write_threads" and v[rnd] >= 0.0005), reverse=True)[:3]
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
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
