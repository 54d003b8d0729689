"""Section "store": one process, save and restore, ours against torch.save, DCP and raw disk."""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
from typing import Callable

from .common import check_equal, evicted, median, poison, prefault, print_ratios, targets_met
from .methods import RawDisk, dcp_restore, dcp_save, dcp_t2_save, ours_restore, ours_save, torch_restore, torch_save

METHODS = ("ours", "torch", "dcp", "dcp-t2", "raw")


def run_store(args: argparse.Namespace, state: dict, dest: dict, top: str, code: dict) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    raw = RawDisk(state, nbytes)
    prefault_bytes = int(args.prefault * nbytes)
    methods: dict[str, tuple[Callable, Callable, bool]] = {
        "ours": (ours_save, ours_restore, True),
        "torch": (torch_save, torch_restore, True),
        "dcp": (dcp_save, dcp_restore, True),
        "dcp-t2": (dcp_t2_save, dcp_restore, True),
        "raw": (raw.save, raw.restore, False),
    }
    times = {m: {"save": [], "load": []} for m in METHODS}
    verified = 0

    print()
    print(f"== section store: save and restore, one process; order per rep: {', '.join(METHODS)}")
    print(f"  restores: {'COLD page cache (sync + fadvise(DONTNEED) of the checkpoint files before each restore)' if args.cold else 'HOT page cache (restore right after the same method saved; files still cached)'}")
    print(f"  each restore verified with torch.equal (raw: not compared); "
          f"prefault {args.prefault:g} x state before each save and restore", flush=True)

    for rnd in range(args.warmup + args.reps):
        timed = rnd >= args.warmup
        label = f"rep {rnd - args.warmup}" if timed else "warm-up"
        for name in METHODS:
            save, restore, verify = methods[name]
            workdir = os.path.join(top, f"store-{name}-{rnd}")
            os.mkdir(workdir)
            os.sync()
            gc.collect()
            prefault(prefault_bytes)

            t = time.perf_counter()
            handle = save(state, workdir, rnd)
            save_s = time.perf_counter() - t

            poison(dest)
            if args.cold:
                evicted(workdir)
            gc.collect()
            prefault(prefault_bytes)
            t = time.perf_counter()
            restore(dest, workdir, handle)
            load_s = time.perf_counter() - t

            if verify:
                check_equal(name, state, dest)
                verified += 1
            if timed:
                times[name]["save"].append(save_s)
                times[name]["load"].append(load_s)
            shutil.rmtree(workdir)
            os.sync()  # issue the deletion's journal commit (and discards) now, not in the next method's fsync
            print(f"  {label:<7}  {name:<7} save {save_s:7.3f} s  {nbytes / save_s / 1e9:6.2f} GB/s   "
                  f"restore {load_s:7.3f} s  {nbytes / load_s / 1e9:6.2f} GB/s", flush=True)

    return report_store(args, nbytes, times, code, verified)


def report_store(args: argparse.Namespace, nbytes: int, times: dict, code: dict, verified: int) -> dict:
    med = {m: {k: median(v) for k, v in times[m].items()} for m in METHODS}
    gbps = {m: {k: nbytes / v / 1e9 for k, v in med[m].items()} for m in METHODS}
    cache = "cold" if args.cold else "hot"

    print()
    print(f"store: medians over {args.reps} rep(s), {nbytes / 1e9:.3f} GB per save, restores on a {cache.upper()} page cache")
    print(f"{'method':<8} {'save s':>8} {'save GB/s':>10} {'(min-max s)':>17}   {'restore s':>9} {'rest. GB/s':>10} {'(min-max s)':>17}")
    for m in METHODS:
        s, l = times[m]["save"], times[m]["load"]
        print(f"{m:<8} {med[m]['save']:8.3f} {gbps[m]['save']:10.2f} {f'({min(s):.3f}-{max(s):.3f})':>17}   "
              f"{med[m]['load']:9.3f} {gbps[m]['load']:10.2f} {f'({min(l):.3f}-{max(l):.3f})':>17}")
    print("  (raw restore = readinto of the raw file into the destination memory: a read-bandwidth reference)")

    ratios = {
        "ours_save/dcp_save": med["ours"]["save"] / med["dcp"]["save"],
        "ours_save/dcp_t2_save": med["ours"]["save"] / med["dcp-t2"]["save"],
        "ours_save_GBps/raw_write_GBps": gbps["ours"]["save"] / gbps["raw"]["save"],
        "ours_load/dcp_load": med["ours"]["load"] / med["dcp"]["load"],
        "ours_load/dcp_t2_load": med["ours"]["load"] / med["dcp-t2"]["load"],
        "ours_save/torch_save": med["ours"]["save"] / med["torch"]["save"],
        "ours_load/torch_load": med["ours"]["load"] / med["torch"]["load"],
        "ours_load_GBps/raw_read_GBps": gbps["ours"]["load"] / gbps["raw"]["load"],
    }
    targets = {
        "ours_save/dcp_save": ("<=", 1.0),
        "ours_save/dcp_t2_save": ("<=", 1.0),
        "ours_save_GBps/raw_write_GBps": (">=", 0.85),
        "ours_load/dcp_load": ("<=", 0.67),
        "ours_load/dcp_t2_load": ("<=", 0.67),
    }
    print()
    print("store: ratios (of medians)")
    print_ratios(ratios, targets)
    return {
        "bytes": nbytes, "tensors": args.tensors, "reps": args.reps, "warmup": args.warmup, "prefault": args.prefault,
        "cache": cache, "code": code, "median_s": med, "median_GBps": gbps, "ratios": ratios,
        "targets_met": targets_met(ratios, targets), "verified_restores": verified,
    }
