"""Hypothesis strategies for collective states as JSON recipes (see tests/state_recipes.py), one per class.

``CLASSES`` maps a class name to a strategy of recipes. Classes whose states
are valid by construction must publish and restore; the others (bad tilings,
colliding names, bad counters, a bare pattern string) may be refused, on
every rank, with the store untouched.
"""
from __future__ import annotations

import collections
import math

from hypothesis import strategies as st

from alpha_ckpt.format.records import DTYPES
from state_recipes import FLOATS, NUMPY, encode, region_names

DTYPE_NAMES = sorted(DTYPES)
seeds = st.integers(0, 2 ** 31 - 1)
worlds = st.sampled_from([1, 2, 3, 4])
# Small tensors: zero-size, one-row and 0-d ones come up often (the edges real jobs reach).
dims = st.sampled_from([0, 1, 2, 3, 5])
shapes = st.lists(dims, min_size=0, max_size=3)
# Names that do not collide (letters; int keys 0-3 are joined as digits, no letter string is one).
plain_keys = st.one_of(st.sampled_from(["a", "b", "w", "bias", "exp_avg", "step"]), st.integers(0, 3))
# Names that collide once joined with dots: "a" per rank on rank 1 is "a.1"; 0 and "0" are one name.
colliding_keys = st.sampled_from(["a", "b", "0", "1", "a.0", "a.1", "a.0.1", "b.1", 0, 1])


def _special(dtype: str) -> st.SearchStrategy[bool]:
    return st.booleans() if dtype in FLOATS else st.just(False)


@st.composite
def tensor_nodes(draw, dtype: str | None = None, shape=shapes) -> dict:
    dtype = dtype or draw(st.sampled_from(DTYPE_NAMES))
    node = {"t": "tensor", "dtype": dtype, "shape": draw(shape), "seed": draw(seeds), "special": draw(_special(dtype))}
    if dtype in NUMPY and draw(st.integers(0, 4)) == 0:
        node["np"] = True
    return node


@st.composite
def dtensor_nodes(draw, world: int) -> dict:
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    # rows and columns often fewer than the ranks: some ranks hold empty shards
    around = st.sampled_from(sorted({0, 1, max(world - 1, 1), world, world + 1, 2 * world + 1}))
    shape = draw(st.lists(around, min_size=1, max_size=3))
    mesh = [2, 2] if world == 4 and draw(st.booleans()) else [world]
    kinds = ["S0", "R"] + (["S1"] if len(shape) >= 2 else [])
    place = [draw(st.sampled_from(kinds)) for _ in mesh]
    restore = draw(st.sampled_from(kinds + ["plain"]))
    return {"t": "dtensor", "dtype": dtype, "shape": shape, "seed": draw(seeds), "special": draw(_special(dtype)),
            "mesh": mesh, "place": place, "restore": restore}


@st.composite
def tilings(draw, words: int, world: int) -> list[list[int]]:
    """Ranges [lo, hi) per rank that tile [0, words) exactly (empty shares too), in any rank order."""
    cuts = sorted(draw(st.lists(st.integers(0, words), min_size=world - 1, max_size=world - 1)))
    bounds = [0, *cuts, words]
    pieces = [[bounds[i], bounds[i + 1]] for i in range(world)]
    return draw(st.permutations(pieces))


