"""What publication's NaN/inf check costs: the same state published with and without it, alternated.

    python -m bench finite [--gib 1] [--reps 5] [--dir /work]

Publishes a float32 state of ``--gib`` GiB (8 regions) into a fresh store per
repetition, once as every save does (each float word checked while it is
hashed) and once with every tensor allowed to hold NaN/inf (``allow_nonfinite=("*",)``:
nothing checked), alternating them
each after a sync(2); prints the medians and their ratio. Timings on a shared machine are
noisy: read the ratio, not the seconds.
"""
import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import alpha_ckpt
from alpha_ckpt.store import Store


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench finite", description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--dir", default=None, help="where the stores go (default: the system temp dir)")
    args = p.parse_args(argv)
    state = {f"t{i}": torch.randn(int(args.gib * (1 << 28)) // 8) for i in range(8)}
    times: dict[bool, list[float]] = {True: [], False: []}
    # Strictly alternated, after one untimed pair: a run that follows a run of its own arm was
    # measured slower here whichever arm it was, so every timed run follows one of the other arm.
    for rep in range(args.reps + 1):
        for checked in (True, False):
            directory = tempfile.mkdtemp(prefix="alpha-bench-finite-", dir=args.dir)
            os.sync()  # the previous store's pages written back first: each run starts from the same state
            try:
                with Store(directory) as store:
                    started = time.perf_counter()
                    alpha_ckpt.save(state, store=store, run="r", step="s", update=1, cursor=0, epoch=0,
                                    allow_nonfinite=() if checked else ("*",))
                    if rep:
                        times[checked].append(time.perf_counter() - started)
            finally:
                shutil.rmtree(directory)
    checked, unchecked = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.gib:g} GiB float32, {args.reps} reps: checked {checked:.3f} s, unchecked {unchecked:.3f} s "
          f"(medians), ratio {checked / unchecked:.3f}; every run: checked {[round(t, 3) for t in times[True]]}, "
          f"unchecked {[round(t, 3) for t in times[False]]}")
    return {"gib": args.gib, "reps": args.reps, "median_s": {"checked": checked, "unchecked": unchecked},
            "ratios": {"checked/unchecked": checked / unchecked},
            "runs_s": {"checked": times[True], "unchecked": times[False]}}
