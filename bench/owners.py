"""Section "owners": 1, 2 and 4 owner processes, save and restore throughput, ours (tree publisher)
against DCP with a process group."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import time

import blake3
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from alpha_ckpt.format.records import CapturePrefix, RegionDecl
from alpha_ckpt.generation.planner import Hierarchy, Piece, WantedSlice, pack_shards
from alpha_ckpt.tiers.durable.tree import GroupTransport, TreeRole
from alpha_ckpt.generation.reader import PreparedRestore, open_generation
from alpha_ckpt.store import Store
from alpha_ckpt.generation.writer import DEFAULT_MAX_SHARD_BYTES

from .common import MiB, evicted, median, open_store, prefault, print_ratios, store_writes, targets_met
from .methods import RawDisk
from .ranks import free_port, launch_ranks

# N owner processes (gloo on 127.0.0.1), one process group of the largest
# count and a subgroup of ranks [0, n) for each count n. Tensor i of the state
# is owned at count n by rank i % n, so each owner holds 1/n of the state (its
# own distinct tensors) and a rank's tensors at a larger count are a subset of
# those at a smaller one: every rank builds its tensors once. Every timed
# section starts at a barrier of all ranks; its time is the largest over the
# owners taking part.

OWNER_METHODS = ("ours", "dcp", "dcp-t2", "raw")
OWNERS_RESULT = "owners_result.json"


def run_owners(args: argparse.Namespace, top: str) -> dict:
    counts = sorted(set(args.owners))
    world = counts[-1]
    workdir = os.path.join(top, "owners")
    os.mkdir(workdir)
    config = {"world": world, "counts": counts, "port": free_port(), "dir": workdir, "size_mib": args.size_mib,
              "tensors": args.tensors, "seed": args.seed, "reps": args.reps, "warmup": args.warmup,
              "prefault": args.prefault, "cold": args.cold, "fanout": args.fanout, **store_writes()}
    if args.tensors % world:
        raise SystemExit(f"--tensors {args.tensors} does not split evenly among {world} owners")
    print()
    print(f"== section owners: {', '.join(map(str, counts))} owner process(es), gloo on 127.0.0.1; order per rep: "
          f"for each owner count: {', '.join(OWNER_METHODS)}")
    print(f"  tensor i belongs to owner i % n; times are the largest over the owners; each restore verified with "
          f"torch.equal (raw: not compared); restores on a {'COLD' if args.cold else 'HOT'} page cache", flush=True)
    result = launch_ranks(args, config, "owners", OWNERS_RESULT)
    return report_owners(args, result)


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
        store = open_store(directory)
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
