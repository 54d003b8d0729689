"""Examples gates/publish_implies_restore found, kept: each state either publishes a generation that verifies
and restores bit for bit on every rank count its placement allows, or is refused on every rank with the store
unchanged (tests/state_recipes.py, check_recipe)."""
import pytest

from state_recipes import check_recipe, encode

pytestmark = pytest.mark.timeout(240)


def tensor(dtype, shape, seed=1, **more):
    return {"t": "tensor", "dtype": dtype, "shape": shape, "seed": seed, **more}


def recipe(world, *entries, update=1, cursor=0, identity=None, allow=()):
    return {"world": world, "update": encode(update), "cursor": encode(cursor), "identity": encode(identity),
            "allow_nonfinite": allow if isinstance(allow, str) else list(allow),
            "state": {"t": "dict", "items": [list(e) for e in entries]}}


def assert_restorable(outcome):
    assert outcome["ok"] and outcome["published"], outcome
    assert set(outcome["counts"]) == {1, 2, 3, 4}, outcome


def test_a_zero_dimensional_numpy_array_restores_as_a_zero_dimensional_array(tmp_path):
    outcome = check_recipe(recipe(1, ["flag", tensor("bool", [], np=True)], ["x", tensor("float64", [], np=True)]),
                           tmp_path)
    assert_restorable(outcome)


def test_a_zero_size_numpy_array_saves_and_restores(tmp_path):
    import numpy as np
    import alpha_ckpt
    outcome = check_recipe(recipe(2, ["step", tensor("float32", [0], np=True)],
                                  ["box", tensor("uint64", [5, 5, 0], np=True)]), tmp_path)
    assert_restorable(outcome)
    root = alpha_ckpt.save({"a": np.zeros((0, 3), np.float32)}, store=tmp_path / "one", run="r", step="s", update=1,
                           cursor=0, epoch=0)
    dest = {"a": np.ones((0, 3), np.float32)}
    alpha_ckpt.load(dest, store=tmp_path / "one", digest=root)
    assert dest["a"].shape == (0, 3)
