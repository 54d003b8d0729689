"""Deliberately altered generations, for refusal tests and gates.

    python -m alpha_ckpt.forge --store S ROOT --edit devices.0.product='"NVIDIA A100"'

Publishes a new generation of the same run/step whose shards are ROOT's own
objects and whose root manifest carries ROOT's metadata with each ``--edit``
applied (a dotted path, then a JSON value). Every digest in the result is
valid, so only the binding checks of a resume can refuse it: this is how a
"checkpoint saved on another device product" or "under another learner" is
made without another machine. Prints the new root digest.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any, Callable

from .restore import open_generation
from .store import Store
from .writer import write_manifest


def set_path(document: Any, dotted: str, value: Any) -> Any:
    """``document`` with the value at ``dotted`` (keys, or list indices as digits) replaced by ``value``."""
    out = copy.deepcopy(document)
    *parents, last = dotted.split(".")
    node = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


def republish_with_metadata(store: Store, root: str, edit: Callable[[Any], Any]) -> str:
    """Publish ROOT's shards again under a manifest with ``edit(metadata)``; returns the new root digest."""
    with open_generation(store, root) as generation:
        m = generation.manifest
    metadata = edit(copy.deepcopy(m.metadata))
    digest, size = write_manifest(store, m.prefix, m.regions, m.shards, m.owners, metadata)
    store.publish_ref(m.prefix, digest, size, size + sum(s.size for s in m.shards), owners=m.owners)
    return digest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alpha_ckpt.forge", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("root")
    parser.add_argument("--edit", action="append", default=[], metavar="PATH=JSON", required=True)
    args = parser.parse_args(argv)
    edits = []
    for item in args.edit:
        path, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--edit {item!r}: expected PATH=JSON")
        edits.append((path, json.loads(value)))

    def edit(metadata):
        for path, value in edits:
            metadata = set_path(metadata, path, value)
        return metadata

    store = Store(args.store)
    try:
        print(republish_with_metadata(store, args.root, edit))
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
