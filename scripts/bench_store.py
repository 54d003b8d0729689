#!/usr/bin/env python3
"""Benchmark: save and restore one float32 state with alpha_ckpt, torch.save and DCP, against raw disk.

What is measured
----------------
One state dict of ``--tensors`` float32 tensors totalling ``--size-mib`` MiB
(default 16 x 64 MiB = 1 GiB, random normal values from a fixed seed) is saved
and restored by each method below. Inside every repetition the methods run in
a fixed alternating order (ours, torch.save, dcp, dcp-t2, raw, then again), so
slow drift of the machine hits every method alike. Each method's restore is
timed right after that method's save, from a fresh directory that is deleted
(and ``sync``-ed, so ext4 discards are not charged to the next method) once
both are measured.

  ours     ``alpha_ckpt.save(state, store=DIR, run="bench", step="fit", ...)``
           fsyncs every file and every directory it creates or renames into,
           and BLAKE3-hashes every byte. Restore: ``alpha_ckpt.load(dest, ...)``
           validates every byte (BLAKE3, zero padding, finiteness) and then
           copies in place into the preallocated destination tensors.
  torch    ``torch.save(state, f)`` + ``f.flush()`` + ``os.fsync`` + fsync of the
           directory. No hashing. Restore: ``torch.load(path, weights_only=True)``
           (which allocates fresh tensors), then ``copy_`` into the destination.
  dcp      ``torch.distributed.checkpoint.save(state, checkpoint_id=DIR)``,
           single process, no process group, default FileSystemWriter (one
           thread). fsyncs its data file and ``.metadata`` (``sync_files=True``);
           it does not fsync the directory. No hashing. Restore:
           ``dcp.load(dest, checkpoint_id=DIR)``, in place.
  dcp-t2   as dcp, with ``storage_writer=FileSystemWriter(DIR, thread_count=2)``.
  raw      the disk baseline, like ``dd bs=16M count=N conv=fsync``: ``os.write``
           of one reused 16 MiB buffer until the size is reached, then one
           ``os.fsync``. No hashing, no serialization. Its "restore" reads the
           file back into the destination tensors' memory with ``readinto``
           (a read-bandwidth reference; its bytes are the repeated buffer, so it
           is not compared with the source).

Memory effects of a VM. On a VM, guest memory that was never touched, or
that was freed and handed back to the host (balloon free page reporting), can
cost seconds per GiB when the guest uses it again: for page cache during a
save, for fresh anonymous memory during a restore (torch.load's new tensors,
a private copy of a mapped file). Without care that cost lands on whichever
method happens to allocate first after the previous method freed its files,
and it swamps the differences measured here. So (both untimed):

* ``--warmup`` rounds (default 1) run every method once before the timed ones;
* before every save and every restore, ``--prefault`` times the state size
  (default 2) of anonymous memory is touched and freed, so the kernel's free
  lists hold resident pages. Allocation itself (about 0.3 s/GiB of page
  faults and zeroing here) is still charged to the method that allocates.
  ``--prefault 0`` shows the raw effect.

Restores run on a hot page cache by default (the file was just written). With
``--cold`` the script runs ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches``
before every restore (root only), so restores read from the device.

The destination tensors are allocated once and overwritten with NaN before
every restore (outside the timing): their pages are resident, so no method's
restore is charged for faulting in fresh memory, and a restore that does
nothing cannot pass the check. After every restore (outside the timing) the
restored tensors are compared with the source with ``torch.equal``.

Reported: per method the median, min and max seconds and the median
throughput in GB/s (1e9 bytes / s, state bytes only), the target ratios, and
one final JSON line with every median and ratio.

Usage::

    python scripts/bench_store.py --size-mib 64 --reps 1 --warmup 0   # smoke run
    python scripts/bench_store.py --reps 5                            # the real one (~1 GiB state)
    python scripts/bench_store.py --reps 5 --cold                     # restores from the device
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import alpha_ckpt

MiB = 1 << 20
RAW_BUFFER_BYTES = 16 * MiB
DROP_CACHES = "/proc/sys/vm/drop_caches"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("ours", "torch", "dcp", "dcp-t2", "raw")

# DCP without a process group says, once per call, that it assumes one process.
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")


# ---------------------------------------------------------------- helpers


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def can_drop_caches() -> bool:
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_caches() -> None:
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def code_under_test() -> dict:
    """Which alpha_ckpt was measured: git commit, uncommitted files under alpha_ckpt/, digest of its sources."""
    pkg = os.path.dirname(os.path.abspath(alpha_ckpt.__file__))
    h = hashlib.sha256()
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    info = {"source_sha256": h.hexdigest()[:16], "commit": None, "dirty": None}
    try:
        git = ["git", "-C", os.path.dirname(pkg)]
        info["commit"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--", pkg], capture_output=True, text=True,
                               check=True).stdout.split("\n")
        info["dirty"] = sorted(line[3:] for line in dirty if line.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def default_base_dir() -> str:
    """The system temp dir when it lies on the same file system as the repo, else the repo's parent."""
    tmp = tempfile.gettempdir()
    if os.stat(tmp).st_dev == os.stat(REPO_ROOT).st_dev:
        return tmp
    return os.path.dirname(REPO_ROOT)


