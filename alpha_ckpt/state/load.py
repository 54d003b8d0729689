"""Matching a destination state to a checkpoint's skeleton, by dotted name (pure: nothing is copied here).

The destination decides what is wanted, the checkpoint what it holds:

- a tensor (or NumPy array) is filled in place from the region of the same
  dotted name, which must have its dtype and shape;
- a value (any subtree that holds no tensor) is replaced by the saved value,
  with its saved types (written into the destination's own dict or list when
  both are one, so references a script holds see the restored value);
- a Stateful object's destination is its own ``state_dict()``; once every
  region is copied, ``load_state_dict()`` receives it filled, in state order;
- Stateful objects other than modules create state lazily (an optimizer's
  per-parameter ``state`` after its first step, a data loader's iterator
  state after its first batch), so inside them what the checkpoint holds and
  the fresh object does not yet is created from the checkpoint (new tensors),
  never refused as unexpected; an optimizer's ``state`` is then exactly the
  saved one. Modules and plain dicts match exactly, except that an empty
  dict (``optimizer.state_dict()["state"]`` of a fresh optimizer, taken as a
  plain dict) receives what the checkpoint holds under it;
- a module's keys are matched as the plain module's: a torch.compile'd one's
  ``_orig_mod.`` segments are dropped (:mod:`alpha_ckpt.state.compiled`), so
  compiled and plain modules restore into each other.

Every disagreement is collected first, so one refusal names them all
(:func:`alpha_ckpt.state.manifest.refuse_mismatch`) before a byte is copied.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from alpha_ckpt.errors import Refusal, RefusalCode, RestoreIncomplete
from alpha_ckpt.format.records import RegionDecl
from alpha_ckpt.state.manifest import describe_region, dtype_name, matches_any, refuse_mismatch, torch_dtype
from alpha_ckpt.format.values import PerRankSaved, RegionRef, decode_value, dotted_leaves as _refs
from alpha_ckpt.state.capture import capture_state, is_stateful
from alpha_ckpt.state.compiled import WRAPPED, plain_keys
from alpha_ckpt.state.loaders import settle_lazy_load
from alpha_ckpt.state.optimizers import class_change
from alpha_ckpt.state.placement import Partitioned, PerRank, is_dtensor, restore_ranges

_ABSENT = object()
_COMPILED_HINT = (
    "; an _orig_mod segment is torch.compile's: a module in the state, compiled or not, is saved and matched "
    "without it, and keys that hold it (a compiled module's state_dict() saved as a plain dict, or a compiled "
    "module saved by an older alpha_ckpt) restore into that compiled module only")


@dataclass
class LoadPlan:
    """What a load fills and what it does after.

    ``targets``: (saved region ordinal, destination tensor, lo, hi): the destination
    holds exactly words [lo, hi) of the region (all of it, or a Partitioned range).
    """

    targets: list[tuple[int, torch.Tensor, int, int]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)
    dtype_only: bool = True
    finish: Callable[[], Any] | None = None

    placement_bound: list[str] = field(default_factory=list)
    statefuls: list[str] = field(default_factory=list)  # every Stateful entry, in the order finish loads them
    loaded: list[str] = field(default_factory=list)     # those whose load_state_dict() has returned

    def refusal(self, what: str):
        if self.placement_bound:
            return Refusal(RefusalCode.PLACEMENT_BOUND, f"{what}: per-rank entries were saved by another rank count: "
                           f"{', '.join(self.placement_bound[:10])} (restore with per_rank=\"drop\" to start "
                           "them afresh)")
        if self.missing or self.unexpected or self.differ:
            refusal = refuse_mismatch(what, self.missing, self.unexpected, self.differ, self.dtype_only)
            if any(WRAPPED in name.split(".") for name in self.missing + self.unexpected):
                return Refusal(refusal.code, refusal.message + _COMPILED_HINT)
            return refusal
        return None


def plan_load(state: Mapping, saved: Mapping | None, regions: tuple[RegionDecl, ...], *, rank: int = 0,
              world: int = 1, per_rank: str = "keep", per_rank_entries: tuple[str, ...] = (),
              allow_optimizer_change: Sequence[tuple[str, str]] = ()) -> LoadPlan:
    """Match ``state`` (the caller's, mutated only by ``plan.finish()``) against the decoded skeleton ``saved``.

    ``saved`` is None for a manifest written before skeletons were recorded (tensors
    only): the destination's own structure stands in for it, matched by dotted name.
    A :class:`PerRank` entry restores rank ``rank``'s part when the checkpoint was
    saved by ``world`` ranks; on another count it is refused (``placement-bound``),
    or left as it is with ``per_rank="drop"``. ``per_rank_entries``: the patterns
    the checkpoint records (``Checkpointer(per_rank=...)``): a plain destination
    whose dotted name matches one is filled as if it were wrapped in PerRank. An optimizer whose
    saved state is another class's is refused (``coverage``, naming both classes:
    :mod:`alpha_ckpt.state.optimizers`) unless ``allow_optimizer_change`` names the (saved class,
    destination class) pair.
    """
    by_name = {r.name: r for r in regions}
    plan = LoadPlan()
    matcher = _Matcher(plan, by_name, rank, world, per_rank)
    matcher.per_rank_entries = tuple(per_rank_entries)
    matcher.allow_optimizer_change = tuple(allow_optimizer_change)
    stand_in = saved is None
    if stand_in:
        saved = decode_value(capture_state(state).skeleton)
    plan.finish = matcher.container(state, saved, "", lazy=False)
    plan.placement_bound = matcher.placement_bound
    if stand_in:
        plan.unexpected.extend(name for name in by_name if name not in matcher.named)
    return plan


def _has_region(node: Any) -> bool:
    if isinstance(node, (torch.Tensor, np.ndarray, RegionRef, PerRank, PerRankSaved, Partitioned)) or is_stateful(node):
        return True
    if isinstance(node, Mapping):
        return any(_has_region(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_region(v) for v in node)
    return False


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


class _Matcher:
    def __init__(self, plan: LoadPlan, regions: dict[str, RegionDecl], rank: int = 0, world: int = 1,
                 per_rank: str = "keep"):
        self.plan, self.regions = plan, regions
        self.rank, self.world, self.per_rank = rank, world, per_rank
        self.placement_bound: list[str] = []  # PerRank entries saved by another rank count
        self.named: set[str] = set()  # regions the destination asked for
        self.creating = False         # inside a Stateful that creates its state lazily
        self.per_rank_entries: tuple[str, ...] = ()  # saved per rank by pattern, destination plain
        self.allow_optimizer_change: tuple[tuple[str, str], ...] = ()

    def node(self, dest: Any, saved: Any, name: str) -> Callable[[], Any]:
        """A thunk giving the value for this position once the copies are done."""
        if isinstance(dest, PerRank) or isinstance(saved, PerRankSaved):
            return self.per_rank_entry(dest, saved, name)
        if isinstance(dest, Partitioned) and isinstance(saved, RegionRef):
            fill = self.region(dest.tensor, saved, name, (dest.lo, dest.hi, dest.shape))
            return lambda: (fill(), dest)[1]  # the state keeps its Partitioned entry, its tensor filled in place
        if is_dtensor(dest) and isinstance(saved, RegionRef):
            return self.dtensor(dest, saved, name)
        if is_stateful(dest):
            return self.stateful(dest, saved, name)
        if isinstance(saved, RegionRef):
            return self.region(dest, saved, name)
        if not _has_region(dest):
            if not _has_region(saved):
                return lambda: _in_place(dest, saved)
            if self.creating or (isinstance(dest, Mapping) and not dest):
                return self.fresh(_ABSENT, saved, name)
        if isinstance(dest, Mapping) and isinstance(saved, Mapping):
            return self.container(dest, saved, name, lazy=False)
        if isinstance(dest, (list, tuple)) and isinstance(saved, (list, tuple)) and type(dest) is type(saved):
            return self.sequence(dest, saved, name)
        self.kind_differs(name, saved, dest)
        return lambda: dest

    def dtensor(self, dest: Any, ref: RegionRef, name: str) -> Callable[[], Any]:
        """A DTensor is filled in its local shard: the words of the global tensor that shard holds."""
        part = restore_ranges(dest, name)
        if isinstance(part, torch.Tensor):
            fill = self.region(part, ref, name)
            return lambda: (fill(), dest)[1]
        local = dest.to_local()
        ranges = part.ranges or ((0, 0, 0),)
        before = len(self.plan.targets)
        lo, hi, at = ranges[0]
        fill = self.region(part.tensor[at:at + hi - lo], ref, name, (lo, hi, part.shape))
        if len(self.plan.targets) > before:  # the region matched: every other range of the shard too
            ordinal = self.plan.targets[-1][0]
            self.plan.targets.extend((ordinal, part.tensor[at:at + hi - lo], lo, hi) for lo, hi, at in ranges[1:])

        def finish() -> Any:
            fill()
            if part.tensor.data_ptr() != local.data_ptr() or not local.is_contiguous():
                local.copy_(part.tensor.view(local.shape))  # part.tensor was a contiguous copy: the words go back
            return dest
        return finish

    def kind_differs(self, name: str, saved: Any, dest: Any) -> None:
        self.plan.dtype_only = False
        self.plan.differ.append(f"{name} (saved {_kind(saved, self.regions)}, destination {_kind(dest, self.regions)})")

    def per_rank_entry(self, dest: Any, saved: Any, name: str) -> Callable[[], Any]:
        bare = not isinstance(dest, PerRank) and isinstance(saved, PerRankSaved) and \
            matches_any(name, self.per_rank_entries)
        if bare:  # stored per rank by a recorded pattern: the destination holds the entry itself
            holder = PerRank(dest)
            fill = self.per_rank_entry(holder, saved, name)
            return lambda: fill().value
        if not (isinstance(dest, PerRank) and isinstance(saved, PerRankSaved)):
            self.kind_differs(name, saved, dest)
            return lambda: dest
        if len(saved.parts) != self.world:
            if self.per_rank != "drop":
                self.placement_bound.append(f"{name} (saved by {len(saved.parts)} ranks, restoring on {self.world})")
            return lambda: dest  # dropped: left as the destination holds it
        mine = saved.parts[self.rank]
        fill = self.node(dest.value, mine, _join(name, self.rank))
        self.named.update(ref.name for _, ref in _refs(saved))  # the other ranks' parts are theirs to restore

        def finish() -> Any:
            dest.value = fill()
            return dest
        return finish

    def region(self, dest: Any, ref: RegionRef, name: str, part: tuple | None = None) -> Callable[[], Any]:
        region = self.regions.get(ref.name)
        if region is None:  # only where the destination stands in for the skeleton
            self.plan.missing.append(name)
            return lambda: dest
        self.named.add(ref.name)
        if dest is _ABSENT:  # created: state the object makes lazily, not there yet
            dest = _empty_like_region(region, ref.kind)
        if isinstance(dest, np.ndarray) and ref.kind == "ndarray":
            if not dest.flags.writeable:
                self.kind_differs(name, ref, dest)
                return lambda: dest
            tensor = torch.from_numpy(dest)
        elif isinstance(dest, torch.Tensor) and ref.kind == "tensor":
            tensor = dest
        else:
            self.kind_differs(name, ref, dest)
            return lambda: dest
        try:
            dtype = dtype_name(tensor.dtype, name)
        except ValueError:
            dtype = str(tensor.dtype).removeprefix("torch.")
        shape = part[2] if part is not None else tuple(tensor.shape)
        if (dtype, shape) != (region.dtype, region.shape):
            self.plan.differ.append(f"{name} (saved {describe_region(region)}, destination {dtype}{list(shape)})")
            self.plan.dtype_only = self.plan.dtype_only and shape == region.shape
            return lambda: dest
        lo, hi = (part[0], part[1]) if part is not None else (0, region.words)
        self.plan.targets.append((region.ordinal, tensor, lo, hi))
        return lambda: dest

    def stateful(self, obj: Any, saved: Any, name: str) -> Callable[[], Any]:
        destination = obj.state_dict()
        if not isinstance(saved, Mapping) or not isinstance(destination, Mapping):
            self.kind_differs(name, saved, obj)
            return lambda: obj
        lazy = isinstance(obj, torch.optim.Optimizer)
        if lazy:
            self.check_param_groups(destination, saved, name)
            changed = class_change(obj, saved.get("param_groups"), self.allow_optimizer_change)
            if changed:  # torch would take the state, then fail inside the load or at the first step()
                self.plan.dtype_only = False
                self.plan.differ.append(f"{name} ({changed})")
        keys = _module_keys(obj, destination, saved) if isinstance(obj, torch.nn.Module) else None
        matched = destination if keys is None else _mapping(type(destination), [(k, destination[v])
                                                                                 for k, v in keys.items()])
        outer, self.creating = self.creating, not isinstance(obj, torch.nn.Module)
        try:
            fill = self.container(matched, saved, name, lazy=lazy)
        finally:
            self.creating = outer

        self.plan.statefuls.append(name)

        def finish() -> Any:
            filled = fill()
            if keys is not None:  # back under the keys the module's load_state_dict() takes
                for key, value in filled.items():
                    destination[keys[key]] = value
                filled = destination
            try:
                obj.load_state_dict(filled)
            except RestoreIncomplete:
                raise  # a Stateful inside this one: already named
            except Exception as exc:  # noqa: BLE001 - the tensors are written: say what the state now holds
                plan = self.plan
                after = plan.statefuls[plan.statefuls.index(name) + 1:]
                raise RestoreIncomplete(name, tuple(plan.loaded), tuple(after), exc) from exc
            self.plan.loaded.append(name)
            settle_lazy_load(obj)  # before what follows in state order (an RNGState) is restored
            return obj
        return finish

    def check_param_groups(self, destination: Mapping, saved: Mapping, name: str) -> None:
        """What torch's Optimizer.load_state_dict would refuse after the copies, refused before them."""
        def shape(groups: Any) -> Any:
            if not isinstance(groups, list):
                return None
            return [len(g["params"]) if isinstance(g, Mapping) and isinstance(g.get("params"), list) else None
                    for g in groups]
        mine, theirs = shape(destination.get("param_groups")), shape(saved.get("param_groups"))
        if mine != theirs:
            self.plan.dtype_only = False
            self.plan.differ.append(f"{_join(name, 'param_groups')} (saved parameters per group {theirs}, "
                                    f"destination {mine})")

    def container(self, dest: Mapping, saved: Mapping, name: str, lazy: bool) -> Callable[[], Any]:
        """Dicts: keys match exactly (int keys stay int), or, ``lazy``, the saved ones are created."""
        children: list[tuple[Any, Callable[[], Any]]] = []
        lazy_keys = {"state"} if lazy else set()
        for key, value in saved.items():
            child = _join(name, key)
            if key in dest:
                if key in lazy_keys and isinstance(dest[key], Mapping) and isinstance(value, Mapping):
                    children.append((key, self.created(dest[key], value, child)))
                else:
                    children.append((key, self.node(dest[key], value, child)))
            elif self.creating:
                children.append((key, self.fresh(_ABSENT, value, child)))
            else:
                self.plan.unexpected.append(child)
        for key in dest:
            if key not in saved:
                self.plan.missing.append(_join(name, key))

        def finish() -> Any:
            values = [(key, thunk()) for key, thunk in children]
            if isinstance(dest, dict):
                for key, value in values:
                    dest[key] = value
                return dest
            return _mapping(type(dest), values)
        return finish

    def created(self, dest: Mapping, saved: Mapping, name: str) -> Callable[[], Any]:
        """An optimizer's ``state``: the saved entries, filling the destination's tensors where it has them."""
        children = []
        for key, value in saved.items():
            children.append((key, self.fresh(dest.get(key, _ABSENT), value, _join(name, key))))

        def finish() -> Any:
            values = [(key, thunk()) for key, thunk in children]
            out = dest if isinstance(dest, dict) else {}
            out.clear()
            out.update(values)
            return out
        return finish

    def fresh(self, dest: Any, saved: Any, name: str) -> Callable[[], Any]:
        if isinstance(saved, RegionRef):
            return self.region(dest, saved, name)
        if isinstance(saved, Mapping):
            mine = dest if isinstance(dest, Mapping) else {}
            children = [(k, self.fresh(mine.get(k, _ABSENT), v, _join(name, k))) for k, v in saved.items()]
            return lambda: _mapping(type(saved), [(k, thunk()) for k, thunk in children])
        if isinstance(saved, (list, tuple)):
            mine = dest if isinstance(dest, (list, tuple)) and len(dest) == len(saved) else [_ABSENT] * len(saved)
            children = [self.fresh(d, v, _join(name, i)) for i, (d, v) in enumerate(zip(mine, saved))]
            return lambda: type(saved)(thunk() for thunk in children)
        return lambda: saved

    def sequence(self, dest: list | tuple, saved: list | tuple, name: str) -> Callable[[], Any]:
        children = [self.node(d, s, _join(name, i)) for i, (d, s) in enumerate(zip(dest, saved))]
        self.plan.unexpected.extend(_join(name, i) for i in range(len(dest), len(saved)))
        self.plan.missing.extend(_join(name, i) for i in range(len(saved), len(dest)))

        def finish() -> Any:
            values = [thunk() for thunk in children]
            if isinstance(dest, list):
                dest[:len(values)] = values
                return dest
            return tuple(values)
        return finish


