"""What every section of the benchmark shares: constants, the page cache, memory, the state, medians,
ratio intervals and verdicts, balanced orders and per-process measurements."""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import resource
import statistics
import tempfile
import time
import warnings
from typing import Sequence

import numpy as np
import torch

from .record import REPO_ROOT
from alpha_ckpt.store import DEFAULT_WRITE_MODE, DEFAULT_WRITE_THREADS, Store, WriteModes

MiB = 1 << 20
RAW_BUFFER_BYTES = 16 * MiB

# DCP without a process group says, once per call, that it assumes one process.
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")


# How the stores this process opens write (--write-mode, --write-threads). One learner per mode and
# process, so that under "auto" the rounds' fresh stores learn from each other as one job's saves do.
_writes: dict = {"mode": DEFAULT_WRITE_MODE, "threads": DEFAULT_WRITE_THREADS, "learners": {}}


def set_store_writes(mode: str, threads: int) -> None:
    _writes.update(mode=mode, threads=threads, learners={})


def store_writes() -> dict:
    """The settings, for a rank process's config."""
    return {"write_mode": _writes["mode"], "write_threads": _writes["threads"]}


def write_modes(mode: str | None = None) -> WriteModes:
    """This process's learner of ``mode`` (default: --write-mode)."""
    mode = mode or _writes["mode"]
    learner = _writes["learners"].get(mode)
    if learner is None:
        learner = _writes["learners"][mode] = WriteModes(mode)
    return learner


