"""Simulate tree publication and path restore of a large hierarchy in one process.

    python -m bench tree --owners 200000 --fanout 16
    python -m bench tree --owners 1000,10000,200000 --fanout 16

The real tree code (alpha_ckpt.tiers.durable.tree) runs over in-process mailboxes
against a real store (tmpfs when available, so the figures measure the
protocol, not the disk): every role writes a tiny shard and its group
manifest durably and commits to its parent; the root publishes the ref and
completion flows down; then every role restores its own words along its
path and checks them. Printed per level: the largest number of messages,
bytes held and manifests read by any one owner, and the total times.
"""
import argparse
import os
import shutil
import tempfile

from alpha_ckpt.testing import simulate
from alpha_ckpt.store import Store


def one(owners: int, fanout: int, words: int, base: str | None) -> simulate.Report:
    directory = tempfile.mkdtemp(prefix="alpha-sim-tree-", dir=base)
    try:
        store = Store(directory)
        report, completions = simulate.publish(store, owners, fanout, words=words)
        if report.root is None or report.completions_ok != owners:
            raise SystemExit(f"publication failed: {completions[0]}")
        simulate.restore(store, report, words=words)
        store.close()
        return report
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench tree", description=__doc__.splitlines()[0])
    parser.add_argument("--owners", default="200000", help="owner count, or several separated by commas")
    parser.add_argument("--fanout", type=int, default=16)
    parser.add_argument("--words", type=int, default=4, help="float32 words each owner owns")
    parser.add_argument("--store-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where the temporary store lives (default /dev/shm)")
    args = parser.parse_args(argv)
    reports = [one(int(n), args.fanout, args.words, args.store_dir) for n in args.owners.split(",")]
    for r in reports:
        print(f"owners {r.owners}  fan-out {r.fanout}  height {r.height}  publish {r.publish_seconds:.1f} s  "
              f"restore (all owners) {r.restore_seconds:.1f} s")
        print("  level      roles  max messages  max bytes held  max manifests read  max objects opened")
        for depth, f in sorted(r.levels.items()):
            print(f"  {depth:5d} {f['roles']:10d} {f['messages']:13d} {f['bytes_held']:15d} "
                  f"{f['manifests_read']:19d} {f['objects_opened']:19d}")
    return {"simulations": [vars(r) for r in reports]}
