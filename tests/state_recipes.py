"""States as JSON recipes, built alike in every rank, and the check that a save which returns can be restored.

A recipe is plain JSON (no pickle crosses to a rank): every tensor in it is a
dtype, a shape and a seed, built deterministically inside each rank. The
property (:func:`check_recipe`):

- ``Checkpointer.save`` either raises on EVERY rank (a ``Refusal`` with its
  code; for counters and argument errors a ``ValueError``/``TypeError``) and
  leaves the store byte-identical (every path, kind and byte under it), or
  returns the same root on every rank;
- that root verifies (``alpha-ckpt verify``, the console entry point in this
  process) and restores bit for bit (tensors by their bytes, values equal with
  their types) on every rank count its placement allows: 1 to 4 ranks, except
  that ``PerRank`` entries bind the count they were saved on, where every
  other count is refused on every rank with ``placement-bound``.

Recipe format::

    {"world": W, "update": U, "cursor": C, "identity": VALUE, "allow_nonfinite": [patterns] | "pattern",
     "state": NODE, "publisher": "star" | "tree", "fanout": F}

NODE is one of ``{"t": "dict", "items": [[key, NODE], ...]}``, ``{"t": "list" |
"tuple", "items": [NODE, ...]}``, ``{"t": "value", "v": VALUE}``, ``{"t":
"tensor", ...TENSOR, "np": bool}`` (replicated), ``{"t": "dtensor", ...TENSOR,
"mesh": [n] | [a, b], "place": ["S0" | "S1" | "R", ...], "restore": "S0" | "S1"
| "R" | "plain"}``, ``{"t": "part", ...TENSOR, "ranges": [[lo, hi] per rank],
"shapes": [shape per rank], "seeds": [seed per rank]}`` (``Partitioned``;
``shape``/``seed`` are rank 0's) or ``{"t": "perrank", "parts": [NODE per
rank]}``. TENSOR is ``"dtype", "shape", "seed", "special"`` (special: any bit
pattern, NaN payloads, infinities and -0.0 included). VALUE is JSON with tags
for what JSON lacks: ``{"float": hex bits}``, ``{"bytes": hex}``, ``{"list":
[...]}``, ``{"tuple": [...]}``, ``{"dict" | "odict" | "counter": [[k, v], ...]}``
(an encoding of its own, so the product's codec is not its own oracle).
"""
from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

RUN = "gate"
COUNTS = (1, 2, 3, 4)
FLOATS = {"float64", "float32", "float16", "bfloat16"}
NUMPY = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32",
         "uint64", "bool"}


# ----------------------------------------------------------------------------- values

def encode(v: Any) -> Any:
    """The recipe VALUE of a Python value (the inverse of :func:`decode`)."""
    if v is None or type(v) in (bool, int, str):
        return v
    if type(v) is float:
        return {"float": struct.pack(">d", v).hex()}
    if type(v) is bytes:
        return {"bytes": v.hex()}
    if type(v) in (list, tuple):
        return {type(v).__name__: [encode(x) for x in v]}
    tag = {dict: "dict", collections.OrderedDict: "odict", collections.Counter: "counter"}[type(v)]
    return {tag: [[encode(k), encode(x)] for k, x in v.items()]}


