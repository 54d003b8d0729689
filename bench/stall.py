"""Section "stall": the training stall of synchronous and asynchronous saves, ours against DCP."""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import threading
import time
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import alpha_ckpt

from .common import check_equal, median, open_store, poison, prefault, print_ratios, targets_met
from .methods import dcp_restore, dcp_save, ours_restore, ours_save

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
            store = open_store(workdir)
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
