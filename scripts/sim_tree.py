#!/usr/bin/env python3
"""Simulate tree publication and path restore of a large hierarchy in one process.

    python scripts/sim_tree.py --owners 200000 --fanout 16
    python scripts/sim_tree.py --owners 1000,10000,200000 --fanout 16 --json

The real tree code (alpha_ckpt.tiers.durable.tree) runs over in-process mailboxes
against a real store (tmpfs when available, so the figures measure the
protocol, not the disk): every role writes a tiny shard and its group
manifest durably and commits to its parent; the root publishes the ref and
completion flows down; then every role restores its own words along its
path and checks them. Printed per level: the largest number of messages,
bytes held and manifests read by any one owner, and the total times.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alpha_ckpt.testing import simulate  # noqa: E402
from alpha_ckpt.store import Store  # noqa: E402


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owners", default="200000", help="owner count, or several separated by commas")
    parser.add_argument("--fanout", type=int, default=16)
    parser.add_argument("--words", type=int, default=4, help="float32 words each owner owns")
    parser.add_argument("--store-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                        help="where the temporary store lives (default /dev/shm)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reports = [one(int(n), args.fanout, args.words, args.store_dir) for n in args.owners.split(",")]
    if args.json:
        print(json.dumps([vars(r) for r in reports]))
        return 0
    for r in reports:
        print(f"owners {r.owners}  fan-out {r.fanout}  height {r.height}  publish {r.publish_seconds:.1f} s  "
              f"restore (all owners) {r.restore_seconds:.1f} s")
        print("  level      roles  max messages  max bytes held  max manifests read  max objects opened")
        for depth, f in sorted(r.levels.items()):
            print(f"  {depth:5d} {f['roles']:10d} {f['messages']:13d} {f['bytes_held']:15d} "
                  f"{f['manifests_read']:19d} {f['objects_opened']:19d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