@st.composite
def part_nodes(draw, world: int, bad: bool = False) -> dict:
    dtype = draw(st.sampled_from(DTYPE_NAMES))
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7]), min_size=1, max_size=2))
    words = math.prod(shape)
    node = {"t": "part", "dtype": dtype, "shape": shape, "seed": draw(seeds), "special": draw(_special(dtype)),
            "ranges": draw(tilings(words, world))}
    if not bad:
        return node
    ranges = node["ranges"]
    kinds = ["gap"] + (["overlap", "repeat", "shape", "conflict"] if world > 1 else [])
    kind = draw(st.sampled_from(kinds))
    r = draw(st.integers(0, world - 1))
    if kind == "gap":  # one rank holds less than its share: words nobody saved
        if words == 0:
            node["shape"] = shape = [max(1, words) + 1]
            node["ranges"] = ranges = [[0, 0] for _ in range(world)]
        else:
            r = max(range(world), key=lambda k: ranges[k][1] - ranges[k][0])
            lo, hi = ranges[r]
            ranges[r] = [lo + 1, hi] if draw(st.booleans()) else [lo, hi - 1]
    elif kind in ("overlap", "conflict"):  # one rank's range reaches into another's
        if words == 0:
            node["shape"] = shape = [2]
            words = 2
            node["ranges"] = ranges = [[0, 2]] + [[0, 0]] * (world - 1)
        s = max(range(world), key=lambda k: ranges[k][1] - ranges[k][0])  # holds a word: words > 0
        r = draw(st.integers(0, world - 1).filter(lambda k: k != s))
        lo, hi = ranges[r]
        at = ranges[s][0]  # r's range reaches word `at`, which s holds too
        ranges[r] = [min(lo, at), max(hi, at + 1)] if hi > lo else [at, at + 1]
        if kind == "conflict":  # and holds other words there
            node["seeds"] = [node["seed"] + (k == r) for k in range(world)]
    elif kind == "repeat":  # two ranks hold the same range
        s = draw(st.integers(0, world - 1).filter(lambda k: k != r))
        if ranges[s][1] == ranges[s][0]:
            node["shape"] = shape = [3]
            node["ranges"] = ranges = [[0, 3]] + [[0, 0]] * (world - 1)
            s, r = 0, draw(st.integers(1, world - 1))
        ranges[r] = list(ranges[s])
    else:  # shape: one rank declares another shape, of the same number of words or not
        other = draw(st.sampled_from([[words], [1, words], [words + 1], list(reversed(shape)) + [1]]))
        if other == shape:
            other = [words + 1]
        node["shapes"] = [other if k == r else list(shape) for k in range(world)]
        node["ranges"] = [[min(lo, math.prod(other)), min(hi, math.prod(other))] if k == r else [lo, hi]
                          for k, (lo, hi) in enumerate(ranges)]
    node["bad"] = kind
    return node


# ----------------------------------------------------------------------------- typed values

floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), floats, st.text(max_size=4),
                    st.binary(max_size=4))
finite_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                           st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=4))
dict_keys = st.one_of(st.text(max_size=3), st.integers(-3, 2 ** 64))


def _typed(children):
    pairs = st.lists(st.tuples(dict_keys, children), max_size=3, unique_by=lambda kv: (type(kv[0]), kv[0]))
    return st.one_of(
        st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
        pairs.map(lambda kv: dict(kv)), pairs.map(lambda kv: collections.OrderedDict(kv)),
        st.lists(st.tuples(dict_keys, st.integers(-5, 5)), max_size=3,
                 unique_by=lambda kv: (type(kv[0]), kv[0])).map(lambda kv: collections.Counter(dict(kv))))


values = st.recursive(scalars, _typed, max_leaves=8)
identities = st.recursive(finite_scalars, _typed, max_leaves=8)  # identity: tuples, int keys, nested


def value_nodes(strategy=values):
    return strategy.map(lambda v: {"t": "value", "v": encode(v)})


# ----------------------------------------------------------------------------- trees of nodes

def containers(leaves, keys=plain_keys, max_leaves: int = 6):
    """Dicts (str or int keys), lists and tuples holding ``leaves``."""
    def extend(children):
        items = st.lists(st.tuples(keys, children), min_size=1, max_size=3, unique_by=lambda kv: (type(kv[0]), kv[0]))
        return st.one_of(items.map(lambda kv: {"t": "dict", "items": [list(p) for p in kv]}),
                         st.lists(children, min_size=1, max_size=3).map(lambda xs: {"t": "list", "items": xs}),
                         st.lists(children, max_size=3).map(lambda xs: {"t": "tuple", "items": xs}))
    return st.recursive(leaves, extend, max_leaves=max_leaves)


