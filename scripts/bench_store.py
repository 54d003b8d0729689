#!/usr/bin/env python3
"""Benchmark: save and restore one float32 state with alpha_ckpt, torch.save and DCP, against raw disk.

Five sections, chosen with ``--section`` (default ``store``; ``all`` runs the
five in turn, in one invocation), and a sixth that runs only when named:

  store    one process: save and restore, ours against torch.save, DCP and raw disk
  stall    one process, a simulated training loop: the training stall of
           synchronous and asynchronous saves, ours against DCP's save and async_save
  owners   1, 2 and 4 owner processes: save and restore throughput, ours (tree
           publisher) against DCP with a process group
  checkpointer  2 and 4 ranks: the collective ``alpha_ckpt.Checkpointer`` (star and
           tree publishers) against DCP with a process group, on a state that is
           half replicated and half partitioned
  sharded  2 and 4 ranks: FSDP2-style sharded state (DTensors, Shard(0)): the
           Checkpointer (star, tree) and DCP with alpha_ckpt's storage
           (``alpha_ckpt.dcp``) against DCP's own FileSystemWriter/Reader
  many-tensors  one process: states of many small tensors (``--many-counts``,
           default 1,000, 10,000 and 100,000), ours against torch.save and DCP

Section "store"
---------------
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
and it swamps the differences measured here. So, untimed:

* ``--warmup`` rounds (default 1) run every method once before the timed ones;
* before every save and every restore, ``--prefault`` times the state size
  (default 2) of anonymous memory is touched and freed, so the kernel's free
  lists hold resident pages. Allocation itself (page faults and zeroing,
  priced below) is still charged to the method that allocates.
  ``--prefault 0`` shows the raw effect.
* every run starts by measuring that price and reports it beside the
  results (``machine`` in the JSON): the GB/s of writing one byte per page
  into new anonymous memory, and into the same pages once resident. On a
  bare-metal node, where only the kernel supplies a page, expect several
  GB/s for the first; on the 2-core VM these numbers come from it was
  0.9-2.6 GB/s, so any method that first touches 1 GiB pays 0.4-1.1 s.

Warm-up and prefault apply to every section (an owner or rank prefaults
``--prefault`` times its own bytes); ``--cold`` applies to the restores of
store, owners, checkpointer and sharded.

Restores run on a hot page cache by default (the files were just written, and
stay cached, except what alpha_ckpt wrote with O_DIRECT: that is never in the
page cache, so its "hot" restore already reads from the device). With
``--cold`` the script runs ``sync`` and drops the cached pages of every file
of the checkpoint about to be restored (``posix_fadvise(DONTNEED)``; no root
needed; the run stops if any page stays cached) before every restore, so every
method's restore reads from the device, as a resume in fresh processes on
another node, or long after the save, does.

The destination tensors are allocated once and overwritten with NaN before
every restore (outside the timing): their pages are resident, so no method's
restore is charged for faulting in fresh memory, and a restore that does
nothing cannot pass the check. After every restore (outside the timing) the
restored tensors are compared with the source with ``torch.equal``.

Reported: per method the median, min and max seconds and the median
throughput in GB/s (1e9 bytes / s, state bytes only) and the target ratios.

Section "stall"
---------------
The same state in one process, driven like a training loop. Per checkpoint:
the save is called at the update boundary; then a simulated forward and
backward pass runs (``--compute-s`` seconds of 512x512 matmuls on tensors of
its own, calibrated once into a fixed count, the same for every method); then
the state is changed in place (``add_(1.0)`` on every tensor: the optimizer
step), which must first wait at the method's snapshot fence; then the loop
waits until the save is durable, so saves never pile up. The **stall** is the
time the loop was blocked by the checkpoint: the time inside the save call
plus the time waiting at the fence.

  ours-sync            ``alpha_ckpt.save``: the stall is the whole save
  ours-async           ``alpha_ckpt.save_async`` with one ``AsyncSaver`` reused for
                       the whole run; the snapshot is copied inside the call
  ours-async-deferred  as ours-async with ``defer_snapshot=True``: the copy runs in
                       the background; ``handle.wait_snapshot()`` is the fence
  dcp-sync             ``dcp.save``
  dcp-async            ``dcp.async_save`` with its defaults (a fresh staging copy
                       made inside the call); no fence
  dcp-async-staged     ``dcp.async_save`` with one ``DefaultStager`` reused for the
                       run (no pinned or shared memory, asynchronous staging,
                       blocking copies: what works on a CPU-only torch); the fence
                       is the response's ``staging_completion``

After each save (untimed) the checkpoint is read back (``alpha_ckpt.load`` or
``dcp.load``) and compared with a copy of the state taken at the boundary:
a snapshot that let the in-place change through fails the run. Reported per
method: median stall (call + fence), median seconds from the call to durable,
the simulated pass's time (a save running beside it slows it down: that cost
is not in the stall), stall / ours-sync save and stall / dcp-async stall.

Section "owners"
----------------
``max(--owners)`` processes (one interpreter that forks the others, gloo on
127.0.0.1), with a subgroup of ranks [0, n) for each count n. At count n,
tensor i of the state belongs to owner i % n: each owner holds 1/n of it, its
own distinct tensors. Inside every repetition each count runs every method in
turn; every timed section starts at a barrier and its time is the slowest
owner's.

  ours     each owner writes its tensors to its own shards, its group manifest
           and its commitment (``TreeRole`` over ``GroupTransport``, as the
           worker's tree publisher does); the root publishes the ref. Restore:
           each owner opens only its path (``open_generation(role=rank,
           wanted=...)``), validates every byte it reads (``PreparedRestore``),
           the owners agree (one all_reduce), then each copies into its
           preallocated tensors.
  dcp      ``dcp.save(state, checkpoint_id=DIR, process_group=...)``, default
           FileSystemWriter; restore ``dcp.load`` in place.
  dcp-t2   as dcp, ``FileSystemWriter(DIR, thread_count=2)``.
  raw      each owner writes its share dd-style and fsyncs; restore readinto
           (disk references, not compared with the source).

After every restore (untimed) each owner compares its tensors with
``torch.equal``. Reported: per count and method the median save and restore
seconds and GB/s (bytes of the whole state), and the throughput ratios.

Section "checkpointer"
----------------------
``max(--ckpt-ranks)`` processes (default 2 4; forked as in the owners section,
gloo on 127.0.0.1), with a subgroup of ranks [0, n) for each count n. The state
is ``--size-mib`` MiB in ``--tensors`` float32 vectors of equal size (default
16 x 64 MiB), half of them replicated and half partitioned:

  model    ``--tensors / 2`` tensors that every rank holds with the same values
           (written once by every method: the Checkpointer compares replicas by
           digest, DCP's planner dedups entries saved under the same key)
  moments  ``--tensors / 2`` flat regions (optimizer-moment-like); rank r of n
           holds the words ``shares(words, n)[r]`` of each

Methods, each into a fresh directory (removed after its restore). What one
method leaves behind slows the next one, so each round runs them in the next
order of a balanced (Williams) design: over 10 rounds here (five methods), 6 in
the sharded section, every method directly follows every other equally often.
A ``--reps`` of that many balances the medians exactly; a plain rotation did not
(each method had the same predecessor in every round, and swapping two methods'
places swapped which of them loaded slowly):

  ckpt-star  ``Checkpointer(DIR, run="bench", step="fit", group=..., publisher="star")``;
             untimed: the constructor and ``restore(state, root=None)`` (the fresh
             start). Timed: ``root = ckpt.save(state, update=u, cursor=u)``
             (every rank writes its own words and its share of the replicas and
             sends rank 0 their records; rank 0 writes the manifest and the ref),
             then ``ckpt.restore(dest, root=root)`` in
             place (every rank validates what it reads before any rank copies).
             State: ``{"model": {name: tensor}, "moments": {name:
             Partitioned(share, lo, hi, (words,))}}``.
  ckpt-tree  as ckpt-star with ``publisher="tree"`` and ``fanout=--fanout``: every
             rank writes its own shards and group manifest, the same replica share.
  ckpt-star-bf  only when named in ``--ckpt-methods``: as ckpt-star with the
             store's writes buffered whatever ``ALPHA_CKPT_WRITE_MODE`` says
             (``store.write_mode = "buffered"``, the store's default), as DCP's
             writer writes; compared with DCP as ours are.
  dcp        ``dcp.save(state, checkpoint_id=DIR, process_group=...)``, default
             FileSystemWriter; ``dcp.load`` in place. The replicated tensors under
             the same keys on every rank (``model.<name>``), each rank's shares as
             plain tensors under keys of its own (``moments.<name>.rank<r>``; not
             DTensors, so DCP cannot reshard them: the bytes are the same).
  dcp-t2     as dcp, ``FileSystemWriter(DIR, thread_count=2)``.
  raw        each rank writes 1/n of the state's bytes dd-style and fsyncs; its
             restore reads that back into the rank's destination memory with
             ``readinto``: the raw disk rate of this run (not compared).

Each timed phase starts at a barrier of all ranks; its time is the slowest
rank's; throughput is the whole state's bytes over it. After every restore
(untimed) every rank compares its replicated and partitioned destination
tensors with the source with ``torch.equal`` (NaN-poisoned before each
restore). Also reported, untimed: each rank's peak RSS growth during each
phase (VmHWM reset through /proc/self/clear_refs; it counts mapped file pages
too), the CPU seconds of the busiest rank's process in each phase (user +
system, and the system part alone: on a VM the system time of the same
page-cache write varies from round to round, for every method), the bytes
each rank's Checkpointer restore read (``last_restore``), and the bytes each
method left on disk. Ratios: ckpt-star and ckpt-tree throughput
over dcp's and dcp-t2's, save and load (target: at least 1.0; reported, never
enforced), and every method's save throughput over raw write. Beside each
target ratio: its 90% interval from a paired bootstrap over the rounds (both
methods of a round share that round's disk and host, so rounds are resampled
as pairs) and whether the MET or MISSED stands out of the rounds' spread
("met beyond noise": the whole interval is at or above the target; "missed
beyond noise": all of it below; otherwise "within noise"; under 5 rounds no
interval is claimed). On a machine whose
disk rate varies 2x between rounds, a median of a few rounds can land on
either side of 1.0; the interval says which verdicts more rounds would not
overturn. For information, the same ratios of each method's fastest round
(as ``timeit`` reports its minimum): where the host supplies page-cache memory
fast in some rounds and slowly in others, whichever method saves, they show
each method's speed without the slow rounds. The bootstrap takes a run's
rounds as exchangeable; a host slow for a stretch of the run breaks that
(docs/BENCHMARKS.md, "what decides a save on this VM").

Section "sharded"
-----------------
As the checkpointer section, on another state and with one more method. The
state is ``--tensors`` float32 matrices of 1024 columns (``--size-mib`` in all),
each a DTensor placed ``Shard(0)`` on a 1-D mesh of the n ranks (built with
``DTensor.from_local`` from this rank's rows), which is how FSDP2 holds
parameters and AdamW moments. Every method saves and restores these same
DTensors: ckpt-star and ckpt-tree as ``{"model": {name: dtensor}}`` (each rank
writes the word range its rows are), dcp and dcp-t2 as DCP's flat state dict,
and

  dcp-alpha  ``dcp.save(state, storage_writer=alpha_ckpt.dcp.StorageWriter(DIR,
             run="bench", step="fit", update=u, group=...))``, then
             ``dcp.load(dest, storage_reader=alpha_ckpt.dcp.StorageReader(DIR,
             root, group=...))``: DCP's planning, alpha_ckpt's store (BLAKE3,
             durable commit, the ref, validation before any copy).

Ratios: ckpt-star, ckpt-tree and dcp-alpha over dcp and dcp-t2.

``--resume-in-new-processes`` (checkpointer and sharded sections) makes each
round a stop and a restart: one launch of the rank processes saves with every
method and exits, and a new launch (its states built afresh, as a restarted
script builds its model) restores each checkpoint by the root its save
returned. By default a restore follows its save in the same processes, where
memory a buffered save touched is handed to the restore after it (see
docs/BENCHMARKS.md, "The first touch of page-cache memory").

``--ckpt-methods`` runs only some of the checkpointer and sharded sections'
methods (dcp and one of ours at least), in the same balanced order: what the
other methods of a round leave behind is part of what each one measures. It
also adds ckpt-star-bf, the star writing buffered: beside ckpt-star in a run
with ``ALPHA_CKPT_WRITE_MODE=auto`` or ``direct`` it shows what the writing
mode costs the save and the next restore.

Section "many-tensors"
----------------------
What costs per tensor rather than per byte: for each count in ``--many-counts``,
a state of that many tensors shaped like an MoE model's experts with their Adam
state (per expert a float32 [32, 16] weight and [32] bias, an exp_avg and
exp_avg_sq of each, and a 0-dim int64 step of each: mostly tiny tensors, about
0.8 KiB each on average), in a ``model`` and an ``optim`` dict. Each round runs
every method once, the order rotated by one method each round; each restore
goes into preallocated tensors (overwritten before it) and is compared with
``torch.equal``.

  ckpt     ``alpha_ckpt.Checkpointer`` on a 1-rank gloo group (created, and
           restored with None, untimed): ``save`` and ``restore(dest, root)``
  ours     ``alpha_ckpt.save`` / ``alpha_ckpt.load``, as in the store section
  torch    ``torch.save`` with fsync of the file and its directory /
           ``torch.load(weights_only=True)`` then ``copy_``, as in the store section
  dcp      ``dcp.save`` / ``dcp.load`` (on the 1-rank group), as in the store section

Both of ours hash every byte with BLAKE3 and fsync everything they write, as
always. Reported per count: medians, and ours over torch and over DCP (target:
at most 3x torch.save and torch.load).

Every section ends with its tables; the last line is one JSON object with
every median and ratio (the store section's keys at the top level, as before
the other sections existed; ``stall``, ``owners``, ``checkpointer`` and ``sharded`` beside them).

Usage::

    python scripts/bench_store.py --size-mib 64 --reps 1 --warmup 0   # smoke run
    python scripts/bench_store.py --reps 5                            # the real one (~1 GiB state)
    python scripts/bench_store.py --reps 5 --cold                     # restores from the device
    python scripts/bench_store.py --reps 5 --section all              # store, stall, owners and checkpointer
    python scripts/bench_store.py --reps 3 --section checkpointer     # Checkpointer against DCP, 2 and 4 ranks
    python scripts/bench_store.py --reps 3 --section sharded          # DTensor state: Checkpointer, alpha_ckpt.dcp, DCP
    python scripts/bench_store.py --size-mib 64 --reps 1 --warmup 0 --section all   # smoke run of all
    python scripts/bench_store.py --reps 3 --section many-tensors     # 1,000 / 10,000 / 100,000 small tensors
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import hashlib
import json
import math
import mmap
import os
import platform
import resource
import shutil
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Callable, Sequence

import blake3
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import alpha_ckpt
import alpha_ckpt.dcp as alpha_dcp
from alpha_ckpt.format import CapturePrefix, RegionDecl
from alpha_ckpt.planner import Hierarchy, Piece, WantedSlice, pack_shards, shares
from alpha_ckpt.publish.tree import GroupTransport, TreeRole
from alpha_ckpt.restore import PreparedRestore, open_generation
from alpha_ckpt.store import Store
from alpha_ckpt.writer import DEFAULT_MAX_SHARD_BYTES

MiB = 1 << 20
RAW_BUFFER_BYTES = 16 * MiB
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


def memory_touch_rates(nbytes: int = 256 * MiB, rounds: int = 3) -> dict[str, list[float]]:
    """GB/s of writing one byte per page of ``nbytes``, each round in new anonymous memory (the kernel
    and, on a VM, the host supply every page: what any first touch, of page cache or of a fresh buffer,
    pays) and then again in the same, now resident, pages. The gap between the two is this machine's
    price of fresh memory, which decides cold restores on some VMs (docs/BENCHMARKS.md); it varies
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

    def save(self, state, workdir: str, rep: int, name: str = "raw.bin"):
        path = os.path.join(workdir, name)
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
# ---------------------------------------------------------------- section "store"


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