def _module_keys(module: torch.nn.Module, destination: Mapping, saved: Mapping) -> dict | None:
    """{key as saved: key of ``destination`` (``module.state_dict()``)}, or None where they are the same.

    A module's keys are matched as the plain module's (:mod:`alpha_ckpt.state.compiled`), except
    that a checkpoint holding the compiled keys (saved before compiled and plain modules
    were matched, or from the compiled module's ``state_dict()`` as a plain dict) restores into
    that compiled module as it was saved."""
    keys = plain_keys(module, destination.keys())
    if keys is None:
        return None
    if any(key not in keys for key in saved) and all(key in destination for key in saved):
        return None
    return keys


def _in_place(dest: Any, saved: Any) -> Any:
    """The saved value, written into the destination's own dict or list when both are one (a script keeps
    references to its containers: ``progress = {...}`` in the state must be the restored one)."""
    if type(dest) is type(saved) and isinstance(dest, (dict, list)):
        if isinstance(dest, dict):
            dest.clear()
            dest.update(saved)
        else:
            dest[:] = saved
        return dest
    return saved


def _mapping(kind: type, pairs: list) -> Any:
    """A mapping of type ``kind`` holding ``pairs`` (a Counter built from pairs would count them)."""
    try:
        return kind(dict(pairs))
    except TypeError:
        return dict(pairs)


def _empty_like_region(region: RegionDecl, kind: str) -> Any:
    tensor = torch.empty(region.shape, dtype=torch_dtype(region.dtype))
    return tensor.numpy() if kind == "ndarray" else tensor


def _kind(node: Any, regions: dict[str, RegionDecl]) -> str:
    if isinstance(node, RegionRef):
        region = regions[node.name]
        return f"a {'NumPy array' if node.kind == 'ndarray' else 'tensor'} {describe_region(region)}"
    if isinstance(node, torch.Tensor):
        return "a tensor"
    if isinstance(node, np.ndarray):
        return "a NumPy array" + ("" if node.flags.writeable else " (read-only)")
    if is_stateful(node):
        return f"a {type(node).__name__} (Stateful)"
    return f"a {type(node).__name__}"
