"""What taking a training state as it comes costs, against saving the same tensors as a flat dict.

    python -m bench capture [--layers 8] [--width 128] [--repeats 5]

A GPT-style model (tests/gpt_training.py's blocks) with AdamW after one step, a
LambdaLR, RNGState and plain values, saved and loaded through alpha_ckpt
(skeleton, Stateful calls, name matching); the baseline saves and loads exactly
the same tensors as one flat dict of tensors, in the same run and store. Prints
the median of each and their ratio: timings here are noisy, ratios less so.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import alpha_ckpt
from alpha_ckpt.state.capture import flatten_state

from .record import REPO_ROOT

sys.path.insert(0, str(Path(REPO_ROOT) / "tests"))  # the tests' real client: tests/gpt_training.py
import gpt_training  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench capture", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sized = gpt_training.LAYERS, gpt_training.WIDTH
    gpt_training.LAYERS, gpt_training.WIDTH = args.layers, args.width  # the model's size, for this build only
    try:  # the model reads them while it builds and trains
        t = gpt_training.Trainer(seed=0)
        t.train(1)
    finally:
        gpt_training.LAYERS, gpt_training.WIDTH = sized
    state = {"model": t.model, "optim": t.optim, "sched": t.warmup, "rng": alpha_ckpt.RNGState(),
             "progress": {"step": 1, "best": float("inf")}}
    flat = {name.replace(".", "/"): tensor.clone() for name, tensor in flatten_state(state)}
    n_params = sum(p.numel() for p in t.model.parameters())
    times = {"state save": [], "flat save": [], "state load": [], "flat load": []}
    with tempfile.TemporaryDirectory(prefix="bench-capture-") as store:
        for i in range(args.repeats):
            for kind, what in (("state", state), ("flat", flat)):
                started = time.perf_counter()
                root = alpha_ckpt.save(what, store=store, run=kind, step="s", update=i, cursor=0, epoch=0,
                                       allow_nonfinite=("*.causal_mask", "*/causal_mask"))
                times[f"{kind} save"].append(time.perf_counter() - started)
                started = time.perf_counter()
                alpha_ckpt.restore(what, store=store, root=root)
                times[f"{kind} load"].append(time.perf_counter() - started)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{n_params} parameters, {len(flat)} tensors, {sum(v.numel() * v.element_size() for v in flat.values())} bytes")
    for k, v in median.items():
        print(f"{k}: {v * 1000:.1f} ms (median of {args.repeats})")
    print(f"save ratio state/flat: {median['state save'] / median['flat save']:.2f}")
    print(f"load ratio state/flat: {median['state load'] / median['flat load']:.2f}")
    return {"parameters": n_params, "tensors": len(flat), "median_s": median,
            "ratios": {"save state/flat": median["state save"] / median["flat save"],
                       "load state/flat": median["state load"] / median["flat load"]}}