# ---------------------------------------------------------------- section "stall"
# One training loop, one process. Per checkpoint: the save is called at the
# update boundary, the simulated forward and backward pass runs (it never
# touches the state), the state is then changed in place (the optimizer step),
# which must first wait at the method's snapshot fence; the loop then waits for
# the save to be durable before the next repetition, so saves never pile up.
# The stall is the time the loop was blocked by the checkpoint: the time inside
# the save call plus the time waiting at the fence.

STALL_METHODS = ("ours-sync", "ours-async", "ours-async-deferred", "dcp-sync", "dcp-async", "dcp-async-staged")


class SimulatedCompute:
    """A forward and backward pass stand-in: a fixed number of matmuls on small tensors of its own."""

    SIDE = 512

    def __init__(self, seconds: float, seed: int):
        gen = torch.Generator().manual_seed(seed + 1)
        self.a = torch.randn(self.SIDE, self.SIDE, generator=gen)
        self.b = torch.randn(self.SIDE, self.SIDE, generator=gen)
        self.out = torch.empty(self.SIDE, self.SIDE)
        self.matmuls = 0
        if seconds > 0:
            for _ in range(5):
                torch.mm(self.a, self.b, out=self.out)
            per = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(10):
                    torch.mm(self.a, self.b, out=self.out)
                per.append((time.perf_counter() - t) / 10)
            self.matmuls = max(1, round(seconds / statistics.median(per)))

    def run(self) -> None:
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b, out=self.out)


class Pending:
    """One checkpoint in flight: its snapshot fence, its wait for durability, and its read-back."""

    def __init__(self, *, fence: Callable[[], None] = lambda: None, wait: Callable[[], float],
                 load: Callable[[dict], None]):
        self.fence, self.wait, self.load = fence, wait, load


