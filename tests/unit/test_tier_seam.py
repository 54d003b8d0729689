"""Both tiers behind one seam: the walk order of their candidates, and no product class overriding
another's private method."""
import ast
import inspect
from pathlib import Path

from hypothesis import given, strategies as st

import alpha_ckpt
from alpha_ckpt.tiers.durable.messages import Candidate
from alpha_ckpt.tiers.durable.tier import DurableTier
from alpha_ckpt.tiers.memory.tier import MemoryTier
from alpha_ckpt.tiers.seam import DURABLE, MEMORY, Tier, walk_order

PACKAGE = Path(alpha_ckpt.__file__).parent


def _candidates(tier: str):
    keyed = st.tuples(st.integers(0, 3), st.integers(0, 50))
    return st.lists(keyed, max_size=5).map(
        lambda keys: [Candidate(root=f"{tier}-{i}", tier=tier, epoch=e, update=u)
                      for i, (e, u) in enumerate(sorted(keys, reverse=True))])


@given(_candidates(MEMORY), _candidates(DURABLE))
def test_the_walk_takes_the_candidates_of_every_tier_newest_first_the_faster_tier_first_on_a_tie(memory, durable):
    walk = walk_order([memory, durable])
    assert sorted(c.root for c in walk) == sorted(c.root for c in memory + durable)
    assert [c for c in walk if c.tier == MEMORY] == memory and [c for c in walk if c.tier == DURABLE] == durable
    keys = [((c.epoch, c.update), c.tier == MEMORY) for c in walk]
    assert keys == sorted(keys, reverse=True)


def test_a_candidate_with_unknown_counters_comes_after_every_dated_one_of_a_faster_tier():
    refusal = Candidate(root=None, tier=DURABLE)
    held = Candidate(root="m", tier=MEMORY, epoch=0, update=3)
    named = Candidate(root="d", tier=DURABLE)  # a digest asked for by name
    assert walk_order([[held], [refusal]]) == [held, refusal]
    assert walk_order([[], [named]]) == [named]


def test_the_durable_and_the_memory_tier_keep_the_same_seam():
    wanted = {name for name, member in vars(Tier).items() if callable(member) and not name.startswith("_")}
    assert wanted == {"publish", "newest", "reader"}
    for tier in (DurableTier, MemoryTier):
        for name in wanted:
            assert list(inspect.signature(getattr(tier, name)).parameters) == \
                list(inspect.signature(getattr(Tier, name)).parameters), (tier.__name__, name)
    assert {DurableTier.name, MemoryTier.name} == {DURABLE, MEMORY}


def _classes(paths) -> dict[str, tuple[list[str], set[str], str]]:
    """Every class in ``paths``: its base names, its methods, its file."""
    found = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                found.setdefault(node.name, (bases, methods, path.name))
    return found


def _private_overrides(classes) -> list[str]:
    overrides = []
    for name, (bases, methods, where) in classes.items():
        for base in bases:
            if base in classes:
                private = {m for m in classes[base][1] if m.startswith("_") and not m.startswith("__")}
                overrides += [f"{where}: {name}.{m} overrides {base}.{m}" for m in sorted(methods & private)]
    return overrides


def test_no_product_class_overrides_a_private_method_of_another():
    assert _private_overrides(_classes(PACKAGE.rglob("*.py"))) == []


def test_the_override_check_sees_an_override(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class A:\n    def _step(self): ...\n    def __len__(self): ...\n\n"
                     "class B(A):\n    def _step(self): ...\n    def __len__(self): ...\n")
    assert _private_overrides(_classes([probe])) == ["probe.py: B._step overrides A._step"]
