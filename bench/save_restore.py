"""Benchmark: save and restore one float32 state with alpha_ckpt, torch.save and DCP, against raw disk.

The save-and-restore suites of ``python -m bench``. They share one state and one set of
options, so several run in one invocation, in turn (``python -m bench store stall owners
checkpointer sharded`` runs the five); many-tensors builds states of its own:

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

Suite "store"
-------------
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
           and BLAKE3-hashes every byte. Restore: ``alpha_ckpt.restore(dest, ...)``
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

Suite "stall"
-------------
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

After each save (untimed) the checkpoint is read back (``alpha_ckpt.restore`` or
``dcp.load``) and compared with a copy of the state taken at the boundary:
a snapshot that let the in-place change through fails the run. Reported per
method: median stall (call + fence), median seconds from the call to durable,
the simulated pass's time (a save running beside it slows it down: that cost
is not in the stall), stall / ours-sync save and stall / dcp-async stall.

Suite "owners"
--------------
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

Suite "checkpointer"
--------------------
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
             store's writes buffered whatever ``--write-mode`` says
             (``Store(DIR, write_mode="buffered")``, the store's default), as DCP's
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
(docs/bench-log/2026-12.md, "what decides a save on this VM").

Suite "sharded"
---------------
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
docs/bench-log/2026-12.md, "The first touch of page-cache memory").

``--ckpt-methods`` runs only some of the checkpointer and sharded sections'
methods (dcp and one of ours at least), in the same balanced order: what the
other methods of a round leave behind is part of what each one measures. It
also adds ckpt-star-bf, the star writing buffered: beside ckpt-star in a run
with ``--write-mode auto`` or ``direct`` it shows what the writing
mode costs the save and the next restore.

Suite "many-tensors"
--------------------
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
  ours     ``alpha_ckpt.save`` / ``alpha_ckpt.restore``, as in the store section
  torch    ``torch.save`` with fsync of the file and its directory /
           ``torch.load(weights_only=True)`` then ``copy_``, as in the store section
  dcp      ``dcp.save`` / ``dcp.load`` (on the 1-rank group), as in the store section

Both of ours hash every byte with BLAKE3 and fsync everything they write, as
always. Reported per count: medians, and ours over torch and over DCP (target:
at most 3x torch.save and torch.load).

Every section ends with its tables; the run's record (the last line, ``python -m bench``'s
JSON) holds every median and ratio under ``result`` (the store section's keys at its top
level; ``stall``, ``owners``, ``checkpointer``, ``sharded`` and ``many-tensors`` beside them).

Usage::

    python -m bench store --size-mib 64 --reps 1 --warmup 0   # smoke run
    python -m bench store --reps 5                            # the real one (~1 GiB state)
    python -m bench store --reps 5 --cold                     # restores from the device
    python -m bench store stall owners checkpointer sharded --reps 5   # the five in turn
    python -m bench checkpointer --reps 3                     # Checkpointer against DCP, 2 and 4 ranks
    python -m bench sharded --reps 3                          # DTensor state: Checkpointer, alpha_ckpt.dcp, DCP
    python -m bench many-tensors --reps 3                     # 1,000 / 10,000 / 100,000 small tensors
"""
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
from .common import (MiB, default_base_dir, make_state, memory_touch_rates, poison,
                     set_store_writes)
from .many_tensors import MANY_METHODS, run_many_tensors
from .owners import owner_process, run_owners
from .stall import run_stall
from .record import REPO_ROOT, code_under_test
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
    top = tempfile.mkdtemp(prefix="bench.", dir=base)

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
        print(f"bench: suites {', '.join(sections)}{sized}, {args.reps} rep(s) after {args.warmup} warm-up "
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

        result: dict = {"sections": list(sections), "machine": machine}
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
    return result


def main(argv: list[str] | None = None) -> dict | None:
    """Parse ``argv`` and run the sections named; None for a rank process (``--owner-process``)."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":  # a rank process of the owners and checkpointer suites (bench/ranks.py)
    main()
