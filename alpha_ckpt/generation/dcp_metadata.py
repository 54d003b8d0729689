"""DCP's ``Metadata`` as a root manifest stores it: typed canonical JSON, decoded and checked (pure).

The DCP backend (:mod:`alpha_ckpt.dcp`) writes it; every reader of a generation checks it
(:func:`check_generation`: restore, ``verify``, ``export``), so it sits below them, apart from
the backend's StorageWriter and StorageReader.
"""
from __future__ import annotations

import bisect
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import DTYPES
from alpha_ckpt.state.manifest import dtype_name, torch_dtype
from alpha_ckpt.format.values import decode_value, encode_value

DCP_KEY = "dcp"  # the root manifest's metadata entry that holds DCP's Metadata
_MEMORY_FORMATS = {torch.contiguous_format: "contiguous", torch.channels_last: "channels_last",
                   torch.preserve_format: "preserve"}


def chunk_key(fqn: str, offsets) -> str:
    """The name of the region that holds the chunk of DCP entry ``fqn`` at ``offsets``."""
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


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
        storage_data = {}
        for i, d in obj["storage_data"]:
            index = _index_of(i, what)
            if index in storage_data:  # a dict would keep the last one silently
                raise Refusal(RefusalCode.FORMAT, f"{what}: storage key {_index_json(index)!r:.80} appears twice")
            storage_data[index] = d
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


