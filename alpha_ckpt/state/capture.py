"""What a state may hold, and how it becomes regions plus one typed skeleton.

A state is a dict whose values may be tensors, NumPy arrays, Stateful objects
(anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers,
LR schedulers, data loaders, :class:`~alpha_ckpt.state.rng.RNGState`), plain
values (None, bool, int, float, str, bytes) and lists, tuples and dicts of all
of these. Capturing it (pure, no I/O):

- every tensor (and array) becomes a region named by its dotted path
  (``optim.state.0.exp_avg``: dict keys, int keys and list indices joined by
  dots), in the order met;
- everything else becomes the skeleton: the typed JSON of
  :mod:`alpha_ckpt.format.values`, with ``{"tensor": name}`` where a tensor was.
  A Stateful object is recorded as what its ``state_dict()`` returned; a module's keys
  as the plain module's, without the ``_orig_mod.`` segments torch.compile adds
  (:mod:`alpha_ckpt.state.compiled`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import RegionDecl
from alpha_ckpt.state.manifest import regions_of
from alpha_ckpt.format.values import encode_value
from alpha_ckpt.state.compiled import as_plain
from alpha_ckpt.state.loaders import warn_if_worker_generators_unsaved
from alpha_ckpt.state.placement import Partitioned, PerRank, ShardRanges, dtensor_part, is_dtensor


def is_stateful(obj: Any) -> bool:
    """The Stateful protocol of torch.distributed.checkpoint: ``state_dict()`` and ``load_state_dict()``."""
    return (not isinstance(obj, (torch.Tensor, Mapping, list, tuple, np.ndarray))
            and callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))


@dataclass(frozen=True)
class CapturedState:
    """A state as regions (``named``: dotted name and tensor, in declaration order) and a typed skeleton.

    ``placement[i]`` says where region i lives: "replicated" (every rank holds it
    whole), "per-rank" (this rank's own, inside a :class:`PerRank`),
    (lo, hi, shape): this rank's words of a :class:`Partitioned` region,
    ("ranges", ((lo, hi, at), ...), shape): its words as several ranges (its flat words
    [at, at + hi - lo) are the region's [lo, hi)), or ("dtensor", ranges, shape): a sharded
    DTensor's local shard so, which other ranks may hold alike (HSDP, a sub-mesh of the ranks).
    """

    named: tuple[tuple[str, torch.Tensor], ...]
    skeleton: Any
    placement: tuple[Any, ...] = ()

    def regions(self, allow_nonfinite: Sequence[str] = ()) -> tuple[RegionDecl, ...]:
        decls = regions_of(self.named, allow_nonfinite)
        return tuple(RegionDecl(r.ordinal, r.name, r.dtype, p[2], r.nonfinite) if isinstance(p, tuple) else r
                     for r, p in zip(decls, self.placement or ("replicated",) * len(decls)))


def capture_state(state: Mapping[str, Any], rank: int = 0, world: int = 1, rules: Any = None) -> CapturedState:
    """Call every Stateful's ``state_dict()`` and split ``state`` into regions and skeleton.

    ``rank`` of ``world``: a :class:`PerRank` entry at PATH becomes
    ``{"per_rank": [...]}`` with this rank's part at index ``rank`` (None at the
    others') and regions named ``PATH.RANK...``. ``rules``
    (:class:`~alpha_ckpt.state.rules.PlacementRules`): an entry matching a
    ``per_rank`` pattern is captured as if wrapped in PerRank; a tensor matching
    a ``from_rank0`` pattern is rank 0's words only. Raises ValueError naming the
    entry for what a state cannot hold, and for two entries whose dotted names
    coincide (``{"a.b": x}`` beside ``{"a": {"b": y}}``, or keys ``0`` and ``"0"``); a Refusal
    (``format``) naming the entry for a tensor whose words cannot be stored (sparse, nested, meta).
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"a state is a dict, not a {type(state).__name__}")
    named: list[tuple[str, torch.Tensor]] = []
    placement: list[Any] = []
    seen: set[str] = set()
    per_rank_depth = [0]

    def leaf(obj: Any, name: str) -> Any:
        kind = rules.kind(name) if rules and not per_rank_depth[0] else None
        if kind == "per-rank" and not isinstance(obj, PerRank):
            return leaf(PerRank(obj), name)
        if isinstance(obj, PerRank):
            if per_rank_depth[0]:
                raise ValueError(f"state entry {name!r}: PerRank inside PerRank")
            per_rank_depth[0] += 1
            try:
                mine = encode_value(obj.value, f"{name}.{rank}", leaf)
            finally:
                per_rank_depth[0] -= 1
            return {"per_rank": [mine if r == rank else None for r in range(world)]}
        if isinstance(obj, Partitioned):
            if per_rank_depth[0]:
                raise ValueError(f"state entry {name!r}: Partitioned inside PerRank")
            return {"tensor": add(name, obj.tensor, (obj.lo, obj.hi, obj.shape))}
        if is_dtensor(obj):  # its local shard, as word ranges of the global tensor (or whole if replicated)
            part = dtensor_part(obj, name)
            if isinstance(part, torch.Tensor):
                return {"tensor": add(name, part)}
            if per_rank_depth[0]:
                raise ValueError(f"state entry {name!r}: a sharded DTensor inside PerRank")
            # Tagged apart from Partitioned: other ranks may hold this shard alike (a sub-mesh, HSDP)
            ranges = part.ranges if isinstance(part, ShardRanges) else \
                (((part.lo, part.hi, 0),) if part.hi > part.lo else ())
            return {"tensor": add(name, part.tensor, ("dtensor", ranges, part.shape))}
        if isinstance(obj, torch.Tensor):
            return {"tensor": add(name, obj, rank0(obj) if kind == "rank0" else None)}
        if isinstance(obj, np.ndarray):
            if not obj.dtype.isnative or obj.dtype.kind not in "biuf":
                raise ValueError(f"state entry {name!r}: NumPy dtype {obj.dtype} is not saved (numbers in native "
                                 "byte order only)")
            # ascontiguousarray makes a 0-d array 1-d: the region keeps the array's own shape
            tensor = torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))
            return {"ndarray": add(name, tensor, rank0(tensor) if kind == "rank0" else None)}
        if is_stateful(obj):
            warn_if_worker_generators_unsaved(obj)
            inner = obj.state_dict()
            if not isinstance(inner, Mapping):
                raise ValueError(f"state entry {name!r}: state_dict() returned a {type(inner).__name__}, not a dict")
            if isinstance(obj, torch.nn.Module):
                inner = as_plain(obj, inner)
            return encode_value(inner if type(inner) in (dict, OrderedDict) else dict(inner), name, leaf)
        return NotImplemented

    def rank0(tensor: torch.Tensor) -> tuple:
        # Rank 0 holds all the words, the others none (their copies are neither written nor compared).
        shape = tuple(tensor.shape)
        return (0, tensor.numel(), shape) if rank == 0 else ("ranges", (), shape)

    def add(name: str, tensor: torch.Tensor, where: Any = None) -> str:
        problem = unstorable(tensor)
        if problem:  # a Refusal naming the entry, not torch's error from deep inside a write
            raise Refusal(RefusalCode.FORMAT, f"state entry {name!r}: {problem}")
        if name in seen:
            raise ValueError(f"state entry {name!r} appears twice after joining nested keys with dots")
        seen.add(name)
        named.append((name, tensor))
        placement.append(where if where is not None else ("per-rank" if per_rank_depth[0] else "replicated"))
        return name

    skeleton = {"dict": [[key, encode_value(value, str(key), leaf)] for key, value in _top_items(state)]}
    return CapturedState(tuple(named), skeleton, tuple(placement))


def unstorable(tensor: torch.Tensor) -> str | None:
    """Why a tensor's words cannot be stored as one flat region (a sparse, nested or meta tensor), or None."""
    if tensor.is_nested:
        return "a nested tensor is not saved (save its component tensors)"
    if tensor.layout != torch.strided:
        return f"a tensor of layout {tensor.layout} is not saved (save .to_dense(), or its indices and values)"
    if tensor.is_meta:
        return "a meta tensor holds no data to save (materialize it first, e.g. module.to_empty() and init)"
    return None


def _top_items(state: Mapping[str, Any]) -> Iterable[tuple[Any, Any]]:
    for key, value in state.items():
        if type(key) not in (str, int) or key == "":
            raise ValueError(f"state key {key!r}: top-level keys are non-empty strings or ints")
        yield key, value


def flatten_state(state) -> list[tuple[str, torch.Tensor]]:
    """The (dotted name, tensor) regions of ``state``, in declaration order (:func:`capture_state`)."""
    return list(capture_state(state).named)