def completion_clock(future) -> Callable[[], float]:
    """A function that returns perf_counter() at the moment ``future`` completed, as a done callback
    saw it; it waits for that callback, since ``future.result()`` can return before callbacks run."""
    done: list[float] = []
    recorded = threading.Event()

    def record(_) -> None:
        done.append(time.perf_counter())
        recorded.set()

    future.add_done_callback(record)

    def completed_at() -> float:
        recorded.wait()
        return done[0]

    return completed_at


class StallMethods:
    """The six checkpoint methods of the stall section; ``start`` is the call at the update boundary."""

    def __init__(self):
        self.saver = alpha_ckpt.AsyncSaver()  # one for the whole run: it reuses its snapshot buffers
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))

    def close(self) -> None:
        self.saver.close()
        self.stager.close()

    def start(self, name: str, state: dict, workdir: str, rep: int, t0: float) -> Pending:
        if name == "ours-sync":
            root = ours_save(state, workdir, rep)
            done = time.perf_counter()
            return Pending(wait=lambda: done - t0, load=lambda dest: ours_restore(dest, workdir, root))
        if name in ("ours-async", "ours-async-deferred"):
            store = alpha_ckpt.Store(workdir)
            handle = alpha_ckpt.save_async(state, store=store, run="bench", step="fit", update=rep, cursor=rep,
                                           epoch=0, saver=self.saver, defer_snapshot=name == "ours-async-deferred")
            published = []

            def wait() -> float:
                try:
                    published.append(handle.result())
                finally:
                    store.close()
                return handle.save_s  # from the boundary to the durable result

            return Pending(fence=handle.wait_snapshot, wait=wait,
                           load=lambda dest: ours_restore(dest, workdir, published[0].root))
        if name == "dcp-sync":
            dcp_save(state, workdir, rep)
            done = time.perf_counter()
            return Pending(wait=lambda: done - t0, load=lambda dest: dcp_restore(dest, workdir, workdir))
        if name == "dcp-async":
            future = dcp.async_save(state, checkpoint_id=workdir)  # defaults: the copy is made inside the call
            done = completion_clock(future)

            def wait_default() -> float:
                future.result()
                return done() - t0

            return Pending(wait=wait_default, load=lambda dest: dcp_restore(dest, workdir, workdir))
        if name == "dcp-async-staged":
            response = dcp.async_save(state, checkpoint_id=workdir, async_stager=self.stager)
            done = completion_clock(response.upload_completion)

            def wait_staged() -> float:
                response.upload_completion.result()
                return done() - t0

            return Pending(fence=response.staging_completion.result, wait=wait_staged,
                           load=lambda dest: dcp_restore(dest, workdir, workdir))
        raise ValueError(name)


@torch.no_grad()
def optimizer_step(state: dict[str, torch.Tensor]) -> None:
    """The in-place change after the boundary (every word changes: |x| + 1 stays far below 2**24)."""
    for t in state.values():
        t.add_(1.0)


def run_stall(args: argparse.Namespace, state: dict, dest: dict, top: str) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    prefault_bytes = int(args.prefault * nbytes)
    boundary = {k: torch.empty_like(v) for k, v in state.items()}  # the values at the boundary, for the check
    poison(boundary)
    compute = SimulatedCompute(args.compute_s, args.seed)
    methods = StallMethods()
    keys = ("stall", "call", "fence", "compute", "save")
    times = {m: {k: [] for k in keys} for m in STALL_METHODS}
    verified = 0

    print()
    print(f"== section stall: one training loop, one process; order per rep: {', '.join(STALL_METHODS)}")
    print(f"  per checkpoint: save call at the boundary, {compute.matmuls} matmuls {SimulatedCompute.SIDE}x"
          f"{SimulatedCompute.SIDE} (about {args.compute_s:g} s alone), fence, in-place add on every tensor, wait "
          "until durable; stall = call + fence")
    print("  after each save (untimed) the checkpoint is read back and compared with the values at the boundary",
          flush=True)

    try:
        for rnd in range(args.warmup + args.reps):
            timed = rnd >= args.warmup
            label = f"rep {rnd - args.warmup}" if timed else "warm-up"
            for name in STALL_METHODS:
                workdir = os.path.join(top, f"stall-{name}-{rnd}")
                os.mkdir(workdir)
                for k, t in state.items():
                    boundary[k].copy_(t)
                os.sync()
                gc.collect()
                prefault(prefault_bytes)

                t0 = time.perf_counter()
                pending = methods.start(name, state, workdir, rnd, t0)
                t1 = time.perf_counter()
                compute.run()
                t2 = time.perf_counter()
                pending.fence()
                t3 = time.perf_counter()
                optimizer_step(state)
                save_s = pending.wait()

                sample = {"stall": (t1 - t0) + (t3 - t2), "call": t1 - t0, "fence": t3 - t2, "compute": t2 - t1,
                          "save": save_s}
                poison(dest)
                pending.load(dest)
                check_equal(name, boundary, dest)  # the snapshot is the boundary's values, not the changed ones
                verified += 1
                if timed:
                    for k in keys:
                        times[name][k].append(sample[k])
                shutil.rmtree(workdir)
                os.sync()
                print(f"  {label:<7}  {name:<19} stall {sample['stall']:7.3f} s (call {sample['call']:.3f} + fence "
                      f"{sample['fence']:.3f})  compute {sample['compute']:6.3f} s  durable after {save_s:7.3f} s",
                      flush=True)
    finally:
        methods.close()
    return report_stall(args, nbytes, times, compute, verified)


def report_stall(args: argparse.Namespace, nbytes: int, times: dict, compute: SimulatedCompute, verified: int) -> dict:
    med = {m: {k: median(v) for k, v in times[m].items()} for m in STALL_METHODS}
    sync_save = med["ours-sync"]["save"]
    dcp_stall = med["dcp-async"]["stall"]
    print()
    print(f"stall: medians over {args.reps} rep(s), {nbytes / 1e9:.3f} GB per checkpoint; "
          f"simulated compute {compute.matmuls} matmuls")
    print(f"{'method':<20} {'stall s':>8} {'(min-max)':>15} {'call s':>7} {'fence s':>8} {'compute s':>9} "
          f"{'save s':>7} {'stall/ours-sync save':>21} {'stall/dcp-async stall':>22}")
    for m in STALL_METHODS:
        s = times[m]["stall"]
        print(f"{m:<20} {med[m]['stall']:8.3f} {f'({min(s):.3f}-{max(s):.3f})':>15} {med[m]['call']:7.3f} "
              f"{med[m]['fence']:8.3f} {med[m]['compute']:9.3f} {med[m]['save']:7.3f} "
              f"{med[m]['stall'] / sync_save:21.3f} {med[m]['stall'] / dcp_stall:22.3f}")
    print("  save s = from the call to durable; compute s = the simulated pass, slowed by a save running beside it")
    ratios = {}
    for m in STALL_METHODS:
        ratios[f"{m}_stall/ours-sync_save"] = med[m]["stall"] / sync_save
        ratios[f"{m}_stall/dcp-async_stall"] = med[m]["stall"] / dcp_stall
    ratios["dcp-async-staged_stall/dcp-sync_save"] = med["dcp-async-staged"]["stall"] / med["dcp-sync"]["save"]
    targets = {
        "ours-async_stall/ours-sync_save": ("<=", 0.10),
        "ours-async_stall/dcp-async_stall": ("<=", 1.0),
        "ours-async-deferred_stall/ours-sync_save": ("<=", 0.10),
        "ours-async-deferred_stall/dcp-async_stall": ("<=", 1.0),
    }
    print()
    print("stall: ratios (of medians)")
    print_ratios({k: ratios[k] for k in targets}, targets)
    print("  (every method's stall / ours-sync save and / dcp-async stall: in the table above)")
    return {"bytes": nbytes, "reps": args.reps, "warmup": args.warmup, "compute_matmuls": compute.matmuls,
            "compute_s_target": args.compute_s, "median_s": med, "ratios": ratios,
            "targets_met": targets_met(ratios, targets), "verified_saves": verified}


# ---------------------------------------------------------------- section "owners"
# N owner processes (gloo on 127.0.0.1), one process group of the largest
# count and a subgroup of ranks [0, n) for each count n. Tensor i of the state
# is owned at count n by rank i % n, so each owner holds 1/n of the state (its
# own distinct tensors) and a rank's tensors at a larger count are a subset of
# those at a smaller one: every rank builds its tensors once. Every timed
# section starts at a barrier of all ranks; its time is the largest over the
# owners taking part.

OWNER_METHODS = ("ours", "dcp", "dcp-t2", "raw")
OWNERS_RESULT = "owners_result.json"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_owners(args: argparse.Namespace, top: str) -> dict:
    counts = sorted(set(args.owners))
    world = counts[-1]
    workdir = os.path.join(top, "owners")
    os.mkdir(workdir)
    config = {"world": world, "counts": counts, "port": free_port(), "dir": workdir, "size_mib": args.size_mib,
              "tensors": args.tensors, "seed": args.seed, "reps": args.reps, "warmup": args.warmup,
              "prefault": args.prefault, "cold": args.cold, "fanout": args.fanout}
    if args.tensors % world:
        raise SystemExit(f"--tensors {args.tensors} does not split evenly among {world} owners")
    print()
    print(f"== section owners: {', '.join(map(str, counts))} owner process(es), gloo on 127.0.0.1; order per rep: "
          f"for each owner count: {', '.join(OWNER_METHODS)}")
    print(f"  tensor i belongs to owner i % n; times are the largest over the owners; each restore verified with "
          f"torch.equal (raw: not compared); restores on a {'COLD' if args.cold else 'HOT'} page cache", flush=True)
    result = launch_ranks(args, config, "owners", OWNERS_RESULT)
    return report_owners(args, result)


