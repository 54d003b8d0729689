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

After each save (untimed) the checkpoint is read back (``alpha_ckpt.restore`` or
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
with ``--write-mode auto`` or ``direct`` it shows what the writing
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
  ours     ``alpha_ckpt.save`` / ``alpha_ckpt.restore``, as in the store section
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

import os
import sys

# The sections live in the package beside this file; run as a script or loaded by path, it must import.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# What other scripts and the tests take from here.
from bench.checkpointer import (CKPT_METHODS, SHARDED_METHODS, chosen_methods, fastest_round_ratios,  # noqa: E402
                                merge_round_halves)
from bench.checkpointer_rank import row_sharded_matrices  # noqa: E402
from bench.cli import run  # noqa: E402
from bench.cli import main as _main  # noqa: E402
from bench.common import (MiB, balanced_orders, cached_bytes, evict_page_cache, evicted,  # noqa: E402
                          noise_verdict, paired_ratio_interval, prefault, process_cpu_s)
from bench.ranks import free_port  # noqa: E402
from bench.stall import completion_clock  # noqa: E402

__all__ = ["CKPT_METHODS", "SHARDED_METHODS", "MiB", "balanced_orders", "cached_bytes", "chosen_methods",
           "completion_clock", "evict_page_cache", "evicted", "fastest_round_ratios", "free_port", "main",
           "merge_round_halves", "noise_verdict", "paired_ratio_interval", "prefault", "process_cpu_s",
           "row_sharded_matrices", "run"]


def main(argv: list[str] | None = None) -> dict | None:
    """The command line above; ``--help`` describes it with this docstring's first line."""
    return _main(argv, doc=__doc__)


if __name__ == "__main__":
    main()
