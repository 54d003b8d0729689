"""alpha_ckpt as a storage backend for ``torch.distributed.checkpoint`` (DCP).

``dcp.save``, ``dcp.async_save`` and ``dcp.load`` run unchanged (DCP plans, dedups replicated
entries and reshards); every byte goes through the alpha_ckpt store::

    import torch.distributed.checkpoint as dcp
    from alpha_ckpt.dcp import StorageReader, StorageWriter

    meta = dcp.save(state_dict, storage_writer=StorageWriter("ckpt", run="gpt", update=step))
    root = meta.storage_meta.checkpoint_id        # the root digest, on every rank
    dcp.load(state_dict, storage_reader=StorageReader("ckpt", run="gpt"))   # newest, or root=<digest>

What a DCP checkpoint written this way is:

- one alpha_ckpt generation of ``run``/``step``: each rank writes the tensor chunks DCP gives it
  into content-addressed shard objects (BLAKE3 of every chunk, NaN/inf refused, durable commit);
  the coordinator's ``finish`` writes one root manifest naming every shard and publishes the ref,
  after every rank's ``write_data`` has returned (DCP gathers the write results only then). A
  crash before the ref leaves the previous generation the newest; the history is fenced as for
  any generation (an older epoch, a concurrent publisher or an update that goes backwards is
  refused);
- DCP's ``Metadata`` is stored in the root manifest as typed canonical JSON, and non-tensor values
  (``BYTE_IO`` items) as typed JSON values (:mod:`alpha_ckpt.state.values`): nothing is pickled
  on disk, and reading never unpickles. DCP itself still exchanges its plans, results and
  exceptions between ranks with ``gather_object`` (pickle over the process group): that is DCP's
  protocol, not this store;
- ``read_data`` validates every chunk it reads (BLAKE3, format, finiteness), the ranks agree
  (one all_reduce), and only then copies: if any rank refuses, no rank copies a tensor byte or
  sets a value, and DCP raises ``CheckpointException`` on every rank, carrying the refusing
  rank's :class:`~alpha_ckpt.errors.Refusal`.

Each rank reads only the saved chunks that overlap its destination, and of each only the word
range between the first and last word it needs (exactly its part for row-wise shards).
"""
from __future__ import annotations

import io
import math
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, \
    WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .collective.verdict import any_rank
from .errors import Refusal, RefusalCode
from .format import DTYPES, CapturePrefix, RegionDecl, ShardRef, check_name
from .manifest import dtype_name, torch_dtype
from .planner import Piece, WantedSlice
from .publish.wire import broadcast_json
from .restore import PreparedRestore, check_structure, latest_generation, open_generation
from .state.capture import matches_any
from .state.placement import box_ranges
from .state.values import decode_value, encode_value
from .store import Store
from .writer import group_parts, word_bytes, write_manifest, write_shards

__all__ = ["StorageWriter", "StorageReader", "encode_metadata", "decode_metadata", "DCP_KEY"]

DCP_KEY = "dcp"  # the root manifest's metadata entry that holds DCP's Metadata
# Each chunk is stored as slices of at most this many bytes, each with its own BLAKE3 and block
# digests. A resharded load reads only the 64 KiB blocks that hold its words, whatever the slice
# size; 4, 16 and 32 MiB slices loaded a 1 GiB Shard(0) state cold on 4 ranks in the same time
# (medians 0.50, 0.53 and 0.51 s). Saves of that state (paired probes of 30 rounds) took 1.14x
# and 1.22x as long on 2 ranks with 16 and 32 MiB slices as with 4 MiB ones, and 0.79-0.96x as
# long on 4 ranks with 16 MiB ones (in 16 or 32 MiB shards); the 2-rank benchmark with 16 MiB
# slices missed DCP (0.67x) where 4 MiB ones met it (1.46x). So 4 MiB stays.
SLICE_BYTES = 4 << 20
# A rank's slices go into shards of at most this many bytes. Cold loads of a rank's whole share in
# one shard ran at 0.60-0.92x DCP's throughput in every benchmark run; 32 MiB shards at 1.12-1.23x
# in one run and 0.78-0.99x in the next (saves: one durable commit per shard, 10-20% slower).
SHARD_BYTES = 32 << 20
_MEMORY_FORMATS = {torch.contiguous_format: "contiguous", torch.channels_last: "channels_last",
                   torch.preserve_format: "preserve"}


