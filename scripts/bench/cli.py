"""The command line of ``scripts/bench_store.py`` (whose header says what each section measures):
its options, the driver that runs the chosen sections in turn, and the rank processes' entry."""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback

import torch

import alpha_ckpt
from alpha_ckpt.store import DEFAULT_WRITE_MODE, DEFAULT_WRITE_THREADS, WRITE_MODES

from .checkpointer import run_checkpointer
from .checkpointer_rank import checkpointer_process
from .common import (MiB, REPO_ROOT, code_under_test, default_base_dir, make_state, memory_touch_rates, poison,
                     set_store_writes)
from .many_tensors import MANY_METHODS, run_many_tensors
from .owners import owner_process, run_owners
from .stall import run_stall
from .store import run_store

SECTIONS = ("store", "stall", "owners", "checkpointer", "sharded")
NAMED_SECTIONS = ("many-tensors",)  # run only when named, not by "all"


def owner_processes(config: dict) -> None:
    """Rank 0 of the owners or checkpointer section: fork the other ranks (before any torch work or thread),
    run, reap them."""
    target = checkpointer_process if config.get("section") == "checkpointer" else owner_process
    children: list[int] = []
    rank = 0
    for r in range(1, config["world"]):
        pid = os.fork()
        if pid == 0:
            rank, children = r, []
            break
        children.append(pid)
    if rank:
        code = 0
        try:
            target({**config, "rank": rank})
        except BaseException:  # noqa: BLE001 - reported, then this forked owner exits without unwinding into main
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        target({**config, "rank": 0})
    except BaseException:
        for pid in children:  # they may wait in a collective that rank 0 will never join
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        failed = []
        for pid in children:
            # A rank that lost a peer fails its next collective and exits; reap every one.
            _, status = os.waitpid(pid, 0)
            if status:
                failed.append(pid)
    if failed:
        raise SystemExit(f"owner process(es) {failed} failed")


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    sections = SECTIONS if "all" in args.section else tuple(s for s in SECTIONS if s in args.section)
    sections += tuple(s for s in NAMED_SECTIONS if s in args.section)
    base = args.dir if args.dir else default_base_dir()
    os.makedirs(base, exist_ok=True)
    top = tempfile.mkdtemp(prefix="bench_store.", dir=base)

    try:
        t0 = time.perf_counter()
        state = dest = None
        if "store" in sections or "stall" in sections:
            state = make_state(args.size_mib, args.tensors, args.seed)
            dest = {k: torch.empty_like(v) for k, v in state.items()}
            poison(dest)  # touch every destination page once, before anything is timed
        gc.freeze()  # the per-step gc.collect() then scans only what the methods left, not torch's own objects
        gen_s = time.perf_counter() - t0
        nbytes = args.size_mib * MiB
        numel = nbytes // (4 * args.tensors)

        sized = "" if sections == NAMED_SECTIONS else \
            f"; {args.tensors} x float32[{numel}] = {nbytes / MiB:.0f} MiB ({nbytes / 1e9:.3f} GB)"
        print(f"bench_store: sections {', '.join(sections)}{sized}, {args.reps} rep(s) after {args.warmup} warm-up "
              f"round(s), seed {args.seed} (state built in {gen_s:.1f} s)")
        print(f"  working dir {top}  (st_dev {os.stat(top).st_dev:#x}; repo st_dev {os.stat(REPO_ROOT).st_dev:#x})")
        code = code_under_test()
        print(f"  alpha_ckpt {alpha_ckpt.__version__} at commit {code['commit']}, uncommitted: {', '.join(code['dirty']) or 'none'}"
              f" (sources sha256 {code['source_sha256']})" if code["dirty"] is not None else
              f"  alpha_ckpt {alpha_ckpt.__version__} (not a git checkout; sources sha256 {code['source_sha256']})")
        print(f"  python {platform.python_version()}, torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
              f"cpus {os.cpu_count()}")
        print(f"  prefault {args.prefault:g} x the bytes about to be written or read before each save and restore")
        machine = memory_touch_rates()
        print(f"  memory of this machine, one write per {mmap.PAGESIZE >> 10} KiB page, "
              f"{len(machine['fresh_memory_touch_GBps'])} rounds: new pages "
              f"{', '.join(f'{r:.2f}' for r in machine['fresh_memory_touch_GBps'])} GB/s, the same pages resident "
              f"{', '.join(f'{r:.0f}' for r in machine['resident_memory_touch_GBps'])} GB/s")
        sys.stdout.flush()

        result: dict = {"sections": list(sections), "code": code, "machine": machine}
        if "store" in sections:
            result.update(run_store(args, state, dest, top, code))  # top level, as before the other sections
        if "stall" in sections:
            result["stall"] = run_stall(args, state, dest, top)
        if "owners" in sections:
            state = dest = None
            gc.collect()
            result["owners"] = run_owners(args, top)
        if "checkpointer" in sections:
            state = dest = None
            gc.collect()
            result["checkpointer"] = run_checkpointer(args, top)
        if "sharded" in sections:
            state = dest = None
            gc.collect()
            result["sharded"] = run_checkpointer(args, top, sharded=True)
        if "many-tensors" in args.section:
            state = dest = None
            gc.collect()
            result["many-tensors"] = run_many_tensors(args, top)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    print()
    print(json.dumps(result, sort_keys=True, allow_nan=True))
    return result