def launch_ranks(args: argparse.Namespace, config: dict, section: str, result_name: str) -> dict:
    """Run ``config['world']`` rank processes of ``section`` (owners or checkpointer); return rank 0's result file."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(alpha_ckpt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # One fresh interpreter imports torch once and forks the other ranks (starting each with
    # spawn would import torch once per rank: seconds each on this machine).
    config = {**config, "section": section}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--owner-process", json.dumps(config)], env=env)
    try:
        code = proc.wait(timeout=args.owners_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit(f"{section} section failed: the ranks did not finish within {args.owners_timeout:g} s") from None
    if code:
        raise SystemExit(f"{section} section failed: the rank processes exited with {code}")
    with open(os.path.join(config["dir"], result_name)) as f:
        return json.load(f)


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


def owner_process(config: dict) -> None:
    """One owner of the owners section: rank ``config['rank']`` of ``config['world']``."""
    rank, world, counts = config["rank"], config["world"], config["counts"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    groups = {n: dist.new_group(list(range(n)), backend="gloo") for n in counts}  # every rank joins every new_group
    tensors, total_mib = config["tensors"], config["size_mib"]
    if (total_mib * MiB) % (4 * tensors):
        raise SystemExit(f"--size-mib {total_mib} MiB does not split into {tensors} float32 tensors")
    numel = total_mib * MiB // (4 * tensors)
    names = [f"layer{i:02d}.weight" for i in range(tensors)]
    regions = tuple(RegionDecl(i, names[i], "float32", (numel,)) for i in range(tensors))
    smallest = min((n for n in counts if n > rank), default=None)
    held = [i for i in range(tensors) if smallest is not None and i % smallest == rank]
    source = {i: torch.randn(numel, generator=torch.Generator().manual_seed(config["seed"] * 100_003 + i))
              for i in held}
    dest = {i: torch.empty(numel) for i in held}
    for t in dest.values():
        t.fill_(float("nan"))
    state_bytes = tensors * numel * 4
    gc.freeze()  # the per-step gc.collect() then scans only what the methods left, not torch's own objects
    times = {str(n): {m: {"save": [], "load": []} for m in OWNER_METHODS} for n in counts}
    verified = 0
    top = config["dir"]

    def barrier() -> None:
        dist.barrier()

    def largest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    for rnd in range(config["warmup"] + config["reps"]):
        timed = rnd >= config["warmup"]
        label = f"rep {rnd - config['warmup']}" if timed else "warm-up"
        for n in counts:
            member = rank < n
            mine = [i for i in range(tensors) if i % n == rank] if member else []
            own_bytes = len(mine) * numel * 4
            group = groups[n]
            for method in OWNER_METHODS:
                directory = os.path.join(top, f"{method}-n{n}-{rnd}")
                if rank == 0:
                    os.mkdir(directory)
                    os.sync()
                barrier()
                gc.collect()
                if member:
                    prefault(int(config["prefault"] * own_bytes))
                barrier()
                t = time.perf_counter()
                handle = owner_save(method, config, directory, rank, n, group, regions, mine, source, rnd) \
                    if member else None
                save_s = largest(time.perf_counter() - t if member else 0.0)

                for i in mine:
                    dest[i].fill_(float("nan"))
                barrier()
                if config["cold"] and rank == 0:
                    evicted(directory)
                gc.collect()
                if member:
                    prefault(int(config["prefault"] * own_bytes))
                barrier()
                t = time.perf_counter()
                if member:
                    owner_restore(method, directory, rank, n, group, mine, dest, numel, handle)
                load_s = largest(time.perf_counter() - t if member else 0.0)

                bad = sum(1 for i in mine if not torch.equal(source[i], dest[i])) if method != "raw" else 0
                bad_total = torch.tensor([bad], dtype=torch.int64)
                dist.all_reduce(bad_total)
                if int(bad_total.item()):
                    raise SystemExit(f"owners: {method} with {n} owner(s): {int(bad_total.item())} restored tensor(s) "
                                     "differ from the source")
                if method != "raw":
                    verified += 1
                barrier()
                if rank == 0:
                    shutil.rmtree(directory)
                    os.sync()
                    if timed:
                        times[str(n)][method]["save"].append(save_s)
                        times[str(n)][method]["load"].append(load_s)
                    print(f"  {label:<7}  {n} owner(s)  {method:<7} save {save_s:7.3f} s  "
                          f"{state_bytes / save_s / 1e9:6.2f} GB/s   restore {load_s:7.3f} s  "
                          f"{state_bytes / load_s / 1e9:6.2f} GB/s", flush=True)
    barrier()
    if rank == 0:
        out = {"bytes": state_bytes, "counts": counts, "times": times, "verified_restores": verified,
               "fanout": config["fanout"]}
        path = os.path.join(top, OWNERS_RESULT)
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)
    dist.destroy_process_group()


def owner_save(method: str, config: dict, directory: str, rank: int, n: int, group, regions, mine: list[int],
               source: dict[int, torch.Tensor], rep: int):
    state = {regions[i].name: source[i] for i in mine}
    if method == "ours":
        # This owner's tensors to its own shards, its group manifest and commitment; the root publishes the ref.
        store = Store(directory)
        try:
            pieces = [Piece(i, 0, regions[i].words, 4) for i in mine]
            views = {i: memoryview(source[i].view(torch.uint8).numpy()) for i in mine}
            shards = [[(p, views[p.ordinal][p.lo * 4:p.hi * 4], "raw") for p in packed]
                      for packed in pack_shards(pieces, DEFAULT_MAX_SHARD_BYTES)]
            role = TreeRole(store, Hierarchy(n, config["fanout"]), rank, GroupTransport(group), timeout=120.0)
            prefix = CapturePrefix("bench", "fit", rep, rep, 0)
            completion = role.complete(role.commit(prefix, regions, shards, blake3.blake3().hexdigest(), None))
        finally:
            store.close()
        if not completion["ok"]:
            raise SystemExit(f"owner {rank}: tree publication failed: {completion['reason']}")
        return completion["root"]
    if method == "dcp":
        dcp.save(state, checkpoint_id=directory, process_group=group)
        return None
    if method == "dcp-t2":
        dcp.save(state, storage_writer=FileSystemWriter(directory, thread_count=2), process_group=group)
        return None
    if method == "raw":
        nbytes = sum(source[i].numel() * 4 for i in mine)
        return RawDisk(state, nbytes).save(None, directory, rep, name=f"raw-{rank}.bin")
    raise ValueError(method)


def owner_restore(method: str, directory: str, rank: int, n: int, group, mine: list[int],
                  dest: dict[int, torch.Tensor], numel: int, handle) -> None:
    if method == "ours":
        # As a resume does: validate this owner's part completely, agree, then copy in place.
        store = Store(directory, create=False)
        generation = None
        try:
            wanted = [WantedSlice(i, 0, numel, k) for k, i in enumerate(mine)]
            generation = open_generation(store, handle, role=rank, wanted=wanted)
            prepared = PreparedRestore(generation, wanted)
            agreed = torch.tensor([1], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
            prepared.copy_into([dest[i].view(torch.uint8) for i in mine])
        finally:
            if generation is not None:
                generation.close()
            store.close()
        return
    if method in ("dcp", "dcp-t2"):
        dcp.load({f"layer{i:02d}.weight": dest[i] for i in mine}, checkpoint_id=directory, process_group=group)
        return
    if method == "raw":
        RawDisk.restore({str(i): dest[i] for i in mine}, directory, handle)
        return
    raise ValueError(method)


def report_owners(args: argparse.Namespace, result: dict) -> dict:
    nbytes, counts, times = result["bytes"], result["counts"], result["times"]
    med = {n: {m: {k: median(v) for k, v in times[str(n)][m].items()} for m in OWNER_METHODS} for n in counts}
    gbps = {n: {m: {k: nbytes / v / 1e9 for k, v in med[n][m].items()} for m in OWNER_METHODS} for n in counts}
    print()
    print(f"owners: medians over {args.reps} rep(s), {nbytes / 1e9:.3f} GB per save in all, time = slowest owner, "
          f"restores on a {'COLD' if args.cold else 'HOT'} page cache")
    print(f"{'owners':>6} {'method':<8} {'save s':>8} {'save GB/s':>10} {'(min-max s)':>17}   {'restore s':>9} "
          f"{'rest. GB/s':>10} {'(min-max s)':>17}")
    for n in counts:
        for m in OWNER_METHODS:
            s, l = times[str(n)][m]["save"], times[str(n)][m]["load"]
            print(f"{n:>6} {m:<8} {med[n][m]['save']:8.3f} {gbps[n][m]['save']:10.2f} "
                  f"{f'({min(s):.3f}-{max(s):.3f})':>17}   {med[n][m]['load']:9.3f} {gbps[n][m]['load']:10.2f} "
                  f"{f'({min(l):.3f}-{max(l):.3f})':>17}")
    print("  (raw: each owner writes its share dd-style from one reused 16 MiB buffer and fsyncs; its restore is a "
          "readinto: disk references)")
    ratios: dict[str, dict[str, float]] = {}
    met: dict[str, dict[str, bool]] = {}
    targets = {
        "ours_save_GBps/dcp_save_GBps": (">=", 1.5),
        "ours_save_GBps/dcp_t2_save_GBps": (">=", 1.0),
        "ours_restore_GBps/dcp_load_GBps": (">=", 2.0),
    }
    print()
    print("owners: throughput ratios (of medians)")
    for n in counts:
        g = gbps[n]
        r = {
            "ours_save_GBps/dcp_save_GBps": g["ours"]["save"] / g["dcp"]["save"],
            "ours_save_GBps/dcp_t2_save_GBps": g["ours"]["save"] / g["dcp-t2"]["save"],
            "ours_restore_GBps/dcp_load_GBps": g["ours"]["load"] / g["dcp"]["load"],
            "ours_restore_GBps/dcp_t2_load_GBps": g["ours"]["load"] / g["dcp-t2"]["load"],
            "ours_save_GBps/raw_write_GBps": g["ours"]["save"] / g["raw"]["save"],
            "dcp_save_GBps/raw_write_GBps": g["dcp"]["save"] / g["raw"]["save"],
        }
        ratios[str(n)], met[str(n)] = r, targets_met(r, targets)
        print(f"  {n} owner(s)")
        print_ratios(r, targets, indent="    ")
    return {"bytes": nbytes, "counts": counts, "reps": args.reps, "warmup": args.warmup, "cache":
            "cold" if args.cold else "hot", "fanout": result["fanout"],
            "median_s": {str(n): v for n, v in med.items()}, "median_GBps": {str(n): v for n, v in gbps.items()},
            "ratios": ratios, "targets_met": met, "verified_restores": result["verified_restores"]}


# ---------------------------------------------------------------- section "checkpointer"
# The collective ``alpha_ckpt.Checkpointer`` against DCP with a process group, on
# the same state. One interpreter forks ``max(--ckpt-ranks)`` ranks (the owners
# section's machinery); each count n runs on the subgroup of ranks [0, n). The
# state is half replicated (``model``: every rank holds the same tensors) and
# half partitioned (``moments``: flat regions, rank r holding the words
# ``shares(words, n)[r]``). Every timed phase starts at a barrier of all ranks;
# its time is the slowest rank's.

CKPT_METHODS = ("ckpt-star", "ckpt-tree", "dcp", "dcp-t2", "raw")
BASELINES = ("dcp", "dcp-t2", "raw")  # what ours are compared with (raw: the disk's rate, not a target)
OURS_STORE_METHODS = ("ckpt-star", "ckpt-tree", "ckpt-star-bf", "dcp-alpha")  # the methods writing alpha_ckpt stores
# The sharded section adds DCP with alpha_ckpt's storage (alpha_ckpt.dcp) as "dcp-alpha".
SHARDED_METHODS = ("ckpt-star", "ckpt-tree", "dcp-alpha", "dcp", "dcp-t2", "raw")
# Only by --ckpt-methods: the star with the store's writes buffered whatever ALPHA_CKPT_WRITE_MODE says,
# as DCP's FileSystemWriter writes, so a run under "auto" or "direct" compares how the writing mode moves
# cost between a save and the next restore.
BUFFERED_STAR = "ckpt-star-bf"
SHARDED_COLS = 1024  # columns of every sharded matrix (rows: what the size leaves)
CKPT_RESULT = "checkpointer_result.json"


def row_sharded_matrices(shape: tuple[int, int], count: int, meshes: dict, seed: int) -> tuple[dict, dict]:
    """``count`` random matrices of ``shape`` (matrix i seeded ``seed + i``) as DTensors placed
    ``Shard(0)`` on each 1-D mesh of ``meshes``: ({key: {name: source}}, {key: {name: NaN destination}})."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    src: dict = {key: {} for key in meshes}
    dest: dict = {key: {} for key in meshes}
    for i in range(count if meshes else 0):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed + i))
        for key, mesh in meshes.items():
            (rows, _), (row0, _) = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
            local = full[row0:row0 + rows].clone()
            for side, data in ((src, local), (dest, torch.full_like(local, float("nan")))):
                side[key][f"w{i:02d}"] = DTensor.from_local(data, mesh, [Shard(0)], run_check=False,
                                                            shape=torch.Size(shape), stride=(shape[1], 1))
        del full
    return src, dest