def decode(v: Any) -> Any:
    """The Python value of a recipe VALUE."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    (tag, body), = v.items()
    if tag == "float":
        return struct.unpack(">d", bytes.fromhex(body))[0]
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag == "list":
        return [decode(x) for x in body]
    if tag == "tuple":
        return tuple(decode(x) for x in body)
    kind = {"dict": dict, "odict": collections.OrderedDict, "counter": collections.Counter}[tag]
    out = kind()
    for key, value in body:
        out[decode(key)] = decode(value)
    return out


def typed_differ(got: Any, want: Any, where: str = "value") -> str | None:
    """None when ``got`` is ``want`` with the same types throughout (floats by their bits, dicts in order)."""
    if type(got) is not type(want):
        return f"{where}: {type(got).__name__} {_short(got)}, saved {type(want).__name__} {_short(want)}"
    if isinstance(want, float):
        return None if struct.pack(">d", got) == struct.pack(">d", want) else f"{where}: {got!r} != {want!r}"
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{where}: {len(got)} items, saved {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            if (d := typed_differ(g, w, f"{where}.{i}")) is not None:
                return d
        return None
    if isinstance(want, dict):
        if [(type(k), k) for k in got] != [(type(k), k) for k in want]:
            return f"{where}: keys {_short(list(got))}, saved {_short(list(want))}"
        for k in want:
            if (d := typed_differ(got[k], want[k], f"{where}.{k}")) is not None:
                return d
        return None
    return None if got == want else f"{where}: {_short(got)} != {_short(want)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------- tensors

def build_tensor(dtype: str, shape: Any, seed: int, special: bool = False) -> torch.Tensor:
    """The tensor a recipe names: the same bytes in every process."""
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    tdtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(int(seed))
    if dtype == "bool":
        flat = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    elif dtype in FLOATS and not special:
        flat = (torch.randn(n, generator=g, dtype=torch.float64) * 8).to(tdtype)
    else:  # integers over their whole range; special floats: any bit pattern
        size = torch.empty(0, dtype=tdtype).element_size()
        flat = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(tdtype)
        if special and n:
            marks = [math.nan, -math.inf, -0.0, math.inf][:n]
            flat[:len(marks)] = torch.tensor(marks, dtype=torch.float64).to(tdtype)
    return flat.reshape(shape)


def same_bits(a: Any, b: torch.Tensor) -> bool:
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(a)
    if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:  # NumPy's empty arrays have zero strides, which view() refuses
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _describe(t: Any) -> str:
    if isinstance(t, (torch.Tensor, np.ndarray)):
        return f"{type(t).__name__} {t.dtype}{list(t.shape)}"
    return type(t).__name__


def _placements(names: list[str], ndim: int):
    from torch.distributed.tensor import Replicate, Shard
    return [Replicate() if p == "R" or int(p[1]) >= ndim else Shard(int(p[1])) for p in names]


def _local_box(shape, mesh, placements) -> tuple[slice, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    lengths, offsets = compute_local_shape_and_global_offset(tuple(shape), mesh, placements)
    return tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offsets, lengths))


class _Meshes:
    """One device mesh per shape within a run of ranks (built collectively, in recipe order on every rank)."""

    def __init__(self):
        self.made: dict[tuple, Any] = {}

    def get(self, shape: tuple) -> Any:
        from torch.distributed.device_mesh import init_device_mesh
        if shape not in self.made:
            self.made[shape] = init_device_mesh("cpu", shape)
        return self.made[shape]


def _dtensor(full: torch.Tensor, mesh, placements) -> Any:
    from torch.distributed.tensor import DTensor
    local = full[_local_box(full.shape, mesh, placements)].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


# ----------------------------------------------------------------------------- building states

def build_state(recipe: dict, rank: int, world: int, meshes: _Meshes | None = None) -> dict:
    """What rank ``rank`` of ``world`` saves."""
    return _build(recipe["state"], rank, world, meshes or _Meshes(), False)


def _build(node: dict, rank: int, world: int, meshes: _Meshes, garbage: bool) -> Any:
    from alpha_ckpt import Partitioned, PerRank
    t = node["t"]
    if t == "dict":
        return {key: _build(child, rank, world, meshes, garbage) for key, child in node["items"]}
    if t in ("list", "tuple"):
        items = [_build(child, rank, world, meshes, garbage) for child in node["items"]]
        return items if t == "list" else tuple(items)
    if t == "value":
        return "unset" if garbage else decode(node["v"])
    if t == "perrank":
        return PerRank(_build(node["parts"][rank], rank, world, meshes, garbage))
    seed = node["seed"] ^ (0x5EED if garbage else 0)
    if t == "tensor":  # "seeds": a replica that differs per rank (a diverged DDP rank)
        seed = node["seeds"][rank] ^ (0x5EED if garbage else 0) if node.get("seeds") else seed
        tensor = build_tensor(node["dtype"], node["shape"], seed, node.get("special", False))
        return tensor.numpy() if node.get("np") else tensor
    if t == "dtensor":
        full = build_tensor(node["dtype"], node["shape"], seed, node.get("special", False))
        mesh = meshes.get(tuple(node["mesh"]))
        return _dtensor(full, mesh, _placements(node["place"], full.dim()))
    if t == "part":
        shape = node["shapes"][rank] if node.get("shapes") else node["shape"]
        full = build_tensor(node["dtype"], shape, node["seeds"][rank] if node.get("seeds") else node["seed"],
                            node.get("special", False))
        lo, hi = node["ranges"][rank]
        return Partitioned(full.reshape(-1)[lo:hi].clone(), lo, hi, tuple(shape))
    raise ValueError(f"unknown recipe node {t!r}")


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def region_names(node: dict, rank: int, prefix: str = "") -> list[tuple[str, bool, dict]]:
    """(dotted name, per rank?, node) of every region rank ``rank`` captures, as capture names them."""
    t = node["t"]
    if t == "dict":
        return [x for key, child in node["items"] for x in region_names(child, rank, _join(prefix, key))]
    if t in ("list", "tuple"):
        return [x for i, child in enumerate(node["items"]) for x in region_names(child, rank, _join(prefix, i))]
    if t == "value":
        return []
    if t == "perrank":
        return [(name, True, n) for name, _, n in region_names(node["parts"][rank], rank, _join(prefix, rank))]
    return [(prefix, False, node)]


def good_tiling(node: dict, world: int) -> bool:
    """A Partitioned entry whose ranks agree on its shape and whose ranges tile it exactly."""
    shapes = node.get("shapes") or [node["shape"]] * world
    if any(list(s) != list(node["shape"]) for s in shapes):
        return False
    at = 0
    for lo, hi in sorted((lo, hi) for lo, hi in node["ranges"] if hi > lo):
        if lo != at:
            return False
        at = hi
    return at == math.prod(node["shape"]) and len(node["ranges"]) == world


def may_refuse(recipe: dict) -> str | None:
    """Why a save of ``recipe`` may be refused, or None: a valid state, which every save must publish."""
    from fnmatch import fnmatchcase
    world = recipe["world"]
    for key in ("update", "cursor"):
        value = decode(recipe[key])
        if type(value) is not int or not 0 <= value < 2 ** 63:
            return f"{key}={value!r}"
    patterns = recipe.get("allow_nonfinite", [])
    if not isinstance(patterns, list):
        return "allow_nonfinite is one string"
    merged: list[str] = []
    for rank in range(world):
        names = region_names(recipe["state"], rank)
        local = [name for name, _, _ in names]
        if len(set(local)) != len(local):
            return f"dotted names collide on rank {rank}"
        merged += [name for name, per_rank, _ in names if per_rank or rank == 0]
        for name, _, node in names:
            if node["t"] == "tensor" and diverged(node):
                return f"{name}: a replica that differs across ranks"
            if node["t"] == "part" and not good_tiling(node, world):
                return f"{name}: Partitioned ranges that do not tile it"
            if node.get("special") and node["dtype"] in FLOATS and math.prod(node["shape"]) \
                    and not any(fnmatchcase(name, p) for p in patterns):
                return f"{name}: non-finite words no pattern allows"
    if len(set(merged)) != len(merged):
        return "dotted names collide across ranks"
    return None


def unallowed_nonfinite(recipe: dict) -> list[str]:
    """Regions holding NaN/inf that no allow_nonfinite pattern names (a bare string is one pattern)."""
    from fnmatch import fnmatchcase
    patterns = recipe.get("allow_nonfinite", [])
    patterns = [patterns] if isinstance(patterns, str) else patterns
    return sorted({name for rank in range(recipe["world"]) for name, _, node in region_names(recipe["state"], rank)
                   if node.get("special") and node["dtype"] in FLOATS and math.prod(node["shape"])
                   and not any(fnmatchcase(name, p) for p in patterns)})


def diverged(node: dict) -> bool:
    """A replicated tensor whose ranks hold other bits (each builds it from its own seed)."""
    seeds = node.get("seeds") or []
    built = [build_tensor(node["dtype"], node["shape"], seed, node.get("special", False)) for seed in seeds]
    return any(not same_bits(t, built[0]) for t in built[1:])


def part_expected(node: dict, world: int) -> torch.Tensor | None:
    """The region a Partitioned entry saved on ``world`` ranks holds: each word from the rank that holds it
    (ranks build their words from their own seeds); None when two ranks hold one word with other bits,
    or the ranks disagree on the shape: no restore can be bit for bit then."""
    shape = node["shape"]
    shapes = node.get("shapes") or [shape] * world
    seeds = node.get("seeds") or [node["seed"]] * world
    if any(list(s) != list(shape) for s in shapes):
        return None
    flat = build_tensor(node["dtype"], shape, seeds[0], node.get("special", False)).reshape(-1).clone()
    held = torch.zeros(flat.numel(), dtype=torch.bool)
    for rank, (lo, hi) in enumerate(node["ranges"][:world]):
        mine = build_tensor(node["dtype"], shape, seeds[rank], node.get("special", False)).reshape(-1)[lo:hi]
        if hi > lo and held[lo:hi].any() and not same_bits(flat[lo:hi][held[lo:hi]], mine[held[lo:hi]]):
            return None
        flat[lo:hi] = mine
        held[lo:hi] = True
    return flat.reshape(shape)


def per_rank_bound(node: dict) -> bool:
    """Whether the state holds a PerRank entry (it binds the rank count)."""
    if node["t"] == "perrank":
        return True
    if node["t"] in ("dict",):
        return any(per_rank_bound(child) for _, child in node["items"])
    if node["t"] in ("list", "tuple"):
        return any(per_rank_bound(child) for child in node["items"])
    return False


def restore_counts(recipe: dict) -> dict[int, str | None]:
    """Every rank count 1-4 and what a restore there must do: None (restore bit for bit) or the refusal code."""
    bound = per_rank_bound(recipe["state"])
    return {n: ("placement-bound" if bound and n != recipe["world"] else None) for n in COUNTS}


class _Destination:
    """A destination state for ``rank`` of ``world`` (garbage where tensors are, "unset" where values are),
    and the check of what a restore left in it."""

    def __init__(self, recipe: dict, rank: int, world: int):
        self.rank, self.world, self.meshes = rank, world, _Meshes()
        self.state = self.dest(recipe["state"])
        self.recipe = recipe

    def dest(self, node: dict) -> Any:
        from alpha_ckpt import Partitioned, PerRank
        from alpha_ckpt.generation.planner import shares
        t = node["t"]
        if t == "dict":
            return {key: self.dest(child) for key, child in node["items"]}
        if t in ("list", "tuple"):
            items = [self.dest(child) for child in node["items"]]
            return items if t == "list" else tuple(items)
        if t == "value":
            return "unset"
        if t == "perrank":
            return PerRank(_build(node["parts"][self.rank], self.rank, self.world, self.meshes, True)
                           if self.rank < len(node["parts"]) else None)
        garbage = build_tensor(node["dtype"], node["shape"], node["seed"] ^ 0x5EED)
        if t == "tensor":
            return garbage.numpy() if node.get("np") else garbage
        if t == "dtensor":
            if node["restore"] == "plain":
                return garbage
            mesh = self.meshes.get((self.world,))
            return _dtensor(garbage, mesh, _placements([node["restore"]], garbage.dim()))
        if t == "part":
            lo, hi = shares(garbage.numel(), self.world)[self.rank]
            return Partitioned(garbage.reshape(-1)[lo:hi].clone(), lo, hi, tuple(node["shape"]))
        raise ValueError(f"unknown recipe node {t!r}")

    def differ(self) -> list[str]:
        out: list[str] = []
        self.check(self.state, self.recipe["state"], "state", out)
        return out

    def check(self, got: Any, node: dict, where: str, out: list[str]) -> None:
        from alpha_ckpt import Partitioned, PerRank
        from torch.distributed.tensor import DTensor
        t = node["t"]
        if t == "value":
            if (d := typed_differ(got, decode(node["v"]), where)) is not None:
                out.append(d)
            return
        if t in ("dict", "list", "tuple"):
            kind = {"dict": dict, "list": list, "tuple": tuple}[t]
            if type(got) is not kind:
                out.append(f"{where}: a {type(got).__name__}, saved a {t}")
                return
            pairs = node["items"] if t == "dict" else list(enumerate(node["items"]))
            if len(got) != len(pairs):
                out.append(f"{where}: {len(got)} entries, saved {len(pairs)}")
                return
            for key, child in pairs:
                self.check(got[key], child, f"{where}.{key}", out)
            return
        if t == "perrank":
            if not isinstance(got, PerRank):
                out.append(f"{where}: a {type(got).__name__}, saved PerRank")
            else:
                self.check(got.value, node["parts"][self.rank], f"{where}.{self.rank}", out)
            return
        full = build_tensor(node["dtype"], node["shape"], node["seed"], node.get("special", False))
        if t == "tensor" and node.get("seeds"):
            if diverged(node):
                out.append(f"{where}: published, though its replicas differ across ranks")
                return
            full = build_tensor(node["dtype"], node["shape"], node["seeds"][0], node.get("special", False))
        if t == "part":
            full = part_expected(node, self.recipe["world"])
            if full is None:
                out.append(f"{where}: published, though its ranks hold other words at one place or disagree on "
                           "its shape")
                return
        if t == "tensor":
            ok = same_bits(got, full) and isinstance(got, np.ndarray) == bool(node.get("np"))
        elif t == "dtensor" and node["restore"] == "plain":
            ok = same_bits(got, full)
        elif t == "dtensor":
            if not isinstance(got, DTensor):
                ok = False
            else:
                ok = same_bits(got.to_local(), full[_local_box(full.shape, got.device_mesh, got.placements)])
        else:  # Partitioned: this rank's words of the region
            ok = isinstance(got, Partitioned) and same_bits(got.tensor, full.reshape(-1)[got.lo:got.hi])
            got = got.tensor if isinstance(got, Partitioned) else got
            if isinstance(got, DTensor):
                got = got.to_local()
        if not ok:
            out.append(f"{where}: restored {_describe(got)} differs from the saved {node['dtype']}{node['shape']}")


# ----------------------------------------------------------------------------- rank tasks (run_ranks)

def _checkpointer(recipe: dict, store: str):
    from alpha_ckpt import Checkpointer
    return Checkpointer(store, run=RUN, identity=decode(recipe.get("identity")),
                        allow_nonfinite=recipe.get("allow_nonfinite", []), publisher=recipe.get("publisher", "star"),
                        fanout=recipe.get("fanout", 8))


def save_task(rank: int, world: int, recipe_text: str, store: str) -> dict:
    """One rank's save: {"root"} or {"refusal", "message"} or {"usage", "message"}; rank 0 adds the store's
    hash before and after."""
    import torch.distributed as dist
    from alpha_ckpt import Refusal
    recipe = json.loads(recipe_text)
    state = build_state(recipe, rank, world)
    try:
        ckpt = _checkpointer(recipe, store)
    except (ValueError, TypeError) as exc:  # an argument error: nothing was written
        return {"usage": f"{type(exc).__name__}: {exc}", "at": "Checkpointer()"}
    dist.barrier()
    before = store_snapshot(store) if rank == 0 else None
    dist.barrier()
    try:
        out = {"root": ckpt.save(state, update=decode(recipe["update"]), cursor=decode(recipe["cursor"])).root}
    except Refusal as refusal:
        out = {"refusal": refusal.code.value, "message": refusal.message}
    except (ValueError, TypeError) as exc:
        out = {"usage": f"{type(exc).__name__}: {exc}", "at": "save()"}
    ckpt.close()
    dist.barrier()
    if rank == 0:
        out.update(before=before, after=store_snapshot(store))
    return out


def restore_task(rank: int, world: int, recipe_text: str, store: str, root: str) -> dict:
    """One rank's restore of ``root`` into a fresh destination: {"differ": [...], "update", "cursor"} or
    {"refusal", "message"}."""
    from alpha_ckpt import Refusal
    recipe = json.loads(recipe_text)
    dest = _Destination(recipe, rank, world)
    ckpt = _checkpointer(recipe, store)
    try:
        counters = ckpt.restore(dest.state, root=root)
    except Refusal as refusal:
        return {"refusal": refusal.code.value, "message": refusal.message}
    finally:
        ckpt.close()
    if counters is None:
        return {"differ": ["restore returned None (nothing restored)"]}
    return {"differ": dest.differ()[:5], "update": counters.update, "cursor": counters.cursor}


def store_snapshot(store: str | os.PathLike) -> dict[str, str]:
    """Every path under the store with its kind and bytes (a file's SHA-256, a link's target): nothing excluded."""
    root = Path(store)
    out: dict[str, str] = {}
    for d, dirs, files in os.walk(root):
        dirs.sort()
        rel = os.path.relpath(d, root)
        out[rel] = "dir"
        for name in sorted(files + [x for x in dirs if os.path.islink(os.path.join(d, x))]):
            p = os.path.join(d, name)
            key = os.path.normpath(os.path.join(rel, name))
            if os.path.islink(p):
                out[key] = "link " + os.readlink(p)
            elif os.path.isfile(p):
                out[key] = "file " + hashlib.sha256(Path(p).read_bytes()).hexdigest()
            else:
                out[key] = "other"
    return out


# Refused after the ranks wrote their shards: a replica's digest is compared once every rank has hashed
# it, beside its writes. Those objects stay, named by no ref, until gc collects them: a refused save
# cannot delete them safely (a deduplicated object may be another save's too). Every other path,
# and every object that was there before, must be unchanged; every other refusal leaves the whole
# store as it was.
REFUSED_AFTER_WRITES = {"mixed-capture"}


def store_changes(before: dict[str, str], after: dict[str, str], code: str) -> list[str]:
    """What a refused save changed in the store that it may not have (see REFUSED_AFTER_WRITES)."""
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    if code in REFUSED_AFTER_WRITES:
        changed = [p for p in changed if not (p not in before and p.split(os.sep)[0] == "objects")]
    return [f"{p} ({'added' if p not in before else 'removed' if p not in after else 'changed'})" for p in changed]


# ----------------------------------------------------------------------------- the property

def check_recipe(recipe: dict, tmp: Path, *, timeout: float = 90.0, pg_timeout: float = 30.0) -> dict:
    """Save ``recipe`` on its world, then verify and restore on every count; the outcome.

    ``{"ok": bool, "published": bool, "refused": code | None, "failure": text | None, "counts": {...}}``.
    """
    from ranks import run_ranks
    from cli_in_process import alpha_ckpt_cli
    text = json.dumps(recipe)
    world = recipe["world"]
    store = tmp / f"store-{hashlib.sha256(text.encode()).hexdigest()[:12]}-{os.urandom(3).hex()}"
    outcome: dict = {"ok": False, "published": False, "refused": None, "failure": None, "counts": {}}
    try:
        saved = run_ranks(world, save_task, text, str(store), tmp=tmp, timeout=timeout, pg_timeout=pg_timeout)
    except Exception as exc:  # a rank crashed or hung (AssertionError), or died without a word
        outcome["failure"] = f"save on {world} ranks: {_first_line(exc)}"
        return outcome
    roots = {r.get("root") for r in saved}
    if all("root" in r for r in saved):
        if len(roots) != 1:
            outcome["failure"] = f"save returned different roots on the ranks: {sorted(roots)}"
            return outcome
    elif any("root" in r for r in saved):
        outcome["failure"] = "save returned on some ranks and raised on others: " + _ranks_said(saved)
        return outcome
    else:  # refused: on every rank, and nothing in the store changed
        reason = may_refuse(recipe)
        codes = {r.get("refusal") or "usage" for r in saved}
        outcome["refused"] = "/".join(sorted(codes))
        outcome["message"] = saved[0].get("message") or saved[0].get("usage")
        if len(codes) != 1:
            outcome["failure"] = "the ranks refused differently: " + _ranks_said(saved)
        elif "before" in saved[0] and (changes := store_changes(saved[0]["before"], saved[0]["after"],
                                                                outcome["refused"])):
            outcome["failure"] = f"a refused save ({outcome['refused']}) changed the store: {', '.join(changes[:4])}"
        elif "before" not in saved[0] and Path(store).exists():
            outcome["failure"] = f"Checkpointer() raised ({outcome['refused']}) after creating the store"
        elif reason is None:
            outcome["failure"] = f"a valid state was refused: {_ranks_said(saved[:1])}"
        else:
            outcome["ok"] = True
        return outcome
    root = roots.pop()
    outcome["published"] = True
    if unallowed := unallowed_nonfinite(recipe):
        outcome["failure"] = f"published NaN/inf in {unallowed[:3]}, which no allow_nonfinite pattern names"
        return outcome
    verified = alpha_ckpt_cli("verify", "--store", str(store), root, "--json")
    if verified.returncode != 0:
        outcome["failure"] = f"published {root[:12]}, but verify exits {verified.returncode}: " \
                             f"{(verified.stdout or verified.stderr).strip()[:300]}"
        return outcome
    for count, must_refuse in restore_counts(recipe).items():
        try:
            got = run_ranks(count, restore_task, text, str(store), root, tmp=tmp, timeout=timeout,
                            pg_timeout=pg_timeout)
        except Exception as exc:
            outcome["failure"] = f"published, restore on {count} ranks: {_first_line(exc)}"
            return outcome
        if must_refuse:
            if any(r.get("refusal") != must_refuse for r in got):
                outcome["failure"] = f"published on {world} ranks; restore on {count} ranks must refuse " \
                                     f"{must_refuse} on every rank: " + _ranks_said(got)
                return outcome
            outcome["counts"][count] = must_refuse
            continue
        bad = [(r, g) for r, g in enumerate(got) if g.get("refusal") or g.get("differ")
               or (g.get("update"), g.get("cursor")) != (decode(recipe["update"]), decode(recipe["cursor"]))]
        if bad:
            outcome["failure"] = f"published on {world} ranks, restore on {count} ranks: " + _ranks_said(got)
            return outcome
        outcome["counts"][count] = "restored"
    outcome["ok"] = True
    return outcome


def _ranks_said(results: list[dict]) -> str:
    parts = []
    for r, res in enumerate(results):
        if "root" in res:
            parts.append(f"rank {r} root {res['root'][:12]}")
        elif res.get("refusal"):
            parts.append(f"rank {r} refused {res['refusal']}: {res.get('message', '')[:160]}")
        elif res.get("usage"):
            parts.append(f"rank {r} {res['usage'][:160]}")
        elif res.get("differ"):
            parts.append(f"rank {r} differs: {'; '.join(res['differ'])[:240]}")
        else:
            parts.append(f"rank {r} restored update {res.get('update')} cursor {res.get('cursor')}")
    return " | ".join(parts)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [l for l in text.splitlines() if l.strip()]
    tail = [l for l in lines if "Error" in l or "Refusal" in l]
    return (tail[-1] if tail else lines[-1] if lines else repr(exc))[:300]
