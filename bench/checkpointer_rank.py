"""Sections "checkpointer" and "sharded", one rank's side: the state it holds, every method's timed
save and restore on it, and (rank 0) the result file."""
from __future__ import annotations

import datetime
import gc
import json
import os
import shutil
import stat
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import alpha_ckpt
import alpha_ckpt.dcp as alpha_dcp
from alpha_ckpt.generation.planner import shares

from .checkpointer import BUFFERED_STAR, CKPT_RESULT, OURS_STORE_METHODS, SHARDED_COLS, section_methods
from .common import (MiB, balanced_orders, evicted, open_store, peak_growth_mib, prefault, process_cpu_s,
                     reset_peak_rss, write_modes)
from .methods import RawDisk


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
    chosen_modes = {str(n): {m: [] for m in methods if m in OURS_STORE_METHODS} for n in counts}
    modes_seen: dict = {}  # (count of ranks, learner's mode) -> this process's store writes seen
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
        store = open_store(directory, mode="buffered" if method == BUFFERED_STAR else None)
        return alpha_ckpt.Checkpointer(store, run="bench", step="fit", group=groups[n], publisher=publisher,
                                       fanout=config["fanout"])

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
            return ckpt.save(ours(n, "src"), update=rnd + 1, cursor=rnd + 1).root
        if method == "dcp":
            dcp.save(theirs(n, "src"), checkpoint_id=directory, process_group=group)
        elif method == "dcp-t2":
            dcp.save(theirs(n, "src"), process_group=group, storage_writer=FileSystemWriter(directory, thread_count=2))
        elif method == "dcp-alpha":
            writer = alpha_dcp.StorageWriter(open_store(directory), run="bench", step="fit", update=rnd + 1,
                                             group=group)
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
                        learner = write_modes("buffered" if method == BUFFERED_STAR else None)
                        modes = learner.stats(n)["modes"]  # the saves of n ranks at once
                        seen = modes_seen.get((n, learner.mode), 0)
                        line += f"  write mode {'+'.join(modes[seen:]) or '-'}"
                        if timed:
                            chosen_modes[str(n)][method].append(modes[seen:])
                        modes_seen[(n, learner.mode)] = len(modes)
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
               "methods": list(methods), "handles": handles, "write_modes": chosen_modes}
        path = os.path.join(top, CKPT_RESULT)
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)
    dist.destroy_process_group()