def open_store(path: str, create: bool = True, mode: str | None = None) -> Store:
    """A store at ``path`` writing as --write-mode and --write-threads say (``mode``: another mode)."""
    return Store(path, create=create, write_mode=write_modes(mode), write_threads=_writes["threads"])


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict_page_cache(path: str) -> int:
    """Write back everything, then drop the cached pages of every file under ``path`` (a method's
    checkpoint): its restore reads from the device. Needs no root, unlike drop_caches, and leaves
    the rest of the page cache (Python, torch) as it was. Returns the bytes still cached (0 when
    the kernel dropped them all; it keeps pages that are dirty or mapped)."""
    os.sync()
    left = 0
    for where, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(where, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                left += cached_bytes(fd)
            finally:
                os.close(fd)
    return left


def evicted(path: str) -> None:
    """:func:`evict_page_cache`, or stop the run if the kernel kept any page (the restore would not be cold)."""
    left = evict_page_cache(path)
    if left:
        raise SystemExit(f"--cold: {left} bytes of {path} stayed in the page cache after fadvise(DONTNEED)")


def cached_bytes(fd: int) -> int:
    """How many bytes of the open file are in the page cache (mincore of a read-only mapping)."""
    size = os.fstat(fd).st_size
    if not size:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap for mincore failed")
    try:
        page = mmap.PAGESIZE
        vec = ctypes.create_string_buffer((size + page - 1) // page)
        if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(b & 1 for b in vec.raw) * page
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)


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


def memory_touch_rates(nbytes: int = 256 * MiB, rounds: int = 3) -> dict[str, list[float]]:
    """GB/s of writing one byte per page of ``nbytes``, each round in new anonymous memory (the kernel
    and, on a VM, the host supply every page: what any first touch, of page cache or of a fresh buffer,
    pays) and then again in the same, now resident, pages. The gap between the two is this machine's
    price of fresh memory, which decides cold restores on some VMs (docs/bench-log/2026-12.md); it varies
    from round to round there, so every round is kept."""
    fresh, resident = [], []
    for _ in range(rounds):
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        pages = np.frombuffer(buf, dtype=np.uint8)[::mmap.PAGESIZE]
        for rates in (fresh, resident):
            t0 = time.perf_counter()
            pages.fill(1)
            rates.append(nbytes / 1e9 / (time.perf_counter() - t0))
        del pages
        buf.close()
    return {"fresh_memory_touch_GBps": fresh, "resident_memory_touch_GBps": resident}


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


def paired_ratio_interval(ours_s: Sequence[float], base_s: Sequence[float], *, confidence: float = 0.9,
                          resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the throughput ratio median(base_s) / median(ours_s).

    ``ours_s[i]`` and ``base_s[i]`` are seconds measured in the same round, so
    rounds are resampled as pairs: what slowed a whole round (the disk, the
    host) moves both sides together instead of widening the interval. With one
    round the interval is that round's ratio. Deterministic for a given seed.
    """
    if len(ours_s) != len(base_s) or not ours_s:
        raise ValueError(f"paired samples needed: {len(ours_s)} and {len(base_s)} rounds")
    ours, base = np.asarray(ours_s, dtype=np.float64), np.asarray(base_s, dtype=np.float64)
    rounds = np.random.default_rng(seed).integers(0, len(ours), size=(resamples, len(ours)))
    ratios = np.median(base[rounds], axis=1) / np.median(ours[rounds], axis=1)
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)


INTERVAL_MIN_ROUNDS = 5  # fewer rounds resample to a handful of medians: no interval is claimed


def noise_verdict(point: float, interval: tuple[float, float] | None, goal: float) -> str:
    """Whether a ratio's miss or hit of a ``>= goal`` target stands out of the rounds' spread."""
    if interval is None:
        return f"too few rounds to judge (under {INTERVAL_MIN_ROUNDS})"
    if interval[0] >= goal:
        return "met beyond noise"
    if interval[1] < goal:
        return "missed beyond noise"
    return "met, within noise" if point >= goal else "missed, within noise"


def print_ratios(ratios: dict[str, float], targets: dict[str, tuple[str, float]], indent: str = "  ",
                 intervals: dict[str, tuple[float, float]] | None = None) -> None:
    for k, v in ratios.items():
        if k in targets:
            op, goal = targets[k]
            ok = v <= goal if op == "<=" else v >= goal
            verdict = f"target {op} {goal:<4}  {'MET' if ok else 'MISSED'}"
            if intervals and k in intervals:
                spread = intervals[k]
                shown = f"90% [{spread[0]:5.3f}, {spread[1]:5.3f}]" if spread else "90% [  -  ,   -  ]"
                verdict += f"   {shown} {noise_verdict(v, spread, goal)}"
        else:
            verdict = "(information)"
        print(f"{indent}{k:<44} {v:6.3f}   {verdict}")


def targets_met(ratios: dict[str, float], targets: dict[str, tuple[str, float]]) -> dict[str, bool]:
    return {k: (ratios[k] <= g if op == "<=" else ratios[k] >= g) for k, (op, g) in targets.items()}


def balanced_orders(methods: Sequence[str]) -> list[tuple[str, ...]]:
    """Orders of ``methods`` in which every method directly follows every other equally often.

    A Williams design: n orders for an even n, 2n for an odd n (the n orders and their mirror
    images). What a method leaves behind (freed pages, a busy device) slows whatever runs next;
    a plain rotation keeps one neighbour before each method, so one method paid for another in
    every round (measured: swapping two methods' places swapped which one loaded slowly).
    """
    n = len(methods)
    first = [0]
    for j in range(1, n):
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    rows = [[(a + i) % n for a in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [tuple(methods[i] for i in row) for row in rows]


def reset_peak_rss() -> int | None:
    """Reset this process's peak RSS (VmHWM) to its current RSS; return that RSS in KiB (None: not possible here)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return proc_status_kib("VmRSS")


def process_cpu_s() -> tuple[float, float]:
    """User and system CPU seconds of this process so far (every thread of it). Kept apart: on a VM
    the system time of the same page-cache write varies from round to round, for every method."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_growth_mib(base_kib: int | None) -> float:
    """How far this process's RSS peaked above ``base_kib`` since :func:`reset_peak_rss` (NaN when unknown)."""
    peak = proc_status_kib("VmHWM")
    return (peak - base_kib) / 1024 if base_kib is not None and peak is not None else math.nan
