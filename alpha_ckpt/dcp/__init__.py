"""alpha_ckpt as a storage backend for ``torch.distributed.checkpoint`` (DCP).

``dcp.save``, ``dcp.async_save`` and ``dcp.load`` run unchanged (DCP plans, dedups replicated
entries and reshards); every byte goes through the alpha_ckpt store::

    import torch.distributed.checkpoint as dcp
    from alpha_ckpt.dcp import StorageReader, StorageWriter

    meta = dcp.save(state_dict, storage_writer=StorageWriter("ckpt", run="gpt", update=step))
    root = meta.storage_meta.checkpoint_id        # the root digest, on every rank
    dcp.load(state_dict, storage_reader=StorageReader("ckpt", run="gpt"))   # newest, or root=ROOT

What a DCP checkpoint written this way is:

- one alpha_ckpt generation of ``run``/``step``: each rank writes the tensor chunks DCP gives it
  into content-addressed shard objects (BLAKE3 of every chunk, NaN/inf refused, durable commit);
  the coordinator's ``finish`` writes one root manifest naming every shard and publishes the ref,
  after every rank's ``write_data`` has returned (DCP gathers the write results only then), and
  only if the Metadata passes :func:`check_metadata` (the check every load, ``verify`` and
  ``export`` make) and every copy of a replicated entry is bit-equal. A crash before the ref leaves
  the previous generation the newest; the history is fenced as a Checkpointer's (see
  :class:`StorageWriter`);
- DCP's ``Metadata`` is stored in the root manifest as typed canonical JSON, and non-tensor values
  (``BYTE_IO`` items) as typed JSON values (:mod:`alpha_ckpt.format.values`): nothing is pickled
  on disk, and reading never unpickles. DCP itself still exchanges its plans, results and
  exceptions between ranks with ``gather_object`` (pickle over the process group): that is DCP's
  protocol, not this store;
- each rank validates every chunk it will read (BLAKE3, format, finiteness) in
  ``prepare_local_plan``, which DCP gathers before any ``read_data``: if any rank refuses, no
  rank copies a tensor byte or sets a value, and DCP raises ``CheckpointException`` on every
  rank, carrying the refusing rank's :class:`~alpha_ckpt.errors.Refusal`.

Each rank reads only the saved chunks that overlap its destination, and of each only the word
range between the first and last word it needs (exactly its part for row-wise shards).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import weakref
from typing import Any

from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from alpha_ckpt.api import _prefix as counters
from alpha_ckpt.dcp.common import CHAINS, Chain, chain_key, close_own_store
from alpha_ckpt.generation.dcp_metadata import (DCP_KEY, check_chunks, check_generation, check_metadata, chunk_key, decode_metadata,
                           encode_metadata)
from alpha_ckpt.dcp.reader import StorageReader, box_words  # noqa: F401 (re-exported: imported from here)
from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.runtime.launch_env import note_checkpoint_call, note_step
from alpha_ckpt.format.records import DTYPES, CapturePrefix, RegionDecl, ShardRef, canonical_json, check_name, digest_bytes
from alpha_ckpt.state.manifest import check_root_manifest, dtype_name, matches_any
from alpha_ckpt.generation.planner import Piece
from alpha_ckpt.runtime.options import pattern_list
from alpha_ckpt.format.values import encode_value
from alpha_ckpt.store import Store, check_fence
from alpha_ckpt.runtime.teardown import exit_clean
from alpha_ckpt.generation.writer import group_parts, word_bytes, write_manifest, write_shards

__all__ = ["StorageWriter", "StorageReader", "encode_metadata", "decode_metadata", "DCP_KEY"]

# Each chunk is stored as slices of at most this many bytes, each with its own BLAKE3 and block
# digests. A resharded load reads only the 64 KiB blocks that hold its words whatever the slice size,
# and larger slices made saves slower (docs/bench-log/2026-12.md, "slice size").
SLICE_BYTES = 4 << 20
# A rank's slices go into shards of at most this many bytes: one shard per rank loaded slower cold,
# and smaller shards cost a durable commit each (docs/bench-log/2026-12.md).
SHARD_BYTES = 32 << 20


def plan_regions(plans: list[SavePlan]) -> tuple[list[dict], list[dict]]:
    """Pure: one region per tensor chunk of every rank's plan, numbered in rank order.

    Returns the regions (RegionDecl JSON, named ``fqn`` for a whole tensor, ``fqn@o1,o2`` for a
    chunk at those offsets) and, per plan, ``{"fqn@offsets": ordinal}`` for its items."""
    regions, per_plan = [], []
    for plan in plans:
        mine = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            data = item.tensor_data
            key = chunk_key(item.index.fqn, data.chunk.offsets)
            whole = list(data.chunk.sizes) == list(data.size) and not any(data.chunk.offsets)
            mine[key] = len(regions)
            regions.append({"ordinal": len(regions), "name": item.index.fqn if whole else key,
                            "dtype": dtype_name(data.properties.dtype, f"DCP entry {item.index.fqn!r}"),
                            "shape": list(data.chunk.sizes)})
        per_plan.append(mine)
    return regions, per_plan


def _item_key(item) -> str:
    """A write item's key: ``fqn@offsets`` for a tensor chunk, ``fqn`` for a value."""
    if item.type == WriteItemType.BYTE_IO:
        return item.index.fqn
    return chunk_key(item.index.fqn, item.tensor_data.chunk.offsets)