def prefault(nbytes: int) -> None:
    """Allocate, touch and free ``nbytes`` of anonymous memory, so the next allocations find resident pages."""
    if nbytes > 0:
        mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE).close()


def make_state(size_mib: int, tensors: int, seed: int) -> dict[str, torch.Tensor]:
    total = size_mib * MiB
    if total % (4 * tensors):
        raise SystemExit(f"--size-mib {size_mib} MiB does not split into {tensors} float32 tensors")
    numel = total // (4 * tensors)
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i:02d}.weight": torch.randn(numel, generator=gen, dtype=torch.float32) for i in range(tensors)}


def poison(dest: dict[str, torch.Tensor]) -> None:
    """Overwrite every destination word (keeps the pages resident; a no-op restore then fails the check)."""
    for t in dest.values():
        t.fill_(float("nan"))


def check_equal(method: str, src: dict[str, torch.Tensor], dest: dict[str, torch.Tensor]) -> None:
    bad = [k for k in src if not torch.equal(src[k], dest[k])]
    if bad:
        raise SystemExit(f"{method}: restored tensors differ from the source: {bad[:4]}{'...' if len(bad) > 4 else ''}")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


# ---------------------------------------------------------------- methods
# Each method: save(state, workdir, rep) -> handle ; restore(dest, workdir, handle) -> None.
# The timing brackets exactly these calls.


def ours_save(state, workdir: str, rep: int):
    return alpha_ckpt.save(state, store=workdir, run="bench", step="fit", update=rep, cursor=rep, epoch=0)


def ours_restore(dest, workdir: str, root) -> None:
    alpha_ckpt.load(dest, store=workdir, digest=root)


def torch_save(state, workdir: str, rep: int):
    path = os.path.join(workdir, "state.pt")
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(workdir)
    return path


@torch.no_grad()
def torch_restore(dest, workdir: str, path) -> None:
    loaded = torch.load(path, weights_only=True)
    for k, t in dest.items():
        t.copy_(loaded[k])
    del loaded


def dcp_save(state, workdir: str, rep: int):
    dcp.save(state, checkpoint_id=workdir)
    return workdir


def dcp_t2_save(state, workdir: str, rep: int):
    dcp.save(state, checkpoint_id=workdir, storage_writer=FileSystemWriter(workdir, thread_count=2))
    return workdir


def dcp_restore(dest, workdir: str, path) -> None:
    dcp.load(dest, checkpoint_id=path)