def known_methods(sharded: bool) -> tuple[str, ...]:
    """Every method a section can run, in its order: its defaults and the optional buffered star."""
    every = SHARDED_METHODS if sharded else CKPT_METHODS
    return every[:2] + (BUFFERED_STAR,) + every[2:]


def section_methods(config_or_result: dict) -> tuple[str, ...]:
    """The section's methods: all of them, or the ``--ckpt-methods`` subset in the section's own order."""
    every = SHARDED_METHODS if config_or_result.get("sharded") else CKPT_METHODS
    return tuple(config_or_result.get("methods") or every)  # chosen_methods keeps the section's order


def chosen_methods(wanted: Sequence[str] | None, sharded: bool) -> list[str] | None:
    """Check a ``--ckpt-methods`` subset for a section: DCP's default writer and one of ours at least."""
    if not wanted:
        return None
    unknown = [m for m in wanted if m not in known_methods(True)]
    if unknown:
        raise SystemExit(f"--ckpt-methods: no method {', '.join(unknown)} (choose from "
                         f"{', '.join(known_methods(True))})")
    every = known_methods(sharded)
    chosen = [m for m in every if m in wanted]  # dcp-alpha is the sharded section's only
    if "dcp" not in chosen or not [m for m in chosen if m not in BASELINES]:
        raise SystemExit(f"--ckpt-methods: the {'sharded' if sharded else 'checkpointer'} section needs dcp and at "
                         f"least one of its own methods ({', '.join(m for m in every if m not in BASELINES)})")
    return chosen


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


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (what a method left on disk)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def byte_views(tensors: list[torch.Tensor], nbytes: int) -> dict[str, torch.Tensor]:
    """Flat uint8 views over ``tensors``, in order, covering exactly ``nbytes`` (the raw restore's destination)."""
    out, left = {}, nbytes
    for i, t in enumerate(tensors):
        if not left:
            break
        flat = t.reshape(-1).view(torch.uint8)
        take = min(left, flat.numel())
        out[str(i)] = flat[:take]
        left -= take
    if left:
        raise ValueError(f"the destination holds {nbytes - left} bytes, not {nbytes}")
    return out


def run_checkpointer(args: argparse.Namespace, top: str, sharded: bool = False) -> dict:
    counts = sorted(set(args.ckpt_ranks))
    world = counts[-1]
    name = "sharded" if sharded else "checkpointer"
    workdir = os.path.join(top, name)
    os.mkdir(workdir)
    config = {"world": world, "counts": counts, "port": free_port(), "dir": workdir, "size_mib": args.size_mib,
              "tensors": args.tensors, "seed": args.seed, "reps": args.reps, "warmup": args.warmup,
              "prefault": args.prefault, "cold": args.cold, "fanout": args.fanout, "sharded": sharded,
              "methods": chosen_methods(args.ckpt_methods, sharded)}
    print()
    print(f"== section {name}: alpha_ckpt.Checkpointer{' and alpha_ckpt.dcp' if sharded else ''} against DCP, "
          f"{', '.join(map(str, counts))} rank(s), gloo on 127.0.0.1; per rep, for each rank count, every method in "
          f"turn: {', '.join(section_methods(config))} (each round the next order of a balanced design: every method "
          f"follows every other equally often over {len(balanced_orders(section_methods(config)))} rounds)")
    if sharded:
        print(f"  state: {args.tensors} float32 matrices of {SHARDED_COLS} columns as DTensors placed Shard(0) on a 1-D "
              "mesh of the ranks, as FSDP2 holds parameters and AdamW moments; every method saves and restores the "
              "same DTensors")
    else:
        print(f"  state: {args.tensors // 2} replicated tensors (model) + {args.tensors // 2} partitioned regions "
              "(moments, shares() of the ranks)")
    print(f"  times are the slowest rank's; each restore verified with torch.equal (raw: not compared); restores on a "
          f"{'COLD' if args.cold else 'HOT'} page cache" + (", each round's restores in new processes (one launch saves "
                                                            "with every method and exits, the next restores)"
                                                            if args.resume_in_new_processes else ""), flush=True)
    if not args.resume_in_new_processes:
        return report_checkpointer(args, launch_ranks(args, config, "checkpointer", CKPT_RESULT))
    return report_checkpointer(args, resumed_rounds(args, config))