def main(argv: list[str] | None = None, doc: str | None = None) -> dict | None:
    """Parse ``argv`` and run; ``doc``: the entry point's docstring, whose first paragraph describes the command."""
    p = argparse.ArgumentParser(description=(doc or __doc__).split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", nargs="+", choices=SECTIONS + NAMED_SECTIONS + ("all",), default=["store"],
                   help="what to measure: store (one process, save/restore against torch, DCP and raw disk), stall "
                        "(training stall of synchronous and asynchronous saves), owners (1/2/4 owner processes), "
                        "checkpointer (the collective Checkpointer against DCP on 2/4 ranks), sharded (DTensor state: "
                        "Checkpointer and alpha_ckpt.dcp against DCP on 2/4 ranks), or all of these (default: "
                        "store); many-tensors (states of --many-counts small tensors: ours against torch.save and "
                        "DCP) runs only when named")
    p.add_argument("--many-methods", nargs="+", choices=MANY_METHODS, metavar="METHOD",
                   help="many-tensors section: run only these of ckpt, ours, torch and dcp (torch and one of ours at "
                        "least; default all), e.g. to leave out DCP, whose save grows fast with the tensor count")
    p.add_argument("--many-counts", type=int, nargs="+", default=[1000, 10000, 100000],
                   help="many-tensors section: tensor counts (default 1000 10000 100000)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of the alternating method sequence (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of every method before the timed ones (default 1)")
    p.add_argument("--size-mib", type=int, default=1024, help="total state size in MiB (default 1024)")
    p.add_argument("--tensors", type=int, default=16, help="number of equal float32 tensors (default 16)")
    p.add_argument("--dir", default=None,
                   help="base directory for the working files (default: the temp dir if it is on the repo's file system, "
                        "else the repo's parent); a fresh subdirectory is created and removed")
    p.add_argument("--cold", action="store_true",
                   help="before every restore, sync and drop the cached pages of the checkpoint's files "
                        "(posix_fadvise DONTNEED): restores read from the device (sections store, owners, "
                        "checkpointer and sharded)")
    p.add_argument("--prefault", type=float, default=2.0,
                   help="before every save and every restore (untimed), touch and free this many times the state size "
                        "of anonymous memory (default 2; 0 disables)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random state (default 0)")
    p.add_argument("--compute-s", type=float, default=0.4,
                   help="stall section: seconds the simulated forward and backward pass takes alone (calibrated once "
                        "into a fixed matmul count; default 0.4)")
    p.add_argument("--owners", type=int, nargs="+", default=[1, 2, 4],
                   help="owners section: owner counts, alternated inside every repetition (default 1 2 4)")
    p.add_argument("--ckpt-methods", nargs="+", metavar="METHOD",
                   help="checkpointer and sharded sections: run only these of the section's methods (dcp and one of "
                        "ours at least; default all but ckpt-star-bf, the star writing buffered), e.g. to see what the "
                        "other methods in a round cost")
    p.add_argument("--resume-in-new-processes", action="store_true",
                   help="checkpointer and sharded sections: each round saves in one launch of the rank processes, "
                        "which exit, and restores in a new launch, as a restarted job does (default: a restore "
                        "follows its save in the same processes)")
    p.add_argument("--ckpt-ranks", type=int, nargs="+", default=[2, 4],
                   help="checkpointer section: rank counts, alternated inside every repetition (default 2 4)")
    p.add_argument("--fanout", type=int, default=8,
                   help="owners and checkpointer sections: fan-out of the publication tree (default 8)")
    p.add_argument("--owners-timeout", type=float, default=3600.0,
                   help="owners and checkpointer sections: give up when the rank processes take longer (seconds, "
                        "default 3600)")
    p.add_argument("--write-mode", choices=WRITE_MODES, default=DEFAULT_WRITE_MODE,
                   help=f"how our stores write large objects (the Store's write_mode; default {DEFAULT_WRITE_MODE})")
    p.add_argument("--write-threads", type=int, default=DEFAULT_WRITE_THREADS,
                   help=f"files of one batch our stores write at once (default {DEFAULT_WRITE_THREADS})")
    p.add_argument("--owner-process", help=argparse.SUPPRESS)  # internal: run one rank of owners or checkpointer
    args = p.parse_args(argv)
    if args.owner_process:
        config = json.loads(args.owner_process)
        set_store_writes(config["write_mode"], config["write_threads"])
        owner_processes(config)
        return None
    if args.write_threads < 1:
        p.error("--write-threads must be positive")
    set_store_writes(args.write_mode, args.write_threads)
    if args.reps < 1 or args.size_mib < 1 or args.tensors < 1 or args.warmup < 0 or args.prefault < 0:
        p.error("--reps, --size-mib and --tensors must be positive, --warmup and --prefault non-negative")
    if min(args.owners) < 1 or min(args.ckpt_ranks) < 1 or min(args.many_counts) < 1 or args.fanout < 1 \
            or args.compute_s < 0:
        p.error("--owners, --ckpt-ranks, --many-counts and --fanout must be positive, --compute-s non-negative")
    if args.many_methods and not ("torch" in args.many_methods and {"ckpt", "ours"} & set(args.many_methods)):
        p.error("--many-methods: torch and one of ckpt and ours at least")
    if args.tensors % 2 and ("checkpointer" in args.section or "all" in args.section):
        p.error("the checkpointer section splits --tensors into replicated and partitioned halves: it must be even")
    return run(args)
