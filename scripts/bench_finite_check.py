#!/usr/bin/env python3
"""What publication's NaN/inf check costs: the same state published with and without it, alternated.

    python scripts/bench_finite_check.py [--gib 1] [--reps 5] [--dir /work]

Publishes a float32 state of ``--gib`` GiB (8 regions) into a fresh store per
repetition, once as every save does (each float word checked while it is
hashed) and once unchecked (the forging path tests use), alternating them
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

from alpha_ckpt.format.records import DTYPES, CapturePrefix
from alpha_ckpt.state.manifest import regions_of
from alpha_ckpt.state.capture import flatten_state
from alpha_ckpt.generation.planner import Piece
from alpha_ckpt.store import Store
from alpha_ckpt.generation.writer import publish_slices, word_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--dir", default=None, help="where the stores go (default: the system temp dir)")
    args = p.parse_args()
    state = {f"t{i}": torch.randn(int(args.gib * (1 << 28)) // 8) for i in range(8)}
    named = flatten_state(state)
    regions = regions_of(named)
    shards = [[(Piece(r.ordinal, 0, r.words, DTYPES[r.dtype][0]), memoryview(word_bytes(t).numpy()), "raw")]
              for r, (_, t) in zip(regions, named)]
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
                    publish_slices(store, CapturePrefix("r", "s", 1, 0, 0), regions, shards, forged=not checked)
                    if rep:
                        times[checked].append(time.perf_counter() - started)
            finally:
                shutil.rmtree(directory)
    checked, unchecked = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.gib:g} GiB float32, {args.reps} reps: checked {checked:.3f} s, unchecked {unchecked:.3f} s "
          f"(medians), ratio {checked / unchecked:.3f}; every run: checked {[round(t, 3) for t in times[True]]}, "
          f"unchecked {[round(t, 3) for t in times[False]]}")


if __name__ == "__main__":
    main()