# ---------------------------------------------------------------- the writer


class StorageWriter(_DcpStorageWriter):
    """Writes a DCP checkpoint as one alpha_ckpt generation of ``run``/``step`` at ``update``.

    Construct one per save on every rank (as DCP's ``FileSystemWriter``). ``allow_nonfinite``:
    fqn patterns (``*.causal_mask``; a bare string is one pattern) whose tensors may hold NaN/inf;
    any other that does is refused at save (``non-finite``), as a restore would refuse it.

    History (as a :class:`~alpha_ckpt.Checkpointer`'s): a process that loaded ``run``/``step``
    through :class:`StorageReader` continues it in the next epoch after the generation it loaded;
    one that saved it before continues its own last generation; any other starts at epoch 0 after
    the newest. A publish that would fork the history (another job published in between, or a
    continuation of a newer epoch owns the run) is refused (``fenced``, ``stale-epoch``).

    ``slice_bytes``: the largest piece of a tensor hashed as one slice; ``shard_bytes``: the largest
    object one rank writes (slices are grouped into shards of up to this many bytes). After a save,
    ``phases`` holds this rank's seconds in each of the writer's steps: ``set_up``, ``plan`` (the
    coordinator's), ``write`` and ``finish`` (the coordinator's); the rest of ``dcp.save`` is DCP's own.

    The writer runs no collective of its own: what the ranks must agree on (the shards each wrote,
    the digests of replicated entries) travels in DCP's own plans and write results, over the
    ``process_group`` DCP was given, on whatever thread DCP runs the save. ``group`` is accepted
    for compatibility and not used.
    """

    def __init__(self, store: str | os.PathLike | Store, *, run: str, step: str = "train", update: int,
                 cursor: int = 0, allow_nonfinite=(), group: Any = None, slice_bytes: int = SLICE_BYTES,
                 shard_bytes: int = SHARD_BYTES):
        note_checkpoint_call()  # under alpha-run: a failure from here on is retryable (launch_env)
        note_step()  # a writer per save: a training step done (alpha-run --in-place starts its spares after one)
        self.run, self.step = check_name(run, "run"), check_name(step, "step")
        counters(self.run, self.step, update, cursor, 0)  # alpha_ckpt.save's check: a usage error (ValueError)
        self.update, self.cursor = update, cursor
        self.allow_nonfinite = pattern_list(allow_nonfinite, "allow_nonfinite")
        for value, name in ((slice_bytes, "slice_bytes"), (shard_bytes, "shard_bytes")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} is a positive int, not {value!r}")
        self.slice_bytes, self.shard_bytes = slice_bytes, shard_bytes
        self.phases: dict[str, float] = {}  # this rank's seconds per step of the last save (the class doc)
        self._store_arg, self._store = store, store if isinstance(store, Store) else None
        self.group = group
        self.root: str | None = None
        self._lease = None
        self._planned: tuple | None = None  # the coordinator's: (regions, epoch, follows)
        self._local_items: dict[str, Any] = {}  # this rank's items before DCP's dedup, by key (_item_key)
        self.is_coordinator = False  # set_up_storage_writer says
        exit_clean()  # DCP's collectives over gloo: the process leaves them cleanly at exit (alpha_ckpt.runtime.teardown)

    # DCP's call order: reset, set_up_storage_writer, prepare_local_plan, (coordinator)
    # prepare_global_plan, write_data, (coordinator) finish.
    def reset(self, checkpoint_id=None) -> None:
        self._release()
        self.root = None
        self.phases = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen from a bare path: construct it with its store and run

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta()

    def _open_store(self) -> Store:
        if self._store is None:
            self._store = Store(self._store_arg, create=True)
        return self._store

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        with self._timed("set_up"):
            self._set_up(is_coordinator)

    @contextlib.contextmanager
    def _timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - started

    def _set_up(self, is_coordinator: bool) -> None:
        self.is_coordinator = is_coordinator
        store = self._open_store()
        if is_coordinator:  # gc spares every object this save writes until the ref is out
            self._release()
            lease = store.pending_publish(self.run, self.step)
            # A save that fails before finish() gives the lease back: on the coordinator's own failure at
            # once, else at the next reset() or when the writer is dropped.
            self._lease = weakref.finalize(self, lease.release)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # What this rank holds before DCP keeps one copy of each replicated entry: the coordinator
        # learns from it which entries every holder must hash (replicas must be bit-equal).
        self._local_items = {_item_key(i): i for i in plan.items}
        return dataclasses.replace(plan, storage_data={"holds": list(self._local_items)})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: refuse a save no load could restore, fix the history it continues, number every chunk."""
        try:
            with self._timed("plan"):
                return self._plan(plans)
        except BaseException:
            self._release()  # nothing was written: DCP raises this on every rank before any write
            raise

    def _plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Every tensor whole, once: a rank saving alone (no_dist=True) holds only its own shard of a DTensor.
        for fqn, (size, chunks) in plan_entries(plans).items():
            check_chunks(fqn, size, chunks, f"DCP save of update {self.update}")
        store = self._open_store()
        epoch, follows = self._history(store)
        check_fence(store.history(self.run, self.step, whole=False),
                    CapturePrefix(self.run, self.step, self.update, self.cursor, epoch), follows)
        regions, per_plan = plan_regions(plans)
        for r in regions:
            if matches_any(r["name"].partition("@")[0], self.allow_nonfinite):
                r["nonfinite"] = True
        holders: dict[str, int] = {}
        for p in plans:
            for key in (p.storage_data or {}).get("holds", ()):
                holders[key] = holders.get(key, 0) + 1
        # writers: how many ranks write at once, so that each rank's store learns its write modes for that count
        # and one write mode for every rank's large shards beyond its own probes (buffered while the coordinator probes)
        common = {"regions": regions, "epoch": epoch, "writers": len(plans),
                  "write_mode": store.write_modes.for_save(len(plans))}
        self._planned = (_region_decls(regions), epoch, follows)
        return [SavePlan(p.items, storage_data={**common, "ordinals": mine, "replicas": [
                    k for k in (p.storage_data or {}).get("holds", ()) if holders[k] > 1]},
                         planner_data=p.planner_data, usable=p.usable) for p, mine in zip(plans, per_plan)]

    def _history(self, store: Store) -> tuple[int, int]:
        """(epoch, generation followed) of this save: what this process loaded or saved last, else epoch 0
        after the newest generation (a job that never loaded this run, as a Checkpointer that never restored)."""
        key = chain_key(store, self.run, self.step)
        chain = CHAINS.get(key)
        top = store.history(self.run, self.step, whole=False).top
        if chain is not None and top == 0:  # the store was emptied or made anew: no history left to fork
            del CHAINS[key]
            chain = None
        if chain is not None:
            if chain.stale:
                raise Refusal(RefusalCode.STALE_EPOCH, chain.stale)
            return chain.epoch, chain.follows
        return 0, top  # an unreadable ref's number stays taken

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            with self._timed("write"):
                results = self._write(plan, planner)
        except BaseException:
            self._release()  # the coordinator's own failure; DCP calls no hook for another rank's
            close_own_store(self)
            raise
        if not self.is_coordinator:  # its part is durable; finish() runs on the coordinator only
            close_own_store(self)
        future: Future = Future()
        future.set_result(results)
        return future

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        data = plan.storage_data
        regions = _region_decls(data["regions"])
        prefix = CapturePrefix(self.run, self.step, self.update, self.cursor, data["epoch"])
        results, parts, flats, values = [], [], {}, {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                value = values[_item_key(item)] = _value_of(planner, item)
                results.append(WriteResult(item.index, 0, {"value": value}))
                continue
            key = _item_key(item)
            ordinal = data["ordinals"][key]
            flat = flats[key] = word_bytes(planner.resolve_data(item))
            region = regions[ordinal]
            size = DTYPES[region.dtype][0]
            view, step = memoryview(flat.numpy()), max(1, self.slice_bytes // size)
            for lo in range(0, region.words, step) if region.words else [0]:
                hi = min(region.words, lo + step)
                parts.append((Piece(ordinal, lo, hi, size), view[lo * size:hi * size], "raw"))
            results.append(WriteResult(item.index, flat.numel(), {"region": ordinal}))
        # Every holder of a replicated entry hashes its copy, whether DCP chose it to write it or not.
        replicas = {}
        for key in data.get("replicas", ()):
            item = self._local_items[key]
            if item.type == WriteItemType.BYTE_IO:  # a value (a data loader's state, a step count)
                value = values[key] if key in values else _value_of(planner, item)
                replicas[key] = digest_bytes(canonical_json(value))
                continue
            flat = flats[key] if key in flats else word_bytes(planner.resolve_data(item))
            replicas[key] = digest_bytes(flat.numpy()) if flat.numel() else digest_bytes(b"")
        # Shards of up to shard_bytes (their slices keep their own digests): large enough for the
        # O_DIRECT path, one durable commit per shard instead of one per slice.
        shards = write_shards(self._open_store(), prefix, regions, group_parts(parts, self.shard_bytes),
                              writers=data["writers"], agreed_mode=data["write_mode"])
        # finish() names every rank's shards in the manifest and compares the replicas' digests.
        results.append(WriteResult(MetadataIndex(_RANK_REPORT), 0,
                                   {"shards": [s.to_json() for s in shards], "replicas": replicas}))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: check what every rank wrote, write the root manifest naming every rank's shards,
        then publish the ref."""
        with self._timed("finish"):
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            store = self._open_store()
            shards: dict[str, ShardRef] = {}
            storage_data = {}
            replicas: dict[str, dict[int, str]] = {}
            for rank, rank_results in enumerate(results):
                for result in rank_results:
                    if result.index.fqn == _RANK_REPORT:
                        for record in result.storage_data["shards"]:
                            shards[record["digest"]] = ShardRef.from_json(record)
                        for key, digest in result.storage_data["replicas"].items():
                            replicas.setdefault(key, {})[rank] = digest
                        continue
                    storage_data[result.index] = dict(result.storage_data)
            check_replicas(replicas, f"DCP save of update {self.update}")
            metadata.storage_data = storage_data
            regions, epoch, follows = self._planned  # what prepare_global_plan decided
            check_metadata(metadata, regions, f"DCP save of update {self.update}")  # what every load checks
            prefix = CapturePrefix(self.run, self.step, self.update, self.cursor, epoch)
            world = len(results)  # the ranks that saved (1 under no_dist=True, whatever the group)
            records = list(shards.values())

            def check(manifest) -> None:  # what every reader runs, before the ref
                check_root_manifest(manifest, records, f"root manifest {manifest.digest[:16]}...")
                check_generation(manifest)
            root, size = write_manifest(store, prefix, regions, records, world, {DCP_KEY: encode_metadata(metadata)},
                                        check=check)
            record = store.publish_ref(prefix, root, size, size + sum(s.size for s in shards.values()),
                                       owners=world, follows=follows)
            CHAINS[chain_key(store, self.run, self.step)] = Chain(epoch, record.generation)
            self.root = record.root
        finally:
            self._release()
            close_own_store(self)
        # dcp.save returns this Metadata on every rank: it names the generation it became.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.checkpoint_id = self.root

    def _release(self) -> None:
        if self._lease is not None:
            self._lease()  # the finalizer: releases once, and never again when the writer is dropped
            self._lease = None


