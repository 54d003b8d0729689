"""Every save that returns can be restored: the one validator runs before any ref, and what it refuses
publishes nothing; zero-size shards, counters, identities and pattern lists at the API boundary."""
import math
import os

import pytest
import torch

import alpha_ckpt
from alpha_ckpt import Checkpointer, Partitioned, PerRank, Refusal, RefusalCode
from alpha_ckpt.errors import StoreUsageError, UsageError
from alpha_ckpt.format.records import CapturePrefix, RegionDecl
from alpha_ckpt.generation.planner import Piece
from alpha_ckpt.store import Store
from alpha_ckpt.generation.writer import publish_slices
from ranks import run_ranks

pytestmark = pytest.mark.timeout(240)


def _refs(store) -> list:
    if not os.path.isdir(store):
        return []
    with Store(store, create=False) as s:
        return s.list_refs("r", "train")


def _objects(store) -> list:
    return sorted(f for _, _, files in os.walk(os.path.join(store, "objects")) for f in files)


# ---------------------------------------------------------------- the one validator


def test_a_publish_whose_root_manifest_no_reader_accepts_is_refused_and_writes_no_manifest_or_ref(tmp_path):
    # Words [2, 4) of a 4-word region are held by no shard: before, the ref was written and every
    # restore refused it (coverage); now the same check refuses the publish.
    store = tmp_path / "store"
    data = torch.arange(4.0)
    regions = (RegionDecl(0, "w", "float32", (4,)),)
    with Store(store) as s:
        with pytest.raises(Refusal) as info:
            publish_slices(s, CapturePrefix("r", "train", 1, 0, 0), regions,
                           [[(Piece(0, 0, 2, 4), memoryview(data.numpy()).cast("B")[:8], "raw")]])
        objects = _objects(store)
    assert info.value.code == RefusalCode.COVERAGE and "[2, 4)" in info.value.message
    assert _refs(store) == [] and len(objects) == 1  # the shard only: gc sweeps it; no manifest, no ref


# ---------------------------------------------------------------- zero-size shards


