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
    alpha_ckpt.restore(dest, store=tmp_path / "one", root=root)
    assert dest["a"].shape == (0, 3)


def dtensor(dtype, shape, mesh, place, restore="S0", seed=2):
    return {"t": "dtensor", "dtype": dtype, "shape": shape, "seed": seed, "mesh": mesh, "place": place,
            "restore": restore}


def part(dtype, shape, ranges, seed=3, **more):
    return {"t": "part", "dtype": dtype, "shape": shape, "seed": seed, "ranges": ranges, **more}


def per_rank(*parts):
    return {"t": "perrank", "parts": list(parts)}


def test_a_dtensor_with_fewer_rows_than_ranks_publishes_a_generation_that_restores_on_one_to_four_ranks(tmp_path):
    # nn.Linear(3, 1) under FSDP2 on 2 ranks: a [1, 3] Shard(0) parameter, rank 1's shard empty
    assert_restorable(check_recipe(recipe(2, ["head", dtensor("float32", [1, 3], [2], ["S0"])],
                                          ["empty", dtensor("bfloat16", [0], [2], ["S0"])]), tmp_path))


def test_partitioned_entries_with_empty_shares_publish_a_generation_that_restores(tmp_path):
    assert_restorable(check_recipe(recipe(4, ["m", part("float32", [5], [[1, 2], [2, 5], [0, 1], [0, 0]])],
                                          ["v", part("int64", [0], [[0, 0]] * 4)]), tmp_path))


@pytest.mark.parametrize("ranges, shapes, seeds", [
    ([[0, 1], [2, 4]], None, None),              # a gap: word 1 saved by no rank
    ([[0, 3], [2, 4]], None, [3, 4]),            # an overlap holding other words on each rank
    ([[0, 3], [2, 4]], None, None),              # an overlap
    ([[0, 4], [0, 4]], None, None),              # the same range twice
    ([[0, 2], [2, 4]], [[4], [2, 2]], None),     # the ranks disagree on the shape
], ids=["gap", "conflicting-overlap", "overlap", "repeat", "shape"])
def test_partitioned_ranges_that_do_not_tile_the_region_never_publish_an_unrestorable_generation(
        tmp_path, ranges, shapes, seeds):
    node = part("float32", [4], ranges, **({"shapes": shapes} if shapes else {}), **({"seeds": seeds} if seeds else {}))
    outcome = check_recipe(recipe(2, ["bad", node]), tmp_path)
    assert outcome["ok"], outcome
    if seeds or ranges[0][1] < ranges[1][0]:  # no restore could be bit for bit: only a refusal is right
        assert outcome["refused"], outcome


def test_per_rank_entries_whose_names_collide_only_across_ranks_never_publish_an_unrestorable_generation(tmp_path):
    # rank 0's "a" part {"1": x} is region a.0.1; rank 1's "a.0" part is region a.0.1 too
    outcome = check_recipe(recipe(2, ["a", per_rank({"t": "dict", "items": [["1", tensor("int32", [2])]]},
                                                    tensor("int32", [3]))],
                                  ["a.0", per_rank(tensor("int8", [1]), tensor("int8", [4]))]), tmp_path)
    assert outcome["ok"], outcome


@pytest.mark.parametrize("identity", [{"betas": (0.9, 0.95)}, {17279: "a", 1309759: "b", 3076839: [1]},
                                      {"nested": [(1, {2: None})], 0: -0.0}], ids=["tuple", "int-keys", "nested"])
def test_a_checkpoint_saved_with_an_identity_of_tuples_or_int_keys_restores_with_the_same_identity(tmp_path, identity):
    assert_restorable(check_recipe(recipe(2, ["w", tensor("float32", [2])], identity=identity), tmp_path))


@pytest.mark.parametrize("update, cursor", [(2.5, 0), (-1, 0), (True, 0), ("3", 0), (2 ** 70, 0), (1, -5)],
                         ids=["float", "negative", "bool", "str", "too-large", "negative-cursor"])
def test_a_save_with_a_counter_that_is_not_a_non_negative_int_is_refused_on_every_rank_and_writes_nothing(
        tmp_path, update, cursor):
    outcome = check_recipe(recipe(2, ["w", tensor("float32", [2])], update=update, cursor=cursor), tmp_path)
    assert outcome["ok"] and outcome["refused"], outcome


def test_allow_nonfinite_given_as_one_string_publishes_no_nan_that_its_pattern_does_not_name(tmp_path):
    outcome = check_recipe(recipe(1, ["model", {"t": "dict", "items": [["w", tensor("float32", [3], special=True)]]}],
                                  allow="*mask"), tmp_path)
    assert outcome["ok"], outcome


@pytest.mark.parametrize("node", [dtensor("float32", [1, 2], [3], ["S0"]), part("float32", [2], [[0, 2], [2, 2], [2, 2]]),
                                  dtensor("bfloat16", [0], [3], ["S0"])], ids=["one-row-dtensor", "partitioned", "empty"])
def test_ranks_whose_shards_are_byte_identical_publish_a_generation_that_names_each_shard_once(tmp_path, node):
    # two ranks each hold only an empty piece of the same region: their shards are one object
    assert_restorable(check_recipe(recipe(3, ["head", node]), tmp_path))
