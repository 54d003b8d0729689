"""Destinations that share memory are refused before a restore writes; only tied weights (one view, two names) pass."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import alpha_ckpt
from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.generation.destinations import Layout, check_destinations, check_tied_saved_alike, destination_layouts

BASE = torch.arange(30, dtype=torch.float32)
BYTES = torch.frombuffer(bytearray(64), dtype=torch.uint8)


def _verdict(**named):
    """'ok' with the tied groups (by name), or the names the refusal mentions."""
    names = list(named)
    try:
        groups = check_destinations(destination_layouts(list(named.items())))
    except Refusal as refusal:
        assert refusal.code == RefusalCode.COVERAGE
        return "refused", sorted(n for n in names if repr(n) in refusal.message)
    return "ok", [[names[i] for i in g] for g in groups]


CASES = {
    "overlapping slices": (dict(a=BASE[:6], b=BASE[4:]), ("refused", ["a", "b"])),
    "adjacent slices": (dict(a=BASE[:4], b=BASE[4:]), ("ok", [])),
    "interleaved, disjoint": (dict(a=BASE[::2], b=BASE[1::2]), ("ok", [])),
    "column blocks, disjoint": (dict(a=BASE.view(6, 5)[:, :2], b=BASE.view(6, 5)[:, 2:]), ("ok", [])),
    "column blocks, one shared column": (dict(a=BASE.view(6, 5)[:, :3], b=BASE.view(6, 5)[:, 2:]),
                                         ("refused", ["a", "b"])),
    "a view and its transpose": (dict(a=BASE[:25].view(5, 5), b=BASE[:25].view(5, 5).t()), ("refused", ["a", "b"])),
    "overlapping strides": (dict(x=torch.as_strided(BASE, (3, 3), (1, 1))), ("refused", ["x"])),
    "expanded": (dict(x=torch.zeros(1).expand(5)), ("refused", ["x"])),
    "distinct addresses, unsorted strides": (dict(x=torch.as_strided(BASE, (3, 2), (2, 3))), ("ok", [])),
    "bytes before a float view": (dict(u8=BASE.view(torch.uint8)[:4], f=BASE[1:]), ("ok", [])),
    "bytes reaching into a float view": (dict(u8=BASE.view(torch.uint8)[:5], f=BASE[1:]), ("refused", ["f", "u8"])),
    "two storages over one buffer": (dict(a=torch.frombuffer(BYTES.numpy(), dtype=torch.uint8, count=10),
                                          b=torch.frombuffer(BYTES.numpy(), dtype=torch.uint8, offset=8)),
                                     ("refused", ["a", "b"])),
    "tied weights": (dict(wte=BASE, lm_head=BASE.detach()), ("ok", [["wte", "lm_head"]])),
    "tied and a third sharing": (dict(wte=BASE, lm_head=BASE, c=BASE[3:5]), ("refused", ["c", "lm_head", "wte"])),
    "empty views take part in nothing": (dict(a=BASE[:0], b=BASE[:0], c=BASE), ("ok", [])),
    "meta tensor": (dict(a=torch.empty(3, device="meta"), b=torch.zeros(2)), ("refused", ["a"])),
    "sparse tensor": (dict(a=torch.eye(3).to_sparse()), ("refused", ["a"])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_destination_overlap_is_decided_exactly(case):
    named, expected = CASES[case]
    verdict = _verdict(**named)
    if expected[0] == "refused":
        assert verdict[0] == "refused" and set(verdict[1]) >= set(expected[1][:1]), verdict
        assert set(verdict[1]) <= set(expected[1])
    else:
        assert verdict == expected


def test_disjoint_spans_cost_only_an_interval_check():
    # Spans of 4 TiB each, 16 TiB apart: any mask over them could not be allocated.
    far = [Layout(f"t{i}", "cpu", i << 44, 4, (1 << 40,), (1,), "torch.float32") for i in range(1000)]
    assert check_destinations(far) == []


# ---------------------------------------------------------------- property: against every byte address

@st.composite
def layouts(draw):
    count = draw(st.integers(1, 4))
    out = []
    for i in range(count):
        itemsize = draw(st.sampled_from([1, 2, 4, 8]))
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(0, 4)) for _ in range(ndim))
        stride = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
        address = 1000 + draw(st.integers(0, 48))
        memory = draw(st.sampled_from(["cpu", "cpu", "cpu", "cuda:0"]))
        out.append(Layout(f"t{i}", memory, address, itemsize, shape, stride, f"i{itemsize}"))
    if draw(st.booleans()):  # a tied pair: the very same view under another name
        out.append(Layout(f"t{count}", *[getattr(out[0], f) for f in ("memory", "address", "itemsize", "shape",
                                                                         "stride", "dtype")]))
    return out


def _bytes_of(layout):
    """Every (memory, byte address) of every element, with repeats."""
    return [(layout.memory, layout.address + sum(i * s for i, s in zip(index, layout.stride)) * layout.itemsize + b)
            for index in itertools.product(*(range(n) for n in layout.shape)) for b in range(layout.itemsize)]


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_overlap_verdicts_match_brute_force_over_byte_addresses(ls):
    spans = [_bytes_of(l) for l in ls]
    overlaps_itself = any(len(set(b)) < len(b) for b in spans)
    shared = any(set(spans[i]) & set(spans[j]) and ls[i].view != ls[j].view
                 for i, j in itertools.combinations(range(len(ls)), 2))
    if overlaps_itself or shared:
        with pytest.raises(Refusal) as info:
            check_destinations(ls)
        assert info.value.code == RefusalCode.COVERAGE
    else:
        groups = check_destinations(ls)
        expected = {}
        for i, l in enumerate(ls):
            if l.numel:
                expected.setdefault(l.view, []).append(i)
        assert sorted(groups) == sorted(g for g in expected.values() if len(g) > 1)


def test_tied_destinations_pass_only_when_the_checkpoint_holds_the_same_words_the_same_way():
    names = ["wte", "lm_head"]
    same = {0: [(0, 400, "a" * 64)], 1: [(0, 400, "a" * 64)]}
    check_tied_saved_alike([[0, 1]], names, same)
    for saved in ({0: [(0, 400, "a" * 64)], 1: [(0, 400, "b" * 64)]},                       # other words
                  {0: [(0, 400, "a" * 64)], 1: [(0, 97, "c" * 64), (97, 400, "d" * 64)]}):  # split otherwise
        with pytest.raises(Refusal) as info:
            check_tied_saved_alike([[0, 1]], names, saved)
        assert info.value.code == RefusalCode.COVERAGE and "'wte'" in info.value.message


# ---------------------------------------------------------------- through alpha_ckpt.restore

KW = dict(run="r", step="s", update=1, cursor=0, epoch=0)


def _leaves(node, prefix=""):
    # the destination's tensors as they are (capture would refuse a meta tensor before the restore can)
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def _refused_untouched(store_dir, root, destination, *names):
    writable = [(k, v) for k, v in _leaves(destination) if v.device.type != "meta"]
    before = [v.clone() for _, v in writable]
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore(destination, store=store_dir, root=root)
    assert info.value.code == RefusalCode.COVERAGE
    assert all(repr(n) in info.value.message for n in names), info.value.message
    for (k, v), old in zip(writable, before):
        assert torch.equal(v, old), k  # not a byte written


def test_loading_into_overlapping_slices_of_one_tensor_is_refused_before_any_byte_is_written(store_dir):
    root = alpha_ckpt.save({"base": {"head": torch.randn(6), "tail": torch.randn(6)}}, store=store_dir, **KW)
    base = torch.full((10,), 7.0)
    _refused_untouched(store_dir, root, {"base": {"head": base[:6], "tail": base[4:]}}, "base.head", "base.tail")
    assert torch.equal(base, torch.full((10,), 7.0))


@pytest.mark.parametrize("make", [lambda: torch.as_strided(torch.zeros(6), (3, 3), (1, 1)),
                                  lambda: torch.zeros(1, 3).expand(3, 3)], ids=["as_strided", "expand"])
def test_loading_into_a_destination_that_overlaps_itself_is_refused(store_dir, make):
    root = alpha_ckpt.save({"m": {"w": torch.randn(3, 3)}}, store=store_dir, **KW)
    _refused_untouched(store_dir, root, {"m": {"w": make()}}, "m.w")


def test_loading_into_a_meta_tensor_is_refused(store_dir):
    root = alpha_ckpt.save({"m": {"w": torch.randn(3, 3), "b": torch.randn(3)}}, store=store_dir, **KW)
    _refused_untouched(store_dir, root, {"m": {"w": torch.empty(3, 3, device="meta"), "b": torch.zeros(3)}}, "m.w")


class _TiedLM(torch.nn.Module):
    """GPT-style weight tying: the output projection is the input embedding."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = torch.nn.Embedding(50, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 50, bias=False)
        self.lm_head.weight = self.wte.weight