_RANK_REPORT = "\x00alpha_ckpt.rank"  # the write result that carries a rank's shards and replica digests


def plan_entries(plans: list[SavePlan]) -> dict[str, tuple[tuple[int, ...], list]]:
    """Pure: every tensor entry of the (deduplicated) plans: {fqn: (size, [(offsets, sizes), ...])}."""
    out: dict[str, tuple[tuple[int, ...], list]] = {}
    for plan in plans:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            data = item.tensor_data
            size, chunks = out.setdefault(item.index.fqn, (tuple(data.size), []))
            if tuple(data.size) != size:
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"DCP entry {item.index.fqn!r} is of size {list(size)} on "
                              f"one rank and {list(data.size)} on another")
            chunks.append((tuple(data.chunk.offsets), tuple(data.chunk.sizes)))
    return out


def check_replicas(replicas: dict[str, dict[int, str]], what: str) -> None:
    """Pure: every copy of a replicated chunk ({chunk key: {rank: digest}}) is bit-equal, or ``mixed-capture``
    naming the entry (DCP would keep one rank's copy and drop the others silently)."""
    for key, by_rank in replicas.items():
        ranks = sorted(by_rank)
        differ = [r for r in ranks if by_rank[r] != by_rank[ranks[0]]]
        if differ:
            fqn, at, offsets = key.rpartition("@")
            entry = f"entry {fqn!r} (chunk at [{offsets}])" if at else f"value {key!r}"
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"{what}: {entry} is replicated (every rank saves it under "
                          f"that name) but rank {ranks[0]} and rank {differ[0]} hold different values; save "
                          "state that differs per rank under per-rank names")


def _region_decls(regions: list[dict]) -> tuple[RegionDecl, ...]:
    return tuple(RegionDecl(r["ordinal"], r["name"], r["dtype"], tuple(r["shape"]), bool(r.get("nonfinite")))
                 for r in regions)


def _value_of(planner: SavePlanner, item) -> Any:
    """A non-tensor entry as typed JSON, taken from the planner without DCP's torch.save (pickle)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise ValueError(f"DCP entry {item.index.fqn!r} is not a tensor and planner {type(planner).__name__} has no "
                         "lookup_object(): alpha_ckpt stores values as typed JSON and never pickles them")
    return encode_value(lookup(item.index), item.index.fqn)