def resumed_rounds(args: argparse.Namespace, config: dict) -> dict:
    """Every round as a stop and a restart: one launch of the ranks saves with every method and
    exits, a new launch restores what it wrote. The halves' results merged as one launch's."""
    merged: dict = {}
    for rnd in range(args.warmup + args.reps):
        saved = launch_ranks(args, {**config, "phase": "save", "round": rnd}, "checkpointer", CKPT_RESULT)
        restored = launch_ranks(args, {**config, "phase": "restore", "round": rnd, "handles": saved["handles"]},
                                "checkpointer", CKPT_RESULT)
        merged = merge_round_halves(merged, saved, restored)
    return merged


def merge_round_halves(merged: dict, saved: dict, restored: dict) -> dict:
    """``merged`` (empty at first) with one more round whose save launch wrote ``saved`` and whose
    restore launch wrote ``restored``: each launch timed one half ("save" lists in the first,
    "load" lists in the second); the per-round lists are appended, the restores counted."""
    out = json.loads(json.dumps(merged or {**restored, "disk_bytes": saved["disk_bytes"], "verified_restores": 0}))
    for table in ("times", "rss", "cpu", "cpu_sys"):
        for n, per_method in out[table].items():
            for m, phases in per_method.items():
                if merged:
                    phases["load"] += restored[table][n][m]["load"]
                    phases["save"] += saved[table][n][m]["save"]
                else:
                    phases["save"] = list(saved[table][n][m]["save"])
    modes = out.setdefault("write_modes", {})
    for n, per_method in saved.get("write_modes", {}).items():
        for m, saves in per_method.items():
            modes.setdefault(n, {}).setdefault(m, [])
            modes[n][m] = (modes[n][m] if merged else []) + saves  # the save launch's
    out["verified_restores"] += restored["verified_restores"]
    out["resumed_in_new_processes"] = True
    return out


