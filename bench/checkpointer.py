"""Sections "checkpointer" and "sharded", the driver's side: which methods run, the launches of the
ranks (``checkpointer_rank``), the merge of resumed rounds and the report."""
from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

from .common import (INTERVAL_MIN_ROUNDS, MiB, balanced_orders, median, noise_verdict, paired_ratio_interval,
                     print_ratios, targets_met, store_writes)
from .ranks import free_port, launch_ranks

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
# Only by --ckpt-methods: the star with the store's writes buffered whatever --write-mode says,
# as DCP's FileSystemWriter writes, so a run under "auto" or "direct" compares how the writing mode moves
# cost between a save and the next restore.
BUFFERED_STAR = "ckpt-star-bf"
SHARDED_COLS = 1024  # columns of every sharded matrix (rows: what the size leaves)
CKPT_RESULT = "checkpointer_result.json"


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


def run_checkpointer(args: argparse.Namespace, top: str, sharded: bool = False) -> dict:
    counts = sorted(set(args.ckpt_ranks))
    world = counts[-1]
    name = "sharded" if sharded else "checkpointer"
    workdir = os.path.join(top, name)
    os.mkdir(workdir)
    config = {"world": world, "counts": counts, "port": free_port(), "dir": workdir, "size_mib": args.size_mib,
              "tensors": args.tensors, "seed": args.seed, "reps": args.reps, "warmup": args.warmup,
              "prefault": args.prefault, "cold": args.cold, "fanout": args.fanout, "sharded": sharded,
              "methods": chosen_methods(args.ckpt_methods, sharded), **store_writes()}
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