def top(entries, keys=plain_keys, min_size: int = 1, max_size: int = 4):
    return st.lists(st.tuples(keys, entries), min_size=min_size, max_size=max_size,
                    unique_by=lambda kv: (type(kv[0]), kv[0])).map(lambda kv: {"t": "dict", "items": [list(p) for p in kv]})


def _allowed(state: dict, world: int) -> list[str]:
    """Exact allow_nonfinite names for every special float region (so a valid state stays valid)."""
    return sorted({name for rank in range(world) for name, _, node in region_names(state, rank)
                   if node.get("special") and node["dtype"] in FLOATS})


def _recipe(world: int, state: dict, *, update=1, cursor=0, identity=None, allow=None, publisher=None) -> dict:
    out = {"world": world, "update": encode(update), "cursor": encode(cursor), "identity": encode(identity),
           "allow_nonfinite": _allowed(state, world) if allow is None else allow, "state": state}
    if publisher is not None:
        out["publisher"], out["fanout"] = publisher
    return out


publishers = st.sampled_from([("star", 8), ("tree", 1), ("tree", 2)])


@st.composite
def every_dtype(draw) -> dict:
    """A tensor (or NumPy array) of every dtype we store: zero-size, one-row and 0-d shapes among them."""
    world = draw(worlds)
    entries = [[f"t_{dtype}", draw(tensor_nodes(dtype))] for dtype in DTYPE_NAMES]
    return _recipe(world, {"t": "dict", "items": draw(st.permutations(entries))}, update=draw(st.integers(0, 9)))


@st.composite
def dtensors(draw) -> dict:
    """DTensors Shard(0) / Shard(1) / Replicate on meshes of 1-4 ranks (2 x 2 too), fewer rows than ranks often;
    published by the star or the tree."""
    world = draw(worlds)
    state = draw(top(dtensor_nodes(world), min_size=2, max_size=5))
    return _recipe(world, state, publisher=draw(publishers))


@st.composite
def partitioned_good(draw) -> dict:
    """Partitioned entries whose ranges tile the region (empty shares too), beside replicated ones."""
    world = draw(worlds)
    state = draw(top(part_nodes(world), min_size=2, max_size=4))
    state["items"].append(["replicated", draw(tensor_nodes())])
    return _recipe(world, state, publisher=draw(publishers))


@st.composite
def partitioned_bad(draw) -> dict:
    """One Partitioned entry whose ranges overlap, leave a gap, repeat, disagree on shape, or conflict."""
    world = draw(worlds)
    state = draw(top(part_nodes(world) | tensor_nodes(), min_size=0, max_size=2))
    state["items"].append(["bad", draw(part_nodes(world, bad=True))])
    return _recipe(world, state, publisher=draw(publishers))


@st.composite
def per_rank(draw) -> dict:
    """PerRank entries whose parts differ per rank, under keys whose dotted names may collide across ranks."""
    world = draw(worlds)
    part = containers(tensor_nodes() | value_nodes(), keys=colliding_keys, max_leaves=3)
    perrank = st.lists(part, min_size=world, max_size=world).map(lambda ps: {"t": "perrank", "parts": ps})
    state = draw(top(perrank, keys=colliding_keys, max_size=2))
    others = draw(top(tensor_nodes() | containers(tensor_nodes(), keys=colliding_keys, max_leaves=2),
                      keys=colliding_keys, min_size=0, max_size=3))
    keys = {(type(k), k) for k, _ in state["items"]}
    state["items"] += [kv for kv in others["items"] if (type(kv[0]), kv[0]) not in keys]
    if world > 1 and draw(st.booleans()):  # names that collide only across ranks: rank 0's q.0.1 and rank 1's
        parts = [draw(containers(tensor_nodes(), max_leaves=2)) for _ in range(world)]
        parts[0] = {"t": "dict", "items": [["1", draw(tensor_nodes())]]}
        state["items"] = [kv for kv in state["items"] if kv[0] not in ("q", "q.0")]
        state["items"] += [["q", {"t": "perrank", "parts": parts}],
                           ["q.0", {"t": "perrank", "parts": [draw(tensor_nodes()) for _ in range(world)]}]]
    return _recipe(world, state)


