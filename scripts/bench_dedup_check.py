"""What checking an existing object before reusing it costs: a re-save of an identical state.

    python scripts/bench_dedup_check.py [--gib 1] [--reps 5] [--cold] [--dir DIR]

One untimed save publishes a state of 16 float32 tensors (``--gib`` GiB in
all, fixed seed). Then every repetition re-saves the identical state into the
same store from a fresh process (what a retry or a second launch of a job
does), once per method, alternating which goes first:

- ``check``: as shipped. The store handle is new, so every existing object
  is read back and validated before it is reused.
- ``trust``: the content validation replaced by a no-op (the lstat, size
  and file-type checks stay): what reuse cost before the check.

Each re-save still writes (and fsyncs) its objects to tmp/ before finding
the name taken, so both methods pay that. Times are of ``alpha_ckpt.save``
alone (imports and state creation excluded). One untimed round of both
methods comes first. The page cache is hot unless ``--cold``: then the
store's object files are dropped from it (POSIX_FADV_DONTNEED on those files
only, after an fsync) before every timed save, as after a reboot or for an
object written with O_DIRECT. Prints the medians and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TENSORS = 16


def _state(gib: float):
    import torch
    g = torch.Generator().manual_seed(1)
    words = int(gib * (1 << 30)) // 4 // TENSORS
    return {f"t{i:02d}": torch.randn(words, generator=g) for i in range(TENSORS)}


def child(method: str, store: str, gib: float) -> None:
    import alpha_ckpt
    from alpha_ckpt import restore
    from alpha_ckpt.generation import writer
    checking = [0.0]
    real = restore.validate_object_file

    def timed(obj, what="object"):
        started = time.perf_counter()
        try:
            return real(obj, what)
        finally:
            checking[0] += time.perf_counter() - started

    # the check the writer gives the store for an object that already exists
    writer.validate_object_file = timed if method == "check" else (lambda obj, what="object": None)
    state = _state(gib)
    started = time.perf_counter()
    alpha_ckpt.save(state, store=store, run="bench", step="dedup", update=1, cursor=0, epoch=0)
    seconds = time.perf_counter() - started
    print(json.dumps({"method": method, "seconds": seconds, "checking": checking[0]}))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="drop the objects from the page cache before each save")
    parser.add_argument("--dir", default=None, help="where to put the store (default: a temporary directory)")
    parser.add_argument("--child", choices=("check", "trust"), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.store, args.gib)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        store = os.path.join(work, "store")

        def run(method: str) -> dict:
            if args.cold:
                drop_cached_objects(store)
            proc = subprocess.run([sys.executable, __file__, "--child", method, "--store", store, "--gib",
                                   str(args.gib)], capture_output=True, text=True, check=True)
            return json.loads(proc.stdout.strip().splitlines()[-1])

        run("trust")  # the first save writes the objects; it is not timed
        run("check")
        run("trust")
        results: dict[str, list[dict]] = {"check": [], "trust": []}
        for rep in range(args.reps):
            for method in (("check", "trust") if rep % 2 == 0 else ("trust", "check")):
                results[method].append(run(method))
                print(f"rep {rep} {method:5} {results[method][-1]['seconds']:.3f} s", file=sys.stderr)
    medians = {m: statistics.median(r["seconds"] for r in rs) for m, rs in results.items()}
    checking = statistics.median(r["checking"] for r in results["check"])
    cache = "cold" if args.cold else "hot"
    print(f"re-save of an identical {args.gib:g} GiB state, {cache} page cache, {args.reps} repetitions each, medians:")
    print(f"  check  {medians['check']:.3f} s   (of which validating existing objects {checking:.3f} s)")
    print(f"  trust  {medians['trust']:.3f} s")
    print(f"  ratio check / trust = {medians['check'] / medians['trust']:.2f}")


if __name__ == "__main__":
    main()