def _fsdp_head(world: int, k: int):
    """``nn.Linear(k, 1)`` under fully_shard: a [1, k] Shard(0) DTensor, empty on every rank but rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(k, 1))
    if world > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def _full(model) -> list:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().reshape(-1).tolist() for k, v in sorted(sd.items())}


def _save_head(rank, world, store):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    model = _fsdp_head(world, 5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.5)  # not the seed's values: a restore has to bring them
    ckpt = Checkpointer(store, run="r")
    root = ckpt.save({"model": get_model_state_dict(model)}, update=1).root
    ckpt.close()
    alpha_ckpt.verify(store, root)
    return {"root": root, "full": _full(model)}


def _restore_head(rank, world, store):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    model = _fsdp_head(world, 5)
    state = {"model": get_model_state_dict(model)}
    ckpt = Checkpointer(store, run="r")
    counters = ckpt.restore(state, root="latest")
    ckpt.close()
    set_model_state_dict(model, state["model"])
    return {"update": counters.update, "full": _full(model)}


def test_an_fsdp2_parameter_with_fewer_rows_than_ranks_saves_verifies_and_restores_on_one_to_three_ranks(tmp_path):
    store = str(tmp_path / "store")
    saved = run_ranks(2, _save_head, store, tmp=tmp_path)
    assert saved[0]["root"] == saved[1]["root"] and "refusal" not in saved[0]
    for world in (1, 2, 3):
        restored = run_ranks(world, _restore_head, store, tmp=tmp_path)
        assert all(r.get("update") == 1 and r["full"] == saved[0]["full"] for r in restored), (world, restored)


def _empty_share(rank, world, store, restore, publisher):
    whole = torch.tensor([7.25], dtype=torch.float32)
    lo, hi = (0, 1) if rank == 0 else (1, 1)
    ckpt = Checkpointer(store, run="r", publisher=publisher, fanout=1)
    if not restore:
        root = ckpt.save({"w": Partitioned(whole[lo:hi].clone(), lo, hi, (1,))}, update=1).root
        ckpt.close()
        return root
    into = torch.zeros(1)
    counters = ckpt.restore({"w": Partitioned(into[lo:hi], lo, hi, (1,))}, root="latest")
    ckpt.close()
    return [counters.update, into.tolist()]


@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_an_empty_partitioned_share_saves_and_restores(tmp_path, publisher):
    store = str(tmp_path / "store")
    roots = run_ranks(2, _empty_share, store, False, publisher, tmp=tmp_path)
    assert roots[0] == roots[1] and isinstance(roots[0], str), roots
    assert run_ranks(2, _empty_share, store, True, publisher, tmp=tmp_path) == [[1, [7.25]], [1, [0.0]]]


# ---------------------------------------------------------------- bad tilings, colliding names

_TILINGS = {  # rank -> (lo, hi) of a 4-word region, and the shape each rank declares
    "overlap": ([(0, 3), (2, 4)], [(4,), (4,)]),
    "gap": ([(0, 1), (2, 4)], [(4,), (4,)]),
    "repeat": ([(0, 4), (0, 4)], [(4,), (4,)]),
    "shape": ([(0, 2), (2, 4)], [(4,), (2, 2)]),
}


def _tiling(rank, world, store, case):
    ranges, shapes = _TILINGS[case]
    lo, hi = ranges[rank]
    ckpt = Checkpointer(store, run="r")
    try:
        return ckpt.save({"w": Partitioned(torch.arange(float(lo), float(hi)), lo, hi, shapes[rank])}, update=1).root
    finally:
        ckpt.close()


@pytest.mark.parametrize("case", sorted(_TILINGS))
def test_partitioned_ranges_that_overlap_leave_a_gap_repeat_or_disagree_on_shape_are_refused_on_every_rank(
        tmp_path, case):
    store = str(tmp_path / "store")
    results = run_ranks(2, _tiling, store, case, tmp=tmp_path)
    codes = {r.get("refusal") for r in results if isinstance(r, dict)}
    assert len(codes) == 1 and codes <= {"coverage", "mixed-capture"}, results
    assert _refs(store) == [] and _objects(store) == []  # refused at agreement: not a byte written


def _colliding(rank, world, store):
    # Rank 0 names "a.1.0" for the entry at "a.1"; rank 1 names "a.1.0" for the one at "a" (its key "0").
    ckpt = Checkpointer(store, run="r")
    try:
        return ckpt.save({"a": PerRank({"0": torch.ones(2)}), "a.1": PerRank(torch.zeros(3))}, update=1).root
    finally:
        ckpt.close()


def test_per_rank_entries_whose_names_collide_only_across_ranks_are_refused_on_every_rank(tmp_path):
    store = str(tmp_path / "store")
    results = run_ranks(2, _colliding, store, tmp=tmp_path)
    assert [r.get("refusal") for r in results] == ["format", "format"], results
    assert "a.1.0" in results[0]["message"] and _refs(store) == []


# ---------------------------------------------------------------- counters


BAD_COUNTERS = [("update", 2.5), ("update", -1), ("update", True), ("update", "3"), ("update", 2 ** 70),
                ("cursor", -5)]


def _bad_counters(rank, world, store):
    ckpt = Checkpointer(store, run="r")
    out = []
    for name, value in BAD_COUNTERS:
        try:
            ckpt.save({"w": torch.ones(2)}, **{"update": 1, name: value})
            out.append("saved")
        except StoreUsageError as exc:
            out.append(name if name in str(exc) else str(exc))
    root = ckpt.save({"w": torch.ones(2)}, update=1).root  # the run is not locked: the next good save publishes
    ckpt.close()
    return {"out": out, "root": root}


def test_counters_no_reader_accepts_are_usage_errors_before_anything_is_written_and_the_run_goes_on(tmp_path):
    store = str(tmp_path / "store")
    result = run_ranks(1, _bad_counters, store, tmp=tmp_path)[0]
    assert result["out"] == [name for name, _ in BAD_COUNTERS]
    refs = _refs(store)
    assert [r.root for r in refs] == [result["root"]] and refs[0].prefix.update == 1
    assert alpha_ckpt.latest(store, "r", "train") == result["root"]


@pytest.mark.parametrize("name,value", BAD_COUNTERS + [("epoch", -1)])
def test_a_capture_prefix_refuses_counters_no_reader_accepts_at_construction_naming_them(name, value):
    with pytest.raises(StoreUsageError, match=name):
        CapturePrefix("r", "train", **{"update": 1, "cursor": 0, "epoch": 0, name: value})


@pytest.mark.parametrize("update", [2.5, -1, True, "3", 2 ** 70])
def test_alpha_ckpt_save_refuses_the_same_counters_as_usage_errors(tmp_path, update):
    with pytest.raises(StoreUsageError):
        alpha_ckpt.save({"w": torch.ones(2)}, store=tmp_path / "store", run="r", step="train", update=update,
                        cursor=0, epoch=0)
    assert _refs(tmp_path / "store") == []


def test_a_store_refuses_to_publish_a_ref_it_could_not_read_back(tmp_path):
    store = tmp_path / "store"
    alpha_ckpt.save({"w": torch.ones(2)}, store=store, run="r", step="train", update=1, cursor=0, epoch=0)
    prefix = CapturePrefix("r", "train", 2, 0, 0)
    object.__setattr__(prefix, "update", 2.5)  # past the constructor's check: the ref's own is the last line
    with Store(store) as s:
        root = s.list_refs("r", "train")[0]
        with pytest.raises(Refusal) as info:
            s.publish_ref(prefix, root.root, root.root_size, root.bytes, owners=1)
    assert info.value.code == RefusalCode.FORMAT
    assert [r.generation for r in _refs(store)] == [1]


# ---------------------------------------------------------------- identity


IDENTITY = {"betas": (0.9, 0.95), 3: "int key", "eps": 1e-8, "nan": math.nan}


def _identity(rank, world, store, identity, restore):
    ckpt = Checkpointer(store, run="r", identity=identity)
    try:
        if restore:
            return ckpt.restore({"w": torch.zeros(2)}, root="latest").update
        return ckpt.save({"w": torch.ones(2)}, update=1).root
    finally:
        ckpt.close()


def test_an_identity_with_tuples_int_keys_and_floats_resumes_and_a_list_in_place_of_its_tuple_does_not(tmp_path):
    store = str(tmp_path / "store")
    run_ranks(1, _identity, store, IDENTITY, False, tmp=tmp_path)
    assert run_ranks(1, _identity, store, IDENTITY, True, tmp=tmp_path) == [1]
    other = {**IDENTITY, "betas": [0.9, 0.95]}
    assert run_ranks(1, _identity, store, other, True, tmp=tmp_path)[0]["refusal"] == "foreign-learner"


def _save_or_restore(rank, world, store, run, root, branch):
    ckpt = Checkpointer(store, run=run)
    try:
        if root is None:
            return ckpt.save({"w": torch.full((2,), float(len(run)))}, update=1).root
        return ckpt.restore({"w": torch.zeros(2)}, root=root, branch=branch).update
    finally:
        ckpt.close()


@pytest.mark.timeout(240)
def test_a_branch_into_a_run_with_history_is_a_history_conflict_and_another_runs_root_is_foreign(tmp_path):
    store = str(tmp_path / "store")
    (source,) = run_ranks(1, _save_or_restore, store, "a", None, False, tmp=tmp_path)
    run_ranks(1, _save_or_restore, store, "bb", None, False, tmp=tmp_path)
    assert run_ranks(1, _save_or_restore, store, "bb", source, True, tmp=tmp_path)[0]["refusal"] == "history-conflict"
    assert run_ranks(1, _save_or_restore, store, "bb", source, False, tmp=tmp_path)[0]["refusal"] == "foreign-learner"
    assert run_ranks(1, _save_or_restore, store, "ccc", source, True, tmp=tmp_path) == [1]  # an empty run may branch


def test_an_identity_recorded_as_plain_json_still_matches():
    from alpha_ckpt.state.manifest import identity_matches
    assert identity_matches({"model": "gpt-tiny", "lr": 0.003}, {"model": "gpt-tiny", "lr": 3e-3})
    assert not identity_matches({"model": "gpt-tiny", "lr": 0.003}, {"model": "gpt-tiny", "lr": 1e-3})
    assert identity_matches("learner-digest", "learner-digest")


# ---------------------------------------------------------------- pattern lists


def _nan_weight(rank, world, store):
    ckpt = Checkpointer(store, run="r", allow_nonfinite="*.mask")
    try:
        return ckpt.save({"model": {"weight": torch.tensor([1.0, math.nan]),
                                    "causal.mask": torch.tensor([-math.inf, 0.0])}}, update=1).root
    finally:
        ckpt.close()


def test_allow_nonfinite_given_as_one_string_is_one_pattern_and_a_nan_weight_is_refused(tmp_path):
    store = str(tmp_path / "store")
    result = run_ranks(1, _nan_weight, store, tmp=tmp_path)[0]
    assert result["refusal"] == "non-finite" and "model.weight" in result["message"]
    assert _refs(store) == []
    # The same string to alpha_ckpt.save: the mask alone may hold -inf.
    with pytest.raises(Refusal) as info:
        alpha_ckpt.save({"weight": torch.tensor([math.nan]), "a.mask": torch.tensor([-math.inf])},
                        store=tmp_path / "one", run="r", step="train", update=1, cursor=0, epoch=0,
                        allow_nonfinite="*.mask")
    assert info.value.code == RefusalCode.NON_FINITE
    root = alpha_ckpt.save({"weight": torch.tensor([1.0]), "a.mask": torch.tensor([-math.inf])},
                           store=tmp_path / "one", run="r", step="train", update=1, cursor=0, epoch=0,
                           allow_nonfinite="*.mask")
    alpha_ckpt.verify(tmp_path / "one", root)


# ---------------------------------------------------------------- metadata


def test_metadata_that_would_read_back_as_another_value_is_a_usage_error_before_anything_is_written(tmp_path):
    for metadata in ({"betas": (0.9, 0.95)}, {"by_rank": {0: "a"}}):
        with pytest.raises(StoreUsageError, match="metadata"):
            alpha_ckpt.save({"w": torch.ones(2)}, store=tmp_path / "store", run="r", step="train", update=1,
                            cursor=0, epoch=0, metadata=metadata)
    assert _refs(tmp_path / "store") == [] and _objects(tmp_path / "store") == []
    with pytest.raises(UsageError, match="metadata"):  # refused before the process group is touched
        Checkpointer(str(tmp_path / "store"), run="r", metadata={"betas": (0.9, 0.95)})
    root = alpha_ckpt.save({"w": torch.ones(2)}, store=tmp_path / "store", run="r", step="train", update=1,
                           cursor=0, epoch=0, metadata={"betas": [0.9, 0.95]})
    assert alpha_ckpt.restore({"w": torch.zeros(2)}, store=tmp_path / "store", root=root).metadata == \
        {"betas": [0.9, 0.95]}