@st.composite
def typed_values(draw) -> dict:
    """Tuples, int-keyed dicts, OrderedDict, Counter, floats by their bits, big ints, bytes, nested with tensors."""
    world = draw(worlds)
    return _recipe(world, draw(top(containers(value_nodes() | tensor_nodes(shape=st.just([2]))), max_size=3)))


@st.composite
def identities_(draw) -> dict:
    """A Checkpointer identity with tuples, int keys, nested containers; restored with the same identity."""
    world = draw(worlds)
    return _recipe(world, draw(top(tensor_nodes() | value_nodes(), max_size=2)), identity=draw(identities))


bad_counters = st.sampled_from([2.5, -1, True, "3", 2 ** 70, None, 2 ** 63])


@st.composite
def counters(draw) -> dict:
    """update and cursor, valid (up to 2**63 - 1) or not (floats, negatives, bools, strings, too large)."""
    world = draw(worlds)
    update = draw(st.integers(0, 2 ** 63 - 1) | bad_counters)
    cursor = draw(st.integers(0, 2 ** 63 - 1) | bad_counters.map(lambda v: -5 if v == -1 else v))
    return _recipe(world, draw(top(tensor_nodes(), max_size=2)), update=update, cursor=cursor)


@st.composite
def nonfinite(draw) -> dict:
    """NaN/inf words (always in model.w) allowed by exact names, by one pattern string, by a list, or not at all."""
    world = draw(worlds)
    dtype = draw(st.sampled_from(sorted(FLOATS)))
    model = draw(top(tensor_nodes(dtype=dtype), keys=st.sampled_from(["mask", "causal_mask", "b"]), min_size=0,
                     max_size=2))
    model["items"].append(["w", {**draw(tensor_nodes(dtype=dtype, shape=st.just([3]))), "special": True}])
    state = {"t": "dict", "items": [["model", model]]}
    names = _allowed(state, world)
    allow = draw(st.sampled_from([names, [], "*mask", ["*mask"], "model.w", ["model.w"]]))
    return _recipe(world, state, allow=allow)


@st.composite
def mixed(draw) -> dict:
    """All of the above in one state."""
    world = draw(worlds)
    diverged = st.tuples(tensor_nodes(), st.lists(seeds, min_size=world, max_size=world)).map(
        lambda ts: {**ts[0], "seeds": ts[1]})  # a replica that differs per rank (equal seeds: it does not)
    entry = st.one_of(tensor_nodes(), diverged, dtensor_nodes(world), part_nodes(world), part_nodes(world, bad=True),
                      value_nodes(), st.lists(containers(tensor_nodes() | value_nodes(), keys=colliding_keys,
                                                         max_leaves=2), min_size=world, max_size=world)
                      .map(lambda ps: {"t": "perrank", "parts": ps}))
    state = draw(top(entry, keys=colliding_keys | plain_keys, max_size=5))
    return _recipe(world, state, update=draw(st.integers(0, 2 ** 63 - 1) | bad_counters),
                   identity=draw(st.none() | identities), publisher=draw(publishers))


CLASSES = {
    "every dtype": every_dtype(),
    "DTensor Shard(0)/Shard(1)/Replicate": dtensors(),
    "Partitioned tilings": partitioned_good(),
    "Partitioned bad tilings": partitioned_bad(),
    "PerRank colliding names": per_rank(),
    "typed values": typed_values(),
    "identity": identities_(),
    "counters": counters(),
    "allow_nonfinite": nonfinite(),
    "mixed": mixed(),
}
