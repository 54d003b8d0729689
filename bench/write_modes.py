"""Benchmark: buffered vs O_DIRECT writes of large objects, per file system, and what "auto" picks.

For each directory given (each on the file system to measure), one float32
state of ``--size-mib`` MiB in 16 tensors is saved with ``alpha_ckpt.save``
(hashing everything, fsync of every file and directory) with
``write_mode="buffered"`` and ``"direct"`` alternately, ``--reps``
times each, in fresh stores that are removed (and ``sync``-ed) after each
save. Then a store under "auto" saves ``--auto-saves`` states of 256 MiB and
reports the throughputs it measured and the mode it settled on. A file
system that refuses O_DIRECT (EINVAL) shows ``direct_refused: true`` and is
written buffered.

    python -m bench write-modes --dirs /var/tmp /dev/shm --reps 5
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import alpha_ckpt
from alpha_ckpt.store import Store


def save_once(base: str, state: dict, mode: str) -> float:
    d = tempfile.mkdtemp(dir=base, prefix="wm-")
    try:
        s = Store(d, write_mode=mode)
        t0 = time.perf_counter()
        alpha_ckpt.save(state, store=s, run="bench", step="fit", update=1, cursor=0, epoch=0)
        seconds = time.perf_counter() - t0
        s.close()
        return seconds
    finally:
        shutil.rmtree(d)
        os.sync()


def measure(base: str, size_mib: int, reps: int, auto_saves: int) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(size_mib * (1 << 20) // 64, generator=g) for i in range(16)}
    nbytes = size_mib << 20
    times: dict[str, list[float]] = {"buffered": [], "direct": []}
    for _ in range(reps):
        for mode in times:
            times[mode].append(save_once(base, state, mode))
    out = {"dir": base, "bytes": nbytes,
           "median_s": {m: statistics.median(v) for m, v in times.items()},
           "min_s": {m: min(v) for m, v in times.items()}, "max_s": {m: max(v) for m, v in times.items()}}
    out["median_GBps"] = {m: nbytes / s / 1e9 for m, s in out["median_s"].items()}
    out["direct_over_buffered_throughput"] = out["median_s"]["buffered"] / out["median_s"]["direct"]
    d = tempfile.mkdtemp(dir=base, prefix="wm-auto-")
    try:
        s = Store(d, write_mode="auto")  # a fresh learner: nothing measured yet
        piece = {f"t{i}": torch.randn(4 << 20, generator=g) for i in range(4)}  # 64 MiB tensors: 4 large shards
        for u in range(auto_saves):
            alpha_ckpt.save(piece, store=s, run="bench", step="auto", update=u, cursor=0, epoch=0)
            for t in piece.values():
                t.add_(1.0)
        out["auto"] = s.write_modes.stats()
        s.close()
    finally:
        shutil.rmtree(d)
    return out


def fmt(gbps: dict) -> str:
    return ", ".join(f"{m} [{' '.join(f'{x:.2f}' for x in v)}] GB/s" for m, v in gbps.items())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench write-modes", description=__doc__.split("\n\n")[0])
    p.add_argument("--dirs", nargs="+", default=[tempfile.gettempdir()])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--auto-saves", type=int, default=6)
    args = p.parse_args(argv)
    results = []
    for base in args.dirs:
        r = measure(base, args.size_mib, args.reps, args.auto_saves)
        results.append(r)
        print(f"{base}: buffered {r['median_GBps']['buffered']:.2f} GB/s, direct {r['median_GBps']['direct']:.2f} GB/s "
              f"(median of {args.reps}; direct/buffered throughput {r['direct_over_buffered_throughput']:.2f}); "
              f"auto measured {fmt(r['auto']['gbps'])} and settled on {r['auto']['next']}"
              + (" (O_DIRECT refused)" if r["auto"]["direct_refused"] else ""), flush=True)
    return {"file_systems": results}


