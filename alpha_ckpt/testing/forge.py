"""Deliberately altered generations, for refusal tests and gates.

    python -m alpha_ckpt.testing.forge --store S ROOT --edit devices.0.product='"NVIDIA A100"'
    python -m alpha_ckpt.testing.forge --store S ROOT --poison model.w1:5=nan
    python -m alpha_ckpt.testing.forge --store S ROOT --prefix cursor=0

Publishes a new generation of the same run/step. With only ``--edit``, its
shards are ROOT's own objects and its root manifest carries ROOT's metadata
with each edit applied (a dotted path, then a JSON value). With ``--poison``
(a word set to nan, inf or -inf) or ``--prefix`` (a capture counter
changed), every word is read back and published again as a star generation
with fresh shards. Every digest in the result is valid, so only the checks a
restore makes on values and bindings can refuse it: this is how a "NaN with
the checksums repaired", a "reset cursor" or a "checkpoint saved on another
device product" is made. Prints the new root digest.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any, Callable, Sequence

import torch

from alpha_ckpt.format.records import DTYPES, CapturePrefix, RegionDecl
from alpha_ckpt.state.manifest import torch_dtype
from alpha_ckpt.generation.planner import Piece, WantedSlice
from alpha_ckpt.generation.reader import open_generation, restore_slices
from alpha_ckpt.store import RefRecord, Store
from alpha_ckpt.generation.writer import Published, write_manifest, write_shards


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


def publish_ref_unfenced(store: Store, prefix: CapturePrefix, root: str, root_size: int, total_bytes: int,
                         owners: int) -> RefRecord:
    """A ref naming ``root`` at the next free generation number of (run, step), whatever the history holds.

    A product publish goes through :meth:`Store.publish_ref`, which refuses what would fork the history."""
    history = store.history(prefix.run, prefix.step, whole=False)
    record = RefRecord(prefix.run, prefix.step, history.top + 1, root, root_size, prefix, time.time(), total_bytes,
                       owners)
    store.put_ref(record)
    return record


def publish_forged(store: Store, prefix: CapturePrefix, regions: Sequence[RegionDecl],
                   shards: Sequence[Sequence[tuple[Piece, memoryview, str]]], *, metadata: Any = None,
                   owners: int = 1, state: Any = None) -> Published:
    """:func:`alpha_ckpt.generation.writer.publish_slices` without its checks: NaN and inf words, a root manifest a
    restore refuses, and a ref the history would fence are all published."""
    with store.pending_publish(prefix.run, prefix.step):  # gc spares what this publish writes
        shard_refs = write_shards(store, prefix, regions, shards, check_finite=False)
        root, root_size = write_manifest(store, prefix, regions, shard_refs, owners, metadata, state=state)
        record = publish_ref_unfenced(store, prefix, root, root_size, root_size + sum(s.size for s in shard_refs),
                                      owners)
    return Published(root, record, tuple(shard_refs))


def republish_with_metadata(store: Store, root: str, edit: Callable[[Any], Any]) -> str:
    """Publish ROOT's shards (and a tree's group manifests) again under a root with ``edit(metadata)``."""
    with open_generation(store, root) as generation:
        m = generation.manifest
    metadata = edit(copy.deepcopy(m.metadata))
    digest, size = write_manifest(store, m.prefix, m.regions, m.shards, m.owners, metadata, m.publisher, m.children,
                                  m.state_json)
    publish_ref_unfenced(store, m.prefix, digest, size, size + sum(s.size for s in m.shards), m.owners)
    return digest


def republish_state(store: Store, root: str, *, edit: Callable[[Any], Any] = lambda m: m,
                    poison: dict[tuple[str, int], float] | None = None, prefix: dict[str, int] | None = None) -> str:
    """Read every word of ROOT, apply ``poison`` {(region, word): value}, publish it again as a star generation."""
    with open_generation(store, root) as generation:
        m = generation.manifest
        buffers = [bytearray(r.words * DTYPES[r.dtype][0]) for r in m.regions]
        wanted = [WantedSlice(r.ordinal, 0, r.words, r.ordinal) for r in m.regions]
        restore_slices(generation, wanted, [torch.frombuffer(b, dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
                                            for b in buffers])
    by_name = {r.name: r for r in m.regions}
    for (name, word), value in (poison or {}).items():
        region = by_name[name]
        torch.frombuffer(buffers[region.ordinal], dtype=torch_dtype(region.dtype))[word] = value
    p = m.prefix
    new_prefix = CapturePrefix(p.run, p.step, *(int((prefix or {}).get(k, getattr(p, k))) for k in ("update", "cursor", "epoch")))
    metadata = edit(copy.deepcopy(m.metadata))
    if isinstance(metadata, dict) and "devices" not in metadata:  # a tree's devices live in its group manifests
        metadata["devices"] = [{"product": "cpu", "uuid": None}] * m.owners
    shards = [[(Piece(r.ordinal, 0, r.words, DTYPES[r.dtype][0]), memoryview(buffers[r.ordinal]), "raw")]
              for r in m.regions]
    return publish_forged(store, new_prefix, m.regions, shards, metadata=metadata, owners=m.owners,
                          state=m.state_json).root


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alpha_ckpt.testing.forge", description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("root")
    parser.add_argument("--edit", action="append", default=[], metavar="PATH=JSON")
    parser.add_argument("--poison", action="append", default=[], metavar="REGION:WORD=nan|inf|-inf")
    parser.add_argument("--prefix", action="append", default=[], metavar="update|cursor|epoch=N")
    args = parser.parse_args(argv)
    if not (args.edit or args.poison or args.prefix):
        parser.error("nothing to alter: give --edit, --poison or --prefix")
    poison = {}
    for item in args.poison:
        target, _, value = item.partition("=")
        name, _, word = target.rpartition(":")
        poison[(name, int(word))] = float(value)
    prefix = dict((k, int(v)) for k, _, v in (item.partition("=") for item in args.prefix))
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
        if poison or prefix:
            print(republish_state(store, args.root, edit=edit, poison=poison, prefix=prefix))
        else:
            print(republish_with_metadata(store, args.root, edit))
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