def checkpointer_process(config: dict) -> None:
    """One rank of the checkpointer section: rank ``config['rank']`` of ``config['world']``."""
    rank, world, counts = config["rank"], config["world"], config["counts"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    groups = {n: dist.new_group(list(range(n)), backend="gloo") for n in counts}  # every rank joins every new_group
    tensors, total_mib = config["tensors"], config["size_mib"]
    numel = total_mib * MiB // (4 * tensors)
    half = tensors // 2
    state_bytes = tensors * numel * 4
    replicated_bytes = half * numel * 4
    seed = config["seed"] * 100_003
    member_of = [n for n in counts if rank < n]
    sharded, methods = bool(config.get("sharded")), section_methods(config)

    # model: the same values on every rank (the same seeds). moments: region j is one random
    # vector of ``numel`` words; at count n this rank keeps its share of it.
    rep_names = [f"layer{i:02d}" for i in range(half)]
    part_names = [f"m{j:02d}" for j in range(half)]
    rep_src = {k: torch.randn(numel, generator=torch.Generator().manual_seed(seed + i))
               for i, k in enumerate(rep_names)} if member_of else {}
    ranges = {n: shares(numel, n)[rank] for n in member_of}
    part_src: dict[int, dict[str, torch.Tensor]] = {n: {} for n in member_of}
    for j, k in enumerate(part_names):
        if not member_of:
            break
        full = torch.randn(numel, generator=torch.Generator().manual_seed(seed + 50_000 + j))
        for n in member_of:
            lo, hi = ranges[n]
            part_src[n][k] = full[lo:hi].clone()
        del full
    rep_dest = {k: torch.full_like(v, float("nan")) for k, v in rep_src.items()}
    part_dest = {n: {k: torch.full_like(v, float("nan")) for k, v in part_src[n].items()} for n in member_of}
    own_bytes = {n: replicated_bytes + half * (ranges[n][1] - ranges[n][0]) * 4 for n in member_of}
    # The raw reference: at count n each rank writes its 1/n of the state's bytes dd-style and reads it
    # back into its own destination memory (which is poisoned again before every restore).
    raw_bytes = {n: shares(state_bytes, n)[rank][1] - shares(state_bytes, n)[rank][0] for n in member_of}
    raws = {n: RawDisk(rep_src, raw_bytes[n]) for n in member_of}
    raw_dest = {n: byte_views(list(rep_dest.values()) + list(part_dest[n].values()), raw_bytes[n]) for n in member_of}

    # The sharded section: every tensor a (rows, SHARDED_COLS) matrix, a DTensor placed Shard(0) on the
    # ranks of count n (this rank's rows of it), as FSDP2 holds parameters and AdamW moments.
    dts: dict[str, dict[int, dict[str, torch.Tensor]]] = {"src": {}, "dest": {}}
    if sharded:
        from torch.distributed.device_mesh import DeviceMesh
        cols = SHARDED_COLS if numel % SHARDED_COLS == 0 else 1
        shape = (numel // cols, cols)
        rep_src, rep_dest, replicated_bytes = {}, {}, 0
        meshes = {n: DeviceMesh.from_group(groups[n], "cpu") for n in member_of}
        dts["src"], dts["dest"] = row_sharded_matrices(shape, tensors, meshes, seed + 90_000)
        own_bytes = {n: sum(t.to_local().nbytes for t in dts["src"][n].values()) for n in member_of}
        raw_bytes = dict(own_bytes)
        raws = {n: RawDisk({k: t.to_local() for k, t in dts["src"][n].items()}, raw_bytes[n]) for n in member_of}
        raw_dest = {n: byte_views([t.to_local() for t in dts["dest"][n].values()], raw_bytes[n]) for n in member_of}

    def ckpt_state(n: int, rep: dict, part: dict) -> dict:
        lo, hi = ranges[n]
        return {"model": dict(rep),
                "moments": {k: alpha_ckpt.Partitioned(t, lo, hi, (numel,)) for k, t in part.items()}}

    def dcp_state(rep: dict, part: dict) -> dict:
        # Replicated tensors under the same key on every rank (DCP's planner writes each once);
        # this rank's share of each region as a plain tensor under a key of its own.
        return {**{f"model.{k}": t for k, t in rep.items()}, **{f"moments.{k}.rank{rank}": t for k, t in part.items()}}

    def ours(n: int, which: str) -> dict:
        """The state the Checkpointer saves (``which`` "src") or restores into ("dest")."""
        if sharded:
            return {"model": dict(dts[which][n])}
        return ckpt_state(n, *((rep_src, part_src[n]) if which == "src" else (rep_dest, part_dest[n])))

    def theirs(n: int, which: str) -> dict:
        """The same state as DCP's flat state dict."""
        if sharded:
            return {f"model.{k}": t for k, t in dts[which][n].items()}
        return dcp_state(*((rep_src, part_src[n]) if which == "src" else (rep_dest, part_dest[n])))

    gc.freeze()  # the per-step gc.collect() then scans only what the methods left, not torch's own objects
    times = {str(n): {m: {"save": [], "load": []} for m in methods} for n in counts}
    rss = {str(n): {m: {"save": [], "load": []} for m in methods} for n in counts}
    cpu = {str(n): {m: {"save": [], "load": []} for m in methods} for n in counts}  # user + system, per rank
    cpu_sys = {str(n): {m: {"save": [], "load": []} for m in methods} for n in counts}  # system alone, per rank
    bytes_read = {str(n): {} for n in counts}
    disk_bytes = {str(n): {} for n in counts}
    write_modes = {str(n): {m: [] for m in methods if m in OURS_STORE_METHODS} for n in counts}
    modes_seen = {n: 0 for n in counts}  # this process's store writes (measured per file system and count of ranks)
    handles: dict[str, dict[str, str | None]] = {str(n): {} for n in counts}
    verified = 0
    top = config["dir"]
    # phase None: every round saves and restores in these processes. "save" or "restore": this
    # launch runs one half of round config["round"] (--resume-in-new-processes): the saves, or
    # the restores of what the save launch wrote (config["handles"]), as a restarted job does.
    phase = config.get("phase")

    def barrier() -> None:
        dist.barrier()

    def largest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def per_rank(value: float) -> list[float]:
        t = torch.zeros(world, dtype=torch.float64)
        t[rank] = value
        dist.all_reduce(t)
        return t.tolist()

    def poison_dest(n: int) -> None:
        dest = [t.to_local() for t in dts["dest"][n].values()] if sharded else \
            list(rep_dest.values()) + list(part_dest[n].values())
        for t in dest:
            t.fill_(float("nan"))

    def differing(n: int) -> int:
        if sharded:
            return sum(1 for k, t in dts["src"][n].items() if not torch.equal(t.to_local(), dts["dest"][n][k].to_local()))
        bad = sum(1 for k in rep_src if not torch.equal(rep_src[k], rep_dest[k]))
        return bad + sum(1 for k in part_src[n] if not torch.equal(part_src[n][k], part_dest[n][k]))

    def checkpointer(n: int, method: str, directory: str):
        """This rank's Checkpointer of ``method`` on the store ``directory`` (untimed; collective)."""
        publisher = "star" if method == BUFFERED_STAR else method[len("ckpt-"):]
        ckpt = alpha_ckpt.Checkpointer(directory, run="bench", step="fit", group=groups[n], publisher=publisher,
                                       fanout=config["fanout"])
        if method == BUFFERED_STAR:
            ckpt.store.write_mode = "buffered"
        return ckpt

    def timed_phase(n: int, run: Callable[[], object]) -> tuple[object, float, tuple[list[float], list[float]],
                                                                 list[float]]:
        """Prefault, then time ``run`` on the members of count n: (its result, the slowest rank's
        seconds, (each rank's CPU seconds, user + system, and its system seconds), each rank's peak
        RSS growth)."""
        member = rank < n
        gc.collect()
        if member:
            prefault(int(config["prefault"] * own_bytes[n]))
        barrier()
        base = reset_peak_rss()
        cpu0 = process_cpu_s()
        t = time.perf_counter()
        result = run() if member else None
        elapsed = time.perf_counter() - t if member else 0.0
        user, system = (b - a for a, b in zip(cpu0, process_cpu_s())) if member else (0.0, 0.0)
        used = per_rank(user + system)[:n], per_rank(system)[:n]
        grown = per_rank(peak_growth_mib(base) if member else 0.0)[:n]
        return result, largest(elapsed), used, grown

    def save(n: int, method: str, directory: str, rnd: int, ckpt) -> object:
        group = groups[n]
        if ckpt is not None:
            return ckpt.save(ours(n, "src"), update=rnd + 1, cursor=rnd + 1)
        if method == "dcp":
            dcp.save(theirs(n, "src"), checkpoint_id=directory, process_group=group)
        elif method == "dcp-t2":
            dcp.save(theirs(n, "src"), process_group=group, storage_writer=FileSystemWriter(directory, thread_count=2))
        elif method == "dcp-alpha":
            writer = alpha_dcp.StorageWriter(directory, run="bench", step="fit", update=rnd + 1, group=group)
            return dcp.save(theirs(n, "src"), process_group=group, storage_writer=writer).storage_meta.checkpoint_id
        else:
            return raws[n].save(None, directory, rnd, name=f"raw-{rank}.bin")
        return None

    def restore(n: int, method: str, directory: str, handle, ckpt) -> None:
        group = groups[n]
        if ckpt is not None:
            ckpt.restore(ours(n, "dest"), root=handle)
        elif method in ("dcp", "dcp-t2"):
            dcp.load(theirs(n, "dest"), checkpoint_id=directory, process_group=group)
        elif method == "dcp-alpha":
            dcp.load(theirs(n, "dest"), process_group=group,
                     storage_reader=alpha_dcp.StorageReader(directory, handle, group=group))
        else:
            RawDisk.restore(raw_dest[n], directory, os.path.join(directory, f"raw-{rank}.bin"))

    orders = balanced_orders(methods)
    for rnd in range(config["warmup"] + config["reps"]) if phase is None else [config["round"]]:
        timed = rnd >= config["warmup"]
        label = f"rep {rnd - config['warmup']}" if timed else "warm-up"
        order = orders[(rnd - config["warmup"]) % len(orders)]
        for n in counts:
            member = rank < n
            for method in order:
                directory = os.path.join(top, f"{method}-n{n}-{rnd}")
                ours_here = member and method.startswith("ckpt-")
                line = f"  {label:<7}  {n} rank(s)  {method:<12}"
                if phase != "restore":
                    if rank == 0:
                        os.mkdir(directory)
                        os.sync()
                    barrier()
                    ckpt = checkpointer(n, method, directory) if ours_here else None
                    if ckpt is not None:
                        ckpt.restore(ours(n, "src"), root=None)  # untimed: a fresh start of this run (collective)
                    handle, save_s, save_cpu, save_rss = timed_phase(n, lambda: save(n, method, directory, rnd, ckpt))
                    line += (f" save {save_s:7.3f} s  {state_bytes / save_s / 1e9:6.2f} GB/s   peak RSS +MiB save "
                             f"rank 0 {save_rss[0]:6.0f} (others max {max(save_rss[1:], default=0.0):5.0f})")
                    if rank == 0 and method in OURS_STORE_METHODS:
                        # The write mode(s) the store chose for this save's large shards ("auto": by measurement).
                        with Store(directory) as store:
                            modes = store.write_stats(n)["modes"]  # the saves of n ranks at once
                        line += f"  write mode {'+'.join(modes[modes_seen[n]:]) or '-'}"
                        if timed:
                            write_modes[str(n)][method].append(modes[modes_seen[n]:])
                        modes_seen[n] = len(modes)
                    if rank == 0:
                        disk_bytes[str(n)][method] = tree_bytes(directory)
                        handles[str(n)][method] = handle if isinstance(handle, str) and method != "raw" else None
                        if timed:
                            times[str(n)][method]["save"].append(save_s)
                            rss[str(n)][method]["save"].append(save_rss)
                            cpu[str(n)][method]["save"].append(save_cpu[0])
                            cpu_sys[str(n)][method]["save"].append(save_cpu[1])
                    if phase == "save":
                        if ckpt is not None:
                            ckpt.close()
                        barrier()
                        if rank == 0:
                            print(line, flush=True)
                        continue
                else:  # a new process restores what the save launch wrote, by the root it returned
                    handle = config["handles"][str(n)][method]
                    ckpt = checkpointer(n, method, directory) if ours_here else None

                if member:
                    poison_dest(n)
                barrier()
                if config["cold"] and rank == 0:
                    evicted(directory)
                _, load_s, load_cpu, load_rss = timed_phase(n, lambda: restore(n, method, directory, handle, ckpt))
                read = per_rank(ckpt.last_restore["bytes_read"] if ckpt is not None else 0.0)[:n]

                bad = 0
                if member and method != "raw":
                    bad = differing(n)
                bad_total = torch.tensor([bad], dtype=torch.int64)
                dist.all_reduce(bad_total)
                if int(bad_total.item()):
                    raise SystemExit(f"checkpointer: {method} with {n} rank(s): {int(bad_total.item())} restored "
                                     "tensor(s) differ from the source")
                if method != "raw":
                    verified += 1
                if ckpt is not None:
                    ckpt.close()
                barrier()
                if rank == 0:
                    shutil.rmtree(directory)
                    os.sync()
                    if method.startswith("ckpt-"):
                        bytes_read[str(n)][method] = read
                    if timed:
                        times[str(n)][method]["load"].append(load_s)
                        rss[str(n)][method]["load"].append(load_rss)
                        cpu[str(n)][method]["load"].append(load_cpu[0])
                        cpu_sys[str(n)][method]["load"].append(load_cpu[1])
                    print(f"{line}   restore {load_s:7.3f} s  {state_bytes / load_s / 1e9:6.2f} GB/s   peak RSS +MiB "
                          f"restore rank 0 {load_rss[0]:6.0f}", flush=True)
    barrier()
    if rank == 0:
        out = {"bytes": state_bytes, "replicated_bytes": replicated_bytes, "partitioned_bytes": state_bytes -
               replicated_bytes, "counts": counts, "times": times, "rss": rss, "cpu": cpu, "cpu_sys": cpu_sys,
               "bytes_read": bytes_read,
               "disk_bytes": disk_bytes, "verified_restores": verified, "fanout": config["fanout"], "sharded": sharded,
               "methods": list(methods), "handles": handles, "write_modes": write_modes}
        path = os.path.join(top, CKPT_RESULT)
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)
    dist.destroy_process_group()


def fastest_round_ratios(times: dict, ours: Sequence[str], bases: Sequence[str]) -> dict[str, float]:
    """Pure: for each of ``ours`` against each of ``bases``, save and load, the throughput ratio of
    the two methods' fastest rounds (``times[method][phase]``: seconds per round), keyed as the
    median ratios are. Information beside the medians, as timeit reports its minimum: on a VM whose
    host reclaims the guest's free pages, a save's page-cache pages come back fast in some rounds
    and slow in others, whichever method is saving, and the fastest round shows a method's speed
    without the host's slow rounds."""
    return {f"{m}_{phase}_GBps/{d.replace('-', '_')}_{phase}_GBps": min(times[d][phase]) / min(times[m][phase])
            for m in ours for d in bases for phase in ("save", "load")}


def report_checkpointer(args: argparse.Namespace, result: dict) -> dict:
    nbytes, counts, times = result["bytes"], result["counts"], result["times"]
    methods, name = section_methods(result), "sharded" if result.get("sharded") else "checkpointer"
    ours = [m for m in methods if m not in BASELINES]
    bases = [(d, d.replace("-", "_")) for d in ("dcp", "dcp-t2") if d in methods]
    med = {n: {m: {k: median(v) for k, v in times[str(n)][m].items()} for m in methods} for n in counts}
    gbps = {n: {m: {k: nbytes / v / 1e9 for k, v in med[n][m].items()} for m in methods} for n in counts}

    def rss_median(n: int, m: str, phase: str) -> list[float]:
        samples = result["rss"][str(n)][m][phase]  # one list per rep, one value per rank
        return [median([s[r] for s in samples]) for r in range(n)]

    rss = {n: {m: {p: rss_median(n, m, p) for p in ("save", "load")} for m in methods} for n in counts}
    def busiest(n: int, m: str, p: str) -> tuple[float, float]:
        """The CPU seconds of each round's busiest rank, user + system and system alone, medians over
        the rounds: where the time is CPU and not waiting, and how much of it the kernel's."""
        rounds = [max(zip(total, system)) for total, system in
                  zip(result["cpu"][str(n)][m][p], result["cpu_sys"][str(n)][m][p])]
        return median([t for t, _ in rounds]), median([s for _, s in rounds])

    busy = {n: {m: {p: busiest(n, m, p) for p in ("save", "load")} for m in methods} for n in counts}
    cpu, cpu_sys = ({n: {m: {p: pair[i] for p, pair in busy[n][m].items()} for m in methods} for n in counts}
                    for i in (0, 1))
    print()
    print(f"{name}: medians over {args.reps} rep(s), {nbytes / 1e9:.3f} GB per save in all "
          f"({result['replicated_bytes'] / 1e9:.3f} GB replicated on every rank, {result['partitioned_bytes'] / 1e9:.3f}"
          f" GB partitioned), time = slowest rank, restores on a {'COLD' if args.cold else 'HOT'} page cache"
          + (", in new processes" if result.get("resumed_in_new_processes") else ""))
    print(f"{'ranks':>5} {'method':<12} {'save s':>8} {'save GB/s':>10} {'(min-max s)':>17}   {'restore s':>9} "
          f"{'rest. GB/s':>10} {'(min-max s)':>17}   {'peak RSS +MiB save r0/others':>28} {'restore r0/others':>18}")
    for n in counts:
        for m in methods:
            s, l = times[str(n)][m]["save"], times[str(n)][m]["load"]
            rs, rl = rss[n][m]["save"], rss[n][m]["load"]
            print(f"{n:>5} {m:<12} {med[n][m]['save']:8.3f} {gbps[n][m]['save']:10.2f} "
                  f"{f'({min(s):.3f}-{max(s):.3f})':>17}   {med[n][m]['load']:9.3f} {gbps[n][m]['load']:10.2f} "
                  f"{f'({min(l):.3f}-{max(l):.3f})':>17}   {f'{rs[0]:.0f}/{max(rs[1:], default=0.0):.0f}':>28} "
                  f"{f'{rl[0]:.0f}/{max(rl[1:], default=0.0):.0f}':>18}")
        if "raw" in methods:
            print(f"      raw disk of this run, {n} rank(s) each writing 1/{n} dd-style: write "
                  f"{gbps[n]['raw']['save']:.2f} GB/s, readinto {gbps[n]['raw']['load']:.2f} GB/s")
    print("  (peak RSS +MiB: how far each rank's resident set peaked above its start of the phase, median over reps; "
          "it counts mapped file pages too)")
    print("  CPU seconds of the busiest rank in the phase (its process, user + system, and of that the system "
          "time; medians over reps):")
    for n in counts:
        print(f"    {n} rank(s): " + "; ".join(
            f"{m} save {cpu[n][m]['save']:.2f} (sys {cpu_sys[n][m]['save']:.2f}) restore {cpu[n][m]['load']:.2f} "
            f"(sys {cpu_sys[n][m]['load']:.2f})" for m in methods))
    modes = result.get("write_modes", {})
    if any(modes.get(str(n)) for n in counts):
        print("  write mode of rank 0's large shards in each timed save (the store's choice; 'auto' measures both):")
        for n in counts:
            print(f"    {n} rank(s): " + "; ".join(f"{m} {' '.join('+'.join(s) or '-' for s in saves)}"
                                               for m, saves in modes.get(str(n), {}).items()))
    print("  bytes on disk after one save, and bytes each rank's Checkpointer restore read (MiB):")
    for n in counts:
        on_disk = ", ".join(f"{m} {result['disk_bytes'][str(n)].get(m, 0) / MiB:.0f}" for m in methods)
        read = "; ".join(f"{m} [{', '.join(f'{b / MiB:.0f}' for b in result['bytes_read'][str(n)].get(m, []))}]"
                         for m in ours if m.startswith("ckpt-"))
        print(f"    {n} rank(s): on disk {on_disk}; read per rank {read}")

    targets = {}
    for m in ours:
        for _, d in bases:
            targets[f"{m}_save_GBps/{d}_save_GBps"] = (">=", 1.0)
            targets[f"{m}_load_GBps/{d}_load_GBps"] = (">=", 1.0)
    ratios: dict[str, dict[str, float]] = {}
    fastest: dict[str, dict[str, float]] = {}
    met: dict[str, dict[str, bool]] = {}
    intervals: dict[str, dict[str, tuple[float, float]]] = {}
    print()
    print(f"{name}: throughput ratios (of medians); target: at least DCP's throughput, save and load; "
          "90% paired-bootstrap interval over the rounds, and whether the verdict stands out of their spread")
    for n in counts:
        g = gbps[n]
        r, spread = {}, {}
        for m in ours:
            for d, key in bases:
                for phase in ("save", "load"):
                    k = f"{m}_{phase}_GBps/{key}_{phase}_GBps"
                    r[k] = g[m][phase] / g[d][phase]
                    rounds = (times[str(n)][m][phase], times[str(n)][d][phase])
                    spread[k] = paired_ratio_interval(*rounds) if len(rounds[0]) >= INTERVAL_MIN_ROUNDS else None
        if "raw" in methods:
            for m, key in [(m, m) for m in ours] + bases:
                r[f"{key}_save_GBps/raw_write_GBps"] = g[m]["save"] / g["raw"]["save"]
        ratios[str(n)], met[str(n)], intervals[str(n)] = r, targets_met(r, targets), spread
        fastest[str(n)] = fastest_round_ratios(times[str(n)], ours, [d for d, _ in bases])
        print(f"  {n} rank(s)   " + (f"(raw disk this run: write {g['raw']['save']:.2f} GB/s, readinto "
                                      f"{g['raw']['load']:.2f} GB/s)" if "raw" in methods else "(no raw method)"))
        print_ratios(r, targets, indent="    ", intervals=spread)
        print("    the same ratios of each method's fastest round (information: what a method does when the "
              "host's slow rounds miss it):")
        for m in ours:
            print(f"      {m:<12} " + "; ".join(
                f"{phase} " + ", ".join(f"vs {d} {fastest[str(n)][f'{m}_{phase}_GBps/{key}_{phase}_GBps']:.3f}"
                                        for d, key in bases) for phase in ("save", "load")))
    return {"bytes": nbytes, "replicated_bytes": result["replicated_bytes"],
            "partitioned_bytes": result["partitioned_bytes"], "counts": counts, "reps": args.reps,
            "warmup": args.warmup, "cache": "cold" if args.cold else "hot", "fanout": result["fanout"],
            "resumed_in_new_processes": bool(result.get("resumed_in_new_processes")),
            "dcp_partitions": "the same DTensors" if result.get("sharded") else
            "plain tensors under per-rank keys moments.<region>.rank<r>", "sharded": bool(result.get("sharded")),
            "median_s": {str(n): v for n, v in med.items()}, "median_GBps": {str(n): v for n, v in gbps.items()},
            "raw_GBps": {str(n): {"write": gbps[n]["raw"]["save"], "read": gbps[n]["raw"]["load"]} for n in counts}
            if "raw" in methods else None, "methods": list(methods),
            "peak_rss_growth_MiB": {str(n): v for n, v in rss.items()}, "bytes_read": result["bytes_read"],
            "write_modes": result.get("write_modes", {}),
            "busiest_rank_cpu_s": {str(n): v for n, v in cpu.items()},
            "busiest_rank_system_cpu_s": {str(n): v for n, v in cpu_sys.items()},
            "disk_bytes": result["disk_bytes"], "ratios": ratios, "targets_met": met, "fastest_round_ratios": fastest,
            "ratio_intervals_90": {n: {k: list(v) if v else None for k, v in iv.items()} for n, iv in intervals.items()},
            "noise_verdicts": {n: {k: noise_verdict(ratios[n][k], v, targets[k][1]) for k, v in iv.items()}
                               for n, iv in intervals.items()},
            "verified_restores": result["verified_restores"]}


# ---------------------------------------------------------------- driver

# ---------------------------------------------------------------- section "many-tensors"
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
            ckpt = alpha_ckpt.Checkpointer(workdir, run="bench", step="fit")  # untimed: created once per job
            ckpt.restore(state, None)
            t = time.perf_counter()
            root = ckpt.save(state, update=rep)
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


SECTIONS = ("store", "stall", "owners", "checkpointer", "sharded")
NAMED_SECTIONS = ("many-tensors",)  # run only when named, not by "all"


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


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--owner-process", help=argparse.SUPPRESS)  # internal: run one rank of owners or checkpointer
    args = p.parse_args(argv)
    if args.owner_process:
        owner_processes(json.loads(args.owner_process))
        return None
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


if __name__ == "__main__":
    main()
