"""What checking an existing object before reusing it costs: a re-save of an identical state.

    python -m bench dedup [--gib 1] [--reps 5] [--cold] [--dir DIR]

Every repetition saves a state of 16 float32 tensors (``--gib`` GiB in all,
fixed seed) twice, each from a fresh process (imports and state creation
are not timed; only ``alpha_ckpt.save``), alternating which goes first:

- ``first``: into an empty store, which writes every object: the baseline.
- ``again``: into a store that already holds the identical generation (what
  a retry or a second launch of a job does). The store handle is new, so
  every existing object is read back and validated before it is reused; the
  store reports how many it validated and the seconds that took
  (``Store.reuse_checks``, ``Store.reuse_check_seconds``).

A re-save still writes (and fsyncs) its objects to tmp/ before finding the
name taken. ``again`` less its validation seconds is what reuse would cost
unchecked. One untimed round comes first. The page cache is hot unless
``--cold``: then the store's object files are dropped from it
(POSIX_FADV_DONTNEED on those files only, after an fsync) before every
``again``, as after a reboot. Prints the medians and their ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from .record import REPO_ROOT

TENSORS = 16


def _state(gib: float):
    import torch
    g = torch.Generator().manual_seed(1)
    words = int(gib * (1 << 30)) // 4 // TENSORS
    return {f"t{i:02d}": torch.randn(words, generator=g) for i in range(TENSORS)}


def child(store_dir: str, gib: float) -> None:
    """One save in this fresh process; prints its seconds and what the store validated before reusing."""
    import alpha_ckpt
    from alpha_ckpt.store import Store

    state = _state(gib)
    with Store(store_dir, create=True) as store:
        started = time.perf_counter()
        alpha_ckpt.save(state, store=store, run="bench", step="dedup", update=1, cursor=0, epoch=0)
        seconds = time.perf_counter() - started
        print(json.dumps({"seconds": seconds, "checks": store.reuse_checks, "checking": store.reuse_check_seconds}))


def drop_cached_objects(store: str) -> None:
    """Evict the store's object files from the page cache (only those files: nothing else is disturbed)."""
    for directory, _, names in os.walk(os.path.join(store, "objects")):
        for name in names:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(prog="python -m bench dedup", description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="drop the objects from the page cache before each re-save")
    parser.add_argument("--dir", default=None, help="where to put the stores (default: a temporary directory)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.store, args.gib)
        return None
    if args.reps < 1 or args.gib <= 0:
        parser.error("--reps and --gib must be positive")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        kept = os.path.join(work, "kept")  # holds the generation every "again" re-saves

        def run(method: str) -> dict:
            store = kept if method == "again" else os.path.join(work, "fresh")
            if method == "again" and args.cold:
                drop_cached_objects(store)
            proc = subprocess.run([sys.executable, "-m", "bench.dedup", "--child", "--store", store, "--gib",
                                   str(args.gib)], capture_output=True, text=True, check=True, env=env)
            if method == "first":
                shutil.rmtree(store)
            return json.loads(proc.stdout.strip().splitlines()[-1])

        run("again")  # the first save into the kept store writes its objects; it and the next round are not timed
        run("first")
        run("again")
        results: dict[str, list[dict]] = {"first": [], "again": []}
        for rep in range(args.reps):
            for method in (("again", "first") if rep % 2 == 0 else ("first", "again")):
                results[method].append(run(method))
                print(f"rep {rep} {method:5} {results[method][-1]['seconds']:.3f} s", file=sys.stderr)
    medians = {m: statistics.median(r["seconds"] for r in rs) for m, rs in results.items()}
    checking = statistics.median(r["checking"] for r in results["again"])
    checks = results["again"][0]["checks"]
    unchecked = statistics.median(r["seconds"] - r["checking"] for r in results["again"])
    cache = "cold" if args.cold else "hot"
    print(f"saves of an identical {args.gib:g} GiB state, {cache} page cache, {args.reps} repetitions each, medians:")
    print(f"  first  {medians['first']:.3f} s   (every object written)")
    print(f"  again  {medians['again']:.3f} s   (of which validating {checks} existing objects {checking:.3f} s)")
    print(f"  ratio again / first = {medians['again'] / medians['first']:.2f}; again / again unchecked = "
          f"{medians['again'] / unchecked:.2f}")
    return {"gib": args.gib, "reps": args.reps, "cache": cache, "median_s": medians, "checking_s": checking,
            "objects_checked": checks, "ratios": {"again/first": medians["again"] / medians["first"],
                                                  "again/again_unchecked": medians["again"] / unchecked},
            "runs": results}


if __name__ == "__main__":  # the fresh process of one save (--child)
    main()