# ---------------------------------------------------------------- Metadata as typed JSON (pure)


def _size(value: Any, what: str) -> torch.Size:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise Refusal(RefusalCode.FORMAT, f"{what}: a size is a list of non-negative integers, not {value!r:.80}")
    return torch.Size(value)


def _index_json(index: MetadataIndex) -> list:
    return [index.fqn, None if index.offset is None else list(index.offset)]


def _index_of(value: Any, what: str) -> MetadataIndex:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        raise Refusal(RefusalCode.FORMAT, f"{what}: an index is [fqn, offsets or null], not {value!r:.80}")
    return MetadataIndex(value[0], None if value[1] is None else _size(value[1], what))


def encode_metadata(metadata: Metadata) -> dict:
    """DCP's Metadata as typed canonical JSON (pure). Raises ValueError for what it cannot hold."""
    entries = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            entries.append([fqn, {"bytes": True}])
            continue
        p = md.properties
        if p.layout != torch.strided:
            raise ValueError(f"DCP entry {fqn!r} has layout {p.layout}; only strided tensors are stored")
        entries.append([fqn, {"tensor": {
            "dtype": dtype_name(p.dtype, f"DCP entry {fqn!r}"), "requires_grad": bool(p.requires_grad),
            "memory_format": _MEMORY_FORMATS[p.memory_format], "pin_memory": bool(p.pin_memory),
            "size": list(md.size), "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}}])
    meta = metadata.storage_meta
    return {
        "version": metadata.version,
        "state_dict_metadata": entries,
        "planner_data": encode_value(metadata.planner_data, "DCP planner_data"),
        "storage_data": [[_index_json(i), d] for i, d in (metadata.storage_data or {}).items()],
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id, "load_id": meta.load_id, "modules": list(meta.modules)},
    }


def decode_metadata(obj: Any, what: str = "DCP metadata") -> Metadata:
    """The Metadata that :func:`encode_metadata` encoded; a hostile value raises Refusal (``format``)."""
    try:
        entries: dict[str, Any] = {}
        for fqn, md in obj["state_dict_metadata"]:
            if not isinstance(fqn, str) or fqn in entries:
                raise Refusal(RefusalCode.FORMAT, f"{what}: entry name {fqn!r:.80} is not a new string")
            if md == {"bytes": True}:
                entries[fqn] = BytesStorageMetadata()
                continue
            t = md["tensor"]
            if t["dtype"] not in DTYPES:
                raise Refusal(RefusalCode.FORMAT, f"{what}: entry {fqn!r} has unknown dtype {t['dtype']!r:.40}")
            formats = {v: k for k, v in _MEMORY_FORMATS.items()}
            properties = TensorProperties(dtype=torch_dtype(t["dtype"]), layout=torch.strided,
                                          requires_grad=bool(t["requires_grad"]),
                                          memory_format=formats[t["memory_format"]], pin_memory=bool(t["pin_memory"]))
            chunks = [ChunkStorageMetadata(offsets=_size(o, what), sizes=_size(s, what)) for o, s in t["chunks"]]
            entries[fqn] = TensorStorageMetadata(properties, _size(t["size"], what), chunks)
        storage_data = {_index_of(i, what): d for i, d in obj["storage_data"]}
        meta = obj["storage_meta"]
        storage_meta = None if meta is None else StorageMeta(
            checkpoint_id=meta["checkpoint_id"], save_id=meta["save_id"], load_id=meta["load_id"],
            modules=list(meta["modules"]))
        version = obj["version"]
        if version is not None and not isinstance(version, str):
            raise Refusal(RefusalCode.FORMAT, f"{what}: version is a string")
        return Metadata(state_dict_metadata=entries, planner_data=decode_value(obj["planner_data"], what),
                        storage_data=storage_data, storage_meta=storage_meta, version=version)
    except Refusal:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise Refusal(RefusalCode.FORMAT, f"{what} is malformed ({type(exc).__name__}: {exc})") from None


def logical_tensors(encoded: Any, regions, chunks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pure: every DCP tensor entry at its full size, assembled from its chunks (``chunks[ordinal]``,
    region-shaped or flat) by the stored Metadata. Non-tensor entries are not tensors: left out."""
    metadata = decode_metadata(encoded)
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            data = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if not isinstance(data, dict) or not 0 <= data.get("region", -1) < len(regions):
                raise Refusal(RefusalCode.COVERAGE, f"DCP entry {fqn!r}: no stored chunk at {list(chunk.offsets)}")
            region = regions[data["region"]]
            if list(region.shape) != list(chunk.sizes):
                raise Refusal(RefusalCode.FORMAT, f"DCP entry {fqn!r}: chunk at {list(chunk.offsets)} is "
                              f"{list(chunk.sizes)}, its region {region.name!r} is {list(region.shape)}")
            box = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))]
            box.copy_(chunks[region.ordinal].reshape(-1).view(md.properties.dtype).reshape(tuple(chunk.sizes)))
        out[fqn] = full
    return out


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
            key = _chunk_key(item.index.fqn, data.chunk.offsets)
            whole = list(data.chunk.sizes) == list(data.size) and not any(data.chunk.offsets)
            mine[key] = len(regions)
            regions.append({"ordinal": len(regions), "name": item.index.fqn if whole else key,
                            "dtype": dtype_name(data.properties.dtype, f"DCP entry {item.index.fqn!r}"),
                            "shape": list(data.chunk.sizes)})
        per_plan.append(mine)
    return regions, per_plan


def _chunk_key(fqn: str, offsets) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def box_words(chunk_shape: tuple[int, ...], offsets, lengths) -> tuple[int, int]:
    """Pure: the flat word range [lo, hi) of a row-major chunk that holds the box at ``offsets`` of
    ``lengths`` (first to last word of the box; exactly the box when it is contiguous)."""
    ranges = box_ranges(tuple(chunk_shape), tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))
    return (ranges[0][0], ranges[-1][1]) if ranges else (0, 0)


# ---------------------------------------------------------------- the writer


class StorageWriter(_DcpStorageWriter):
    """Writes a DCP checkpoint as one alpha_ckpt generation of ``run``/``step`` at ``update``.

    Construct one per save on every rank (as DCP's ``FileSystemWriter``). The generation continues
    the newest one of ``run``/``step`` (same epoch; ``update`` must be later). ``allow_nonfinite``:
    fqn patterns (``*.causal_mask``) whose tensors may hold NaN/inf; any other that does is
    refused at save (``non-finite``), as a restore would refuse it.
    """

    def __init__(self, store: str | os.PathLike | Store, *, run: str, step: str = "train", update: int,
                 cursor: int = 0, allow_nonfinite=(), group: Any = None, slice_bytes: int = SLICE_BYTES):
        self.run, self.step = check_name(run, "run"), check_name(step, "step")
        if isinstance(update, bool) or not isinstance(update, int) or update < 0:
            raise ValueError(f"update is a non-negative int, not {update!r}")
        self.update, self.cursor = update, int(cursor)
        self.allow_nonfinite = tuple(allow_nonfinite)
        if slice_bytes < 1:
            raise ValueError(f"slice_bytes is positive, not {slice_bytes!r}")
        self.slice_bytes = slice_bytes
        self._store_arg, self._store = store, store if isinstance(store, Store) else None
        self.group = group
        self.root: str | None = None
        self._lease = None
        self._planned: tuple | None = None  # the coordinator's: (regions, epoch, follows)
        self.is_coordinator = False  # set_up_storage_writer says
        self._collective = True  # whether DCP runs this save on every rank (set_up_storage_writer)

    # DCP's call order: reset, set_up_storage_writer, prepare_local_plan, (coordinator)
    # prepare_global_plan, write_data, (coordinator) finish.
    def reset(self, checkpoint_id=None) -> None:
        self._release()
        self.root = None

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
        self.is_coordinator = is_coordinator
        self._collective = _collective_call(kwargs, self.group)
        store = self._open_store()
        if is_coordinator:  # gc spares every object this save writes until the ref is out
            self._release()
            lease = store.pending_publish(self.run, self.step)
            # A save that fails before finish() gives the lease back: at the agreement in write_data,
            # at the next reset(), or (planning failed) when the writer is dropped.
            self._lease = weakref.finalize(self, lease.release)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: number every chunk, and fix the epoch this generation continues."""
        self._collective = _collective_plan(plans, self.group, self._collective)
        history = self._open_store().history(self.run, self.step, whole=False)
        epoch = history.newest.prefix.epoch if history.newest is not None else 0
        follows = history.top  # an unreadable newest ref is passed over; its number stays taken
        regions, per_plan = plan_regions(plans)
        for r in regions:
            if matches_any(r["name"].partition("@")[0], self.allow_nonfinite):
                r["nonfinite"] = True
        # writers: how many ranks write at once, so that each rank's store learns its write modes for that count
        # and one write mode for every rank's large shards beyond its own probes (buffered while the coordinator probes)
        common = {"regions": regions, "epoch": epoch, "follows": follows, "writers": len(plans),
                  "write_mode": self._open_store().save_write_mode(len(plans))}
        self._planned = (_region_decls(regions), epoch, follows)
        return [SavePlan(p.items, storage_data={**common, "ordinals": mine}, planner_data=p.planner_data,
                         usable=p.usable) for p, mine in zip(plans, per_plan)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        data = plan.storage_data
        regions = _region_decls(data["regions"])
        prefix = CapturePrefix(self.run, self.step, self.update, self.cursor, data["epoch"])
        results, parts, keep = [], [], []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                results.append(WriteResult(item.index, 0, {"value": _value_of(planner, item)}))
                continue
            ordinal = data["ordinals"][_chunk_key(item.index.fqn, item.tensor_data.chunk.offsets)]
            flat = word_bytes(planner.resolve_data(item))
            keep.append(flat)
            region = regions[ordinal]
            size = DTYPES[region.dtype][0]
            view, step = memoryview(flat.numpy()), max(1, self.slice_bytes // size)
            for lo in range(0, region.words, step) if region.words else [0]:
                hi = min(region.words, lo + step)
                parts.append((Piece(ordinal, lo, hi, size), view[lo * size:hi * size], "raw"))
            results.append(WriteResult(item.index, flat.numel(), {"region": ordinal}))
        # Shards of up to SHARD_BYTES (their slices keep their own digests): large enough for the
        # O_DIRECT path, one durable commit per shard instead of one per slice.
        failure: BaseException | None = None
        try:
            shards = write_shards(self._open_store(), prefix, regions, group_parts(parts, SHARD_BYTES),
                                  writers=data["writers"], agreed_mode=data["write_mode"])
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the agreement below
            failure = exc
        # DCP calls no hook on the coordinator when another rank's writes fail: the ranks agree here,
        # so the coordinator gives its lease back at once (DCP then raises every rank's failure).
        if _any_rank_failed(failure is not None, self.group, self._collective):
            self._release()
            _close_own_store(self)
            if failure is not None:
                raise failure
        if not self.is_coordinator:  # its part is durable; finish() runs on the coordinator only
            _close_own_store(self)
        records = [s.to_json() for s in shards]
        # The shards travel with the first result: finish() names every rank's in the manifest.
        if results:
            first = results[0]
            results[0] = WriteResult(first.index, first.size_in_bytes, {**first.storage_data, "shards": records})
        elif records:
            raise AssertionError("shards written with no item to report them")
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write the root manifest naming every rank's shards, then publish the ref."""
        try:
            store = self._open_store()
            shards: dict[str, ShardRef] = {}
            storage_data = {}
            for rank_results in results:
                for result in rank_results:
                    data = dict(result.storage_data)
                    for record in data.pop("shards", []):
                        shards[record["digest"]] = ShardRef.from_json(record)
                    storage_data[result.index] = data
            metadata.storage_data = storage_data
            regions, epoch, follows = self._planned  # what prepare_global_plan decided
            prefix = CapturePrefix(self.run, self.step, self.update, self.cursor, epoch)
            world = len(results)  # the ranks that saved (1 under no_dist=True, whatever the group)
            root, size = write_manifest(store, prefix, regions, list(shards.values()), world,
                                        {DCP_KEY: encode_metadata(metadata)})
            record = store.publish_ref(prefix, root, size, size + sum(s.size for s in shards.values()),
                                       owners=world, follows=follows)
            self.root = record.root
        finally:
            self._release()
            _close_own_store(self)
        # dcp.save returns this Metadata on every rank: it names the generation it became.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.checkpoint_id = self.root

    def _release(self) -> None:
        if self._lease is not None:
            self._lease()  # the finalizer: releases once, and never again when the writer is dropped
            self._lease = None


def _close_own_store(storage) -> None:
    """Close the store a writer or reader opened from a path, at the end of its save or load (a next
    one opens it again): its directory descriptors are not held from one checkpoint to the next. A
    Store the caller passed stays open: it is the caller's."""
    if storage._store is not None and not isinstance(storage._store_arg, Store):
        storage._store.close()
        storage._store = None


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


# ---------------------------------------------------------------- the reader


class StorageReader(_DcpStorageReader):
    """Reads a DCP checkpoint that :class:`StorageWriter` wrote: generation ``root`` (a digest), or
    the newest of ``run``/``step`` (``root="latest"``, chosen by rank 0 for every rank).

    ``dcp.load(..., checkpoint_id=digest)`` names the generation too. ``group``: the process group
    DCP loads over (default: the default group); the ranks agree on the verdict over it.
    """

    def __init__(self, store: str | os.PathLike | Store, root: str = "latest", *, run: str | None = None,
                 step: str = "train", group: Any = None):
        if root == "latest" and run is None:
            raise ValueError("StorageReader(root='latest') needs run= (or pass root=<digest>)")
        self.run, self.step = (None if run is None else check_name(run, "run")), check_name(step, "step")
        self.wanted_root, self.group = root, group
        self._store_arg, self._store = store, store if isinstance(store, Store) else None
        self.root: str | None = None  # the generation read_metadata chose; ``prefix`` its run/step/update/cursor/epoch
        self.prefix: CapturePrefix | None = None
        self.regions: tuple[RegionDecl, ...] = ()
        self.bytes_read = 0  # stored bytes of the chunks the last read_data validated
        self._collective = True  # whether DCP runs this load on every rank (set_up_storage_reader)

    # DCP's call order: reset, read_metadata, set_up_storage_reader, prepare_local_plan,
    # (coordinator) prepare_global_plan, read_data.
    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.wanted_root = str(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def _open_store(self) -> Store:
        if self._store is None:
            self._store = Store(self._store_arg, create=False)
        return self._store

    def _choose_root(self) -> str:
        if self.wanted_root != "latest":
            return Store.check_digest(self.wanted_root)
        distributed = dist.is_initialized()
        chosen = None
        if not distributed or dist.get_rank(self.group) == 0:
            try:
                # Heads only: each rank validates the payload bytes it reads, in read_data.
                record, _ = latest_generation(self._open_store(), self.run, self.step, check=check_structure)
                chosen = {"root": record.root} if record else {
                    "code": RefusalCode.MISSING_SHARD.value, "reason": f"{self.run}/{self.step} has no complete generation"}
            except Refusal as refusal:
                chosen = {"code": refusal.code.value, "reason": refusal.message}
        if distributed:  # one choice for every rank, even if a generation is published meanwhile
            chosen = broadcast_json(chosen, dist.get_global_rank(self.group or dist.group.WORLD, 0), self.group)
        if "root" not in chosen:
            raise Refusal(chosen["code"], chosen["reason"])
        return chosen["root"]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.root = self._choose_root()
        store = self._open_store()
        with open_generation(store, self.root, wanted=[]) as generation:
            manifest = generation.manifest
        if not isinstance(manifest.metadata, dict) or DCP_KEY not in manifest.metadata:
            raise Refusal(RefusalCode.FORMAT, f"generation {self.root[:16]}... was not written by DCP (no "
                          f"{DCP_KEY!r} metadata): restore it with alpha_ckpt.Checkpointer or alpha_ckpt.load")
        self.regions, self.prefix = manifest.regions, manifest.prefix
        return decode_metadata(manifest.metadata[DCP_KEY], f"generation {self.root[:16]}... DCP metadata")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._collective = _collective_call(kwargs, self.group)
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        self._collective = _collective_plan(plans, self.group, self._collective)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Validate every chunk this rank reads, agree with every rank, then copy (or copy nothing)."""
        try:
            return self._read_data(plan, planner)
        finally:
            _close_own_store(self)  # read_data is a load's last call on every rank

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        wanted, boxes, values = [], [], []
        failure: BaseException | None = None
        generation = prepared = None
        try:
            for item in plan.items:
                data = self.storage_data.get(item.storage_index)
                if not isinstance(data, dict):
                    raise Refusal(RefusalCode.COVERAGE, f"generation {self.root[:16]}... holds no {item.storage_index.fqn!r} "
                                  f"at {list(item.storage_index.offset or [])}")
                if item.type == LoadItemType.BYTE_IO:
                    values.append((item, decode_value(data["value"], f"DCP entry {item.dest_index.fqn!r}")))
                    continue
                region = self.regions[data["region"]]
                lo, hi = box_words(region.shape, item.storage_offsets, item.lengths)
                wanted.append(WantedSlice(region.ordinal, lo, hi, len(wanted)))
                boxes.append((item, region, lo))
            generation = open_generation(self._open_store(), self.root, wanted=wanted)
            prepared = PreparedRestore(generation, wanted)
        except Refusal as refusal:
            failure = refusal
        except (KeyError, TypeError, IndexError) as exc:
            failure = Refusal(RefusalCode.FORMAT, f"generation {self.root[:16]}... DCP storage data is malformed "
                              f"({type(exc).__name__}: {exc})")
        except Exception as exc:  # noqa: BLE001 - an I/O error too: every rank must reach the agreement
            failure = exc
        if _any_rank_failed(failure is not None, self.group, self._collective):
            if prepared is not None:
                prepared.release()
            if generation is not None:
                generation.close()
            if failure is not None:
                raise failure
            future: Future = Future()
            future.set_result(None)  # another rank refused: DCP raises its refusal here too; nothing copied
            return future
        try:
            # A box that is one word range, bound for a contiguous CPU destination of its dtype (row
            # blocks, FSDP2's shards), is copied straight into it; any other goes through a buffer.
            targets, buffers = [], []
            for w, (item, region, _) in zip(wanted, boxes):
                dest = planner.resolve_tensor(item).detach()
                direct = (dest.device.type == "cpu" and dest.is_contiguous() and dest.numel() == w.hi - w.lo
                          and dest.dtype == torch_dtype(region.dtype))
                buf = dest.reshape(-1).view(torch.uint8) if direct else \
                    torch.empty((w.hi - w.lo) * DTYPES[region.dtype][0], dtype=torch.uint8)
                targets.append((dest, direct))
                buffers.append(buf)
            self.bytes_read = prepared.bytes_read
            prepared.copy_into(buffers)
        finally:
            generation.close()
        for buf, (dest, direct), (item, region, lo) in zip(buffers, targets, boxes):
            if not direct:
                words = buf.view(torch_dtype(region.dtype))
                strides = [math.prod(region.shape[d + 1:]) for d in range(len(region.shape))]
                start = sum(o * s for o, s in zip(item.storage_offsets, strides)) - lo
                source = words.as_strided(tuple(item.lengths), strides, start) if words.numel() else \
                    torch.empty(tuple(item.lengths), dtype=words.dtype)
                dest.copy_(source)
            planner.commit_tensor(item, dest)
        for item, value in values:
            _load_value(planner, item, value)
        future = Future()
        future.set_result(None)
        return future


def _collective_call(kwargs: dict, group) -> bool:
    """Whether DCP runs this save or load on every rank of ``group`` (so the storage may agree over it):
    not with ``use_collectives=False``, nor with ``no_dist=True`` beside a process group (DCP then
    numbers this process rank 0, whatever its rank in the group; on rank 0 itself only the plans
    tell: :func:`_collective_plan`)."""
    if not dist.is_initialized() or not kwargs.get("use_collectives", True):
        return False
    return kwargs.get("rank", dist.get_rank(group)) == dist.get_rank(group)


def _collective_plan(plans: list, group, collective: bool) -> bool:
    """The coordinator's second look: DCP gathers one plan per rank, so a single plan in a larger group
    means this process saves or loads alone (``no_dist=True``, which DCP reports as rank 0: on global
    rank 0 the set-up cannot tell it from a collective call, and agreeing would wait for ranks that
    never come)."""
    if collective and len(plans) == 1 and dist.is_initialized() and dist.get_world_size(group) > 1:
        return False
    return collective


def _any_rank_failed(failed: bool, group, collective: bool = True) -> bool:
    return any_rank(failed, group) if collective and dist.is_initialized() else failed


def _load_value(planner: LoadPlanner, item, value: Any) -> None:
    """Hand a non-tensor value to the planner without torch.load: DCP's default planner gets it set
    directly (what its load_bytes does after unpickling); another planner gets an in-memory
    torch.save of the decoded value (never bytes read from disk)."""
    if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        if planner.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper
            set_element(planner.original_state_dict, planner.mappings[item.dest_index.fqn], value)
        else:
            planner.state_dict[item.dest_index.fqn] = value
        return
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)