def test_tied_weights_of_a_gpt_style_model_restore_in_place(store_dir):
    saved = _TiedLM(seed=1)
    state = saved.state_dict()
    assert set(state) == {"wte.weight", "ln.weight", "ln.bias", "lm_head.weight"}
    root = alpha_ckpt.save(state, store=store_dir, **KW)
    fresh = _TiedLM(seed=2)
    alpha_ckpt.restore(fresh.state_dict(), store=store_dir, root=root)
    assert fresh.lm_head.weight is fresh.wte.weight and torch.equal(fresh.wte.weight, saved.wte.weight)
    assert torch.equal(fresh.ln.bias, saved.ln.bias)


def test_tied_destinations_are_refused_where_the_checkpoint_holds_other_words_for_them(store_dir):
    root = alpha_ckpt.save({"wte": torch.randn(50, 8), "lm_head": torch.randn(50, 8)}, store=store_dir, **KW)
    shared = torch.zeros(50, 8)
    _refused_untouched(store_dir, root, {"wte": shared, "lm_head": shared}, "wte", "lm_head")


def test_tied_destinations_are_refused_where_the_checkpoint_splits_their_words_differently(store_dir):
    weight = torch.randn(50, 8)
    # 1000-byte shards: "wte" is cut after word 247, "lm_head" after words 97 and 347.
    root = alpha_ckpt.save({"a": torch.randn(3), "wte": weight, "lm_head": weight}, store=store_dir,
                           max_shard_bytes=1000, **KW)
    shared = torch.zeros(50, 8)
    _refused_untouched(store_dir, root, {"a": torch.zeros(3), "wte": shared, "lm_head": shared}, "wte", "lm_head")