class RawDisk:
    """dd-like baseline: one reused buffer written until ``total`` bytes, one fsync at the end."""

    def __init__(self, state: dict[str, torch.Tensor], total: int):
        first = next(iter(state.values())).reshape(-1).view(torch.uint8)
        n = min(RAW_BUFFER_BYTES, total)
        if first.numel() >= n:
            self.buf = bytes(first[:n].numpy())
        else:
            self.buf = os.urandom(n)
        self.total = total

    def save(self, state, workdir: str, rep: int):
        path = os.path.join(workdir, "raw.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = self.total
            view = memoryview(self.buf)
            while left:
                chunk = view[:min(left, len(view))]
                while chunk:
                    n = os.write(fd, chunk)
                    chunk = chunk[n:]
                    left -= n
            os.fsync(fd)
        finally:
            os.close(fd)
        return path

    @staticmethod
    def restore(dest, workdir: str, path) -> None:
        with open(path, "rb", buffering=0) as f:
            for t in dest.values():
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{path} is shorter than the state")
                    view = view[n:]


# ---------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    base = args.dir if args.dir else default_base_dir()
    os.makedirs(base, exist_ok=True)
    top = tempfile.mkdtemp(prefix="bench_store.", dir=base)
    cold_ok = can_drop_caches()
    if args.cold and not cold_ok:
        shutil.rmtree(top, ignore_errors=True)
        raise SystemExit(f"--cold needs write access to {DROP_CACHES} (root); it is not writable here")

    t0 = time.perf_counter()
    state = make_state(args.size_mib, args.tensors, args.seed)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    poison(dest)  # touch every destination page once, before anything is timed
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    raw = RawDisk(state, nbytes)
    prefault_bytes = int(args.prefault * nbytes)
    gen_s = time.perf_counter() - t0

    methods: dict[str, tuple[Callable, Callable, bool]] = {
        "ours": (ours_save, ours_restore, True),
        "torch": (torch_save, torch_restore, True),
        "dcp": (dcp_save, dcp_restore, True),
        "dcp-t2": (dcp_t2_save, dcp_restore, True),
        "raw": (raw.save, raw.restore, False),
    }
    times = {m: {"save": [], "load": []} for m in METHODS}

    print(f"bench_store: {args.tensors} x float32[{state[next(iter(state))].numel()}] = {nbytes / MiB:.0f} MiB "
          f"({nbytes / 1e9:.3f} GB), {args.reps} rep(s) after {args.warmup} warm-up round(s), seed {args.seed} (state built in {gen_s:.1f} s)")
    print(f"  working dir {top}  (st_dev {os.stat(top).st_dev:#x}; repo st_dev {os.stat(REPO_ROOT).st_dev:#x})")
    code = code_under_test()
    print(f"  alpha_ckpt {alpha_ckpt.__version__} at commit {code['commit']}, uncommitted: {', '.join(code['dirty']) or 'none'}"
          f" (sources sha256 {code['source_sha256']})" if code["dirty"] is not None else
          f"  alpha_ckpt {alpha_ckpt.__version__} (not a git checkout; sources sha256 {code['source_sha256']})")
    print(f"  python {platform.python_version()}, torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}")
    print(f"  restores: {'COLD page cache (sync + drop_caches before each restore)' if args.cold else 'HOT page cache (restore right after the same method saved; files still cached)'}"
          f"; drop_caches {'available' if cold_ok else 'not available'}")
    print(f"  order per rep: {', '.join(METHODS)}; each restore verified with torch.equal (raw: not compared); "
          f"prefault {args.prefault:g} x state before each save and restore")
    sys.stdout.flush()

    try:
        for rnd in range(args.warmup + args.reps):
            timed = rnd >= args.warmup
            label = f"rep {rnd - args.warmup}" if timed else "warm-up"
            for name in METHODS:
                save, restore, verify = methods[name]
                workdir = os.path.join(top, f"{name}-{rnd}")
                os.mkdir(workdir)
                os.sync()
                gc.collect()
                prefault(prefault_bytes)

                t = time.perf_counter()
                handle = save(state, workdir, rnd)
                save_s = time.perf_counter() - t

                poison(dest)
                if args.cold:
                    drop_caches()
                gc.collect()
                prefault(prefault_bytes)
                t = time.perf_counter()
                restore(dest, workdir, handle)
                load_s = time.perf_counter() - t

                if verify:
                    check_equal(name, state, dest)
                if timed:
                    times[name]["save"].append(save_s)
                    times[name]["load"].append(load_s)
                shutil.rmtree(workdir)
                os.sync()  # issue the deletion's journal commit (and discards) now, not in the next method's fsync
                print(f"  {label:<7}  {name:<7} save {save_s:7.3f} s  {nbytes / save_s / 1e9:6.2f} GB/s   "
                      f"restore {load_s:7.3f} s  {nbytes / load_s / 1e9:6.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(top, ignore_errors=True)

    return report(args, nbytes, times, code)


def report(args: argparse.Namespace, nbytes: int, times: dict, code: dict) -> dict:
    med = {m: {k: median(v) for k, v in times[m].items()} for m in METHODS}
    gbps = {m: {k: nbytes / v / 1e9 for k, v in med[m].items()} for m in METHODS}
    cache = "cold" if args.cold else "hot"

    print()
    print(f"medians over {args.reps} rep(s), {nbytes / 1e9:.3f} GB per save, restores on a {cache.upper()} page cache")
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
    print("ratios (of medians)")
    for k, v in ratios.items():
        if k in targets:
            op, goal = targets[k]
            ok = v <= goal if op == "<=" else v >= goal
            verdict = f"target {op} {goal:<4}  {'MET' if ok else 'MISSED'}"
        else:
            verdict = "(information)"
        print(f"  {k:<32} {v:6.3f}   {verdict}")

    result = {
        "bytes": nbytes, "tensors": args.tensors, "reps": args.reps, "warmup": args.warmup, "prefault": args.prefault, "cache": cache, "code": code,
        "median_s": med, "median_GBps": gbps, "ratios": ratios,
        "targets_met": {k: (ratios[k] <= g if op == "<=" else ratios[k] >= g) for k, (op, g) in targets.items()},
    }
    print()
    print(json.dumps(result, sort_keys=True, allow_nan=True))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5, help="repetitions of the alternating method sequence (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of every method before the timed ones (default 1)")
    p.add_argument("--size-mib", type=int, default=1024, help="total state size in MiB (default 1024)")
    p.add_argument("--tensors", type=int, default=16, help="number of equal float32 tensors (default 16)")
    p.add_argument("--dir", default=None,
                   help="base directory for the working files (default: the temp dir if it is on the repo's file system, "
                        "else the repo's parent); a fresh subdirectory is created and removed")
    p.add_argument("--cold", action="store_true", help="sync and drop the page cache before every restore (root only)")
    p.add_argument("--prefault", type=float, default=2.0,
                   help="before every save and every restore (untimed), touch and free this many times the state size "
                        "of anonymous memory (default 2; 0 disables)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random state (default 0)")
    args = p.parse_args(argv)
    if args.reps < 1 or args.size_mib < 1 or args.tensors < 1 or args.warmup < 0 or args.prefault < 0:
        p.error("--reps, --size-mib and --tensors must be positive, --warmup and --prefault non-negative")
    run(args)


if __name__ == "__main__":
    main()