def check_chunks(fqn: str, size, chunks, what: str = "DCP metadata") -> None:
    """Pure: the chunks ``[(offsets, sizes), ...]`` of entry ``fqn`` lie inside ``size`` and tile it exactly
    (every element in one chunk), or a Refusal: ``coverage`` for a chunk out of bounds, a gap or an
    overlap, ``format`` for a chunk of another rank (number of dimensions)."""
    size = tuple(int(n) for n in size)
    boxes = []
    for offsets, sizes in chunks:
        offsets, sizes = tuple(int(o) for o in offsets), tuple(int(n) for n in sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise Refusal(RefusalCode.FORMAT, f"{what}: entry {fqn!r} of size {list(size)} has a chunk at "
                          f"{list(offsets)} of {list(sizes)}: not of its number of dimensions")
        if any(o < 0 or n < 0 or o + n > bound for o, n, bound in zip(offsets, sizes, size)):
            raise Refusal(RefusalCode.COVERAGE, f"{what}: entry {fqn!r} of size {list(size)} has a chunk at "
                          f"{list(offsets)} of {list(sizes)}, outside the tensor")
        if math.prod(sizes):  # an empty chunk (an empty shard) holds nothing: it can neither overlap nor cover
            boxes.append((offsets, sizes))
    held, whole = sum(math.prod(s) for _, s in boxes), math.prod(size)
    # Overlaps: a sweep along the dimension the chunks split most (rows for Shard(0), columns for Shard(1)).
    if len(boxes) > 1 and not size:  # a 0-dim tensor is one element: two chunks of it overlap
        raise Refusal(RefusalCode.COVERAGE, f"{what}: 0-dim entry {fqn!r} has {len(boxes)} chunks")
    if len(boxes) > 1:
        dim = max(range(len(size)), key=lambda d: len({o[d] for o, _ in boxes}))
        active: list[tuple[int, int]] = []  # (end along dim, box index), sorted
        for i in sorted(range(len(boxes)), key=lambda i: boxes[i][0][dim]):
            offsets, sizes = boxes[i]
            del active[:bisect.bisect_right(active, (offsets[dim], math.inf))]
            for _, j in active:
                other_offsets, other_sizes = boxes[j]
                if all(o < p + m and p < o + n for o, n, p, m in zip(offsets, sizes, other_offsets, other_sizes)):
                    raise Refusal(RefusalCode.COVERAGE, f"{what}: entry {fqn!r} has overlapping chunks at "
                                  f"{list(offsets)} and {list(other_offsets)}")
            bisect.insort(active, (offsets[dim] + sizes[dim], i))
    if held != whole:  # disjoint and inside: fewer elements than the tensor means a gap
        raise Refusal(RefusalCode.COVERAGE, f"{what}: the chunks of entry {fqn!r} hold {held} of its {whole} "
                      f"elements of size {list(size)}: the rest was never saved")


def expected_region_name(fqn: str, offsets, sizes, size) -> str:
    """The region name :func:`plan_regions` gives the chunk of ``fqn`` at ``offsets`` (pure)."""
    whole = list(sizes) == list(size) and not any(offsets)
    return fqn if whole else chunk_key(fqn, offsets)


def check_metadata(metadata: Metadata, regions, what: str = "DCP metadata") -> None:
    """Pure: the one check of a DCP generation's Metadata against its regions, made before any byte is
    trusted (by ``dcp.load`` through :class:`StorageReader`, ``verify``, ``export`` and the writer
    before its ref). Every tensor entry is tiled exactly by its chunks (:func:`check_chunks`); every
    chunk has one storage item naming one region of its own name, dtype and shape, and no region or
    storage key serves two; every value entry has its value; nothing else is stored. Refusal
    (``format`` or ``coverage``) otherwise."""
    claimed: dict[int, str] = {}
    expected = set()
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            index = MetadataIndex(fqn)
            data = metadata.storage_data.get(index)
            if not isinstance(data, dict) or "value" not in data:
                raise Refusal(RefusalCode.COVERAGE, f"{what}: value entry {fqn!r} has no stored value")
            expected.add(index)
            continue
        check_chunks(fqn, md.size, [(c.offsets, c.sizes) for c in md.chunks], what)
        dtype = dtype_name(md.properties.dtype, f"{what}: entry {fqn!r}")
        for chunk in md.chunks:
            index = MetadataIndex(fqn, chunk.offsets)
            at = f"{what}: entry {fqn!r} chunk at {list(chunk.offsets)}"
            if index in expected:
                raise Refusal(RefusalCode.FORMAT, f"{at} is listed twice")
            expected.add(index)
            data = metadata.storage_data.get(index)
            ordinal = data.get("region") if isinstance(data, dict) else None
            if type(ordinal) is not int or not 0 <= ordinal < len(regions):
                raise Refusal(RefusalCode.COVERAGE, f"{at} has no stored region (storage item {data!r:.80})")
            if ordinal in claimed:
                raise Refusal(RefusalCode.FORMAT, f"{at} claims region {ordinal}, which {claimed[ordinal]} claims too")
            region = regions[ordinal]
            name = expected_region_name(fqn, chunk.offsets, chunk.sizes, md.size)
            if (region.name, region.dtype, list(region.shape)) != (name, dtype, list(chunk.sizes)):
                raise Refusal(RefusalCode.FORMAT, f"{at} ({dtype} {list(chunk.sizes)}) claims region {ordinal}, "
                              f"which holds {region.name!r} ({region.dtype} {list(region.shape)})")
            claimed[ordinal] = f"entry {fqn!r} chunk at {list(chunk.offsets)}"
    extra = [i for i in metadata.storage_data if i not in expected]
    if extra:
        raise Refusal(RefusalCode.FORMAT, f"{what}: storage item {_index_json(extra[0])!r:.80} belongs to no entry")
    unclaimed = [r for r in regions if r.ordinal not in claimed]
    if unclaimed:
        raise Refusal(RefusalCode.FORMAT, f"{what}: region {unclaimed[0].ordinal} ({unclaimed[0].name!r}) is "
                      "stored but no entry's chunk claims it")


_CHECKED: set[str] = set()  # root digests whose DCP metadata passed check_metadata (content-addressed: for good)


def check_generation(manifest, what: str | None = None) -> Metadata:
    """The DCP Metadata of a root manifest, decoded and checked (:func:`check_metadata`); Refusal otherwise."""
    what = what or f"generation {manifest.digest[:16]}... DCP metadata"
    if not isinstance(manifest.metadata, dict) or DCP_KEY not in manifest.metadata:
        raise Refusal(RefusalCode.FORMAT, f"{what}: the root manifest holds no DCP metadata")
    metadata = decode_metadata(manifest.metadata[DCP_KEY], what)
    if manifest.digest not in _CHECKED:
        check_metadata(metadata, manifest.regions, what)
        _CHECKED.add(manifest.digest)
    return metadata


def logical_tensors(encoded: Any, regions, chunks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pure: every DCP tensor entry at its full size, assembled from its chunks (``chunks[ordinal]``,
    region-shaped or flat) by the stored Metadata. Non-tensor entries are not tensors: left out.
    The Metadata is checked first (:func:`check_metadata`): every element of every tensor comes from
    exactly one stored chunk, so nothing is left as allocated."""
    metadata = decode_metadata(encoded)
    check_metadata(metadata, regions)
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk in md.chunks:
            region = regions[metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]["region"]]
            box = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))]
            box.copy_(chunks[region.ordinal].reshape(-1).view(md.properties.dtype).reshape(tuple(chunk.sizes)))
        out[fqn] = full
    return out
