"""Real training state as it comes: a GPT-style model, AdamW, schedulers, RNG and a data loader."""
import copy
import logging
import random

import numpy as np
import pytest
import torch

import alpha_ckpt
from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.store import Store
from gpt_training import Trainer, assert_identical

MASKS = ("*.causal_mask",)


def _state_dicts(t: Trainer) -> dict:
    """What a user hands over: each object's state_dict() as it comes, plus plain values."""
    return {
        "model": t.model.state_dict(),
        "optim": t.optim.state_dict(),
        "side": t.side.state_dict(),
        "warmup": t.warmup.state_dict(),
        "steps": t.steps.state_dict(),
        "cycle": t.cycle.state_dict(),
        "loader": t.loader.state_dict(),
        "rng": alpha_ckpt.RNGState().state_dict(),
        "step": t.step,
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
        "extra": {"best_val_loss": float("inf"), "history": (1, 2.5, -0.0, None), 7: b"\x00\xff", "big": 1 << 80},
    }


def _load_state_dicts(t: Trainer, loaded: dict) -> None:
    t.model.load_state_dict(loaded["model"])
    t.optim.load_state_dict(loaded["optim"])
    t.side.load_state_dict(loaded["side"])
    t.warmup.load_state_dict(loaded["warmup"])
    t.steps.load_state_dict(loaded["steps"])
    t.cycle.load_state_dict(loaded["cycle"])
    t.data.load_state_dict(loaded["loader"])  # makes the data iterator, which draws a seed...
    alpha_ckpt.RNGState().load_state_dict(loaded["rng"])  # ...so the generators are restored after it
    t.step = loaded["step"]


def _snapshot(t: Trainer) -> dict:
    return copy.deepcopy({"model": t.model.state_dict(), "optim": t.optim.state_dict(), "side": t.side.state_dict(),
                          "warmup": t.warmup.state_dict(), "steps": t.steps.state_dict(),
                          "cycle": t.cycle.state_dict(), "loader": t.loader.state_dict(), "step": t.step})


@pytest.fixture(scope="module")
def uninterrupted():
    t = Trainer(seed=0)
    t.train(7)
    return t.losses, _snapshot(t)


def test_state_dicts_as_they_come_resume_bit_identically(tmp_path, uninterrupted):
    t = Trainer(seed=0)
    t.train(3)
    saved = _state_dicts(t)
    expected = _snapshot(t)
    expected_values = copy.deepcopy({k: saved[k] for k in ("numpy_rng", "python_rng", "extra")})
    root = alpha_ckpt.save(saved, store=tmp_path, run="r", step="s", update=3, cursor=12, epoch=0,
                           allow_nonfinite=MASKS)

    resumed = Trainer(seed=99)  # another seed: every bit must come from the checkpoint
    destination = _state_dicts(resumed)
    destination["extra"] = {}
    alpha_ckpt.restore(destination, store=tmp_path, root=root)
    for key in ("numpy_rng", "python_rng", "extra"):
        assert_identical(destination[key], expected_values[key], key)
    assert_identical(list(destination["optim"]["state"]), list(expected["optim"]["state"]))  # int keys stay int
    _load_state_dicts(resumed, destination)
    assert_identical(_snapshot(resumed), expected)
    resumed.train(4)
    losses, final = uninterrupted
    assert resumed.losses == losses[3:]
    assert_identical(_snapshot(resumed), final)


def test_stateful_objects_resume_bit_identically_into_fresh_objects(tmp_path, uninterrupted):
    t = Trainer(seed=0)
    t.train(3)
    # Restored in this order: the data position (making its iterator) before the generators.
    objects = lambda t: {"model": t.model, "optim": t.optim, "side": t.side, "warmup": t.warmup, "steps": t.steps,
                         "cycle": t.cycle, "data": t.data, "rng": alpha_ckpt.RNGState()}
    expected = _snapshot(t)
    root = alpha_ckpt.save(objects(t), store=tmp_path, run="r", step="s", update=3, cursor=12, epoch=0,
                           allow_nonfinite=MASKS)
    resumed = Trainer(seed=5)
    assert not resumed.optim.state  # a freshly built optimizer: its state is created from the checkpoint
    alpha_ckpt.restore(objects(resumed), store=tmp_path, root=root)
    resumed.step = 3
    assert_identical(_snapshot(resumed), expected)
    for group, saved_group in zip(resumed.optim.param_groups, t.optim.param_groups):
        for key in ("lr", "initial_lr", "betas", "weight_decay", "eps"):
            assert_identical(group[key], saved_group[key], key)
    resumed.train(4)
    losses, final = uninterrupted
    assert resumed.losses == losses[3:]
    assert_identical(_snapshot(resumed), final)


def test_values_keep_their_types_and_bits(store_dir):
    values = {"i": 3, "neg": -(1 << 70), "f": 1.0, "nan": float("nan"), "ninf": float("-inf"), "z": -0.0,
              "t": (1, (2, [3.5])), "l": [None, True, "s"], "b": b"\x00", "ik": {0: "a", 1: {2: 3}},
              "od": __import__("collections").OrderedDict(b=1, a=2),
              "counter": __import__("collections").Counter({30: 1, 80: 2})}
    state = {"w": torch.ones(2), "values": values}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    destination = {"w": torch.zeros(2), "values": None}
    alpha_ckpt.restore(destination, store=store_dir, root=root)
    assert_identical(destination["values"], values)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_tensors_and_numpy_arrays_round_trip(store_dir, dtype):
    tensor = torch.tensor([0, 1, 2**16 - 1], dtype=dtype)
    array = np.arange(6, dtype=np.uint32).reshape(2, 3) * 1000003
    root = alpha_ckpt.save({"t": tensor, "a": array}, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    destination = {"t": torch.zeros_like(tensor), "a": np.zeros_like(array)}
    alpha_ckpt.restore(destination, store=store_dir, root=root)
    assert_identical(destination["t"], tensor)
    assert_identical(destination["a"], array)


def _saved_pair(store_dir):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, "step": 4}
    return alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0), state


def test_the_same_names_in_another_order_restore(store_dir):
    root, state = _saved_pair(store_dir)
    destination = {"step": 0, "model": {"b": torch.zeros(3), "w": torch.zeros(2, 3)}}
    alpha_ckpt.restore(destination, store=store_dir, root=root)
    assert torch.equal(destination["model"]["w"], state["model"]["w"]) and destination["step"] == 4


@pytest.mark.parametrize("change, named", [
    (lambda d: d["model"].pop("b"), "model.b"),                                   # the checkpoint has it, we don't
    (lambda d: d["model"].__setitem__("extra", torch.zeros(1)), "model.extra"),  # we want it, it was not saved
    (lambda d: d["model"].__setitem__("w", torch.zeros(3, 2)), "model.w"),       # reshaped
])
def test_a_missing_an_extra_and_a_reshaped_entry_are_refused_by_name(store_dir, change, named):
    root, _ = _saved_pair(store_dir)
    destination = {"model": {"w": torch.full((2, 3), 7.0), "b": torch.full((3,), 7.0)}, "step": 0}
    change(destination)
    before = copy.deepcopy(destination)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore(destination, store=store_dir, root=root)
    assert info.value.code == RefusalCode.COVERAGE
    assert named in info.value.message
    assert_identical(destination, before)  # refused before a byte was copied


def test_a_refusal_names_the_first_ten_entries_and_counts_them(store_dir):
    root = alpha_ckpt.save({f"p{i:02d}": torch.ones(1) for i in range(15)}, store=store_dir, run="r", step="s",
                           update=1, cursor=0, epoch=0)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore({"other": torch.ones(1)}, store=store_dir, root=root)
    message = info.value.message
    assert "15 in the checkpoint" in message and "p09" in message and "p10" not in message and "5 more" in message


def _refs(store_dir) -> list:
    with Store(store_dir, create=False) as s:
        return [r.root for r in s.list_refs("r", "s")]


def test_a_declared_inf_buffer_round_trips_through_save_load_verify_and_export(store_dir, tmp_path):
    from safetensors.torch import load_file
    from alpha_ckpt.launch import cli
    t = Trainer(seed=0)
    root = alpha_ckpt.save({"model": t.model.state_dict()}, store=store_dir, run="r", step="s", update=1, cursor=0,
                           epoch=0, allow_nonfinite=MASKS)
    alpha_ckpt.verify(store_dir, root)
    assert alpha_ckpt.latest(store_dir, "r", "s") == root
    fresh = Trainer(seed=1).model.state_dict()
    alpha_ckpt.restore({"model": fresh}, store=store_dir, root=root)
    assert_identical(fresh, t.model.state_dict())
    assert cli.main(["export", "--store", str(store_dir), root, "--to", str(tmp_path / "m.safetensors")]) == 0
    exported = load_file(tmp_path / "m.safetensors")
    assert torch.equal(exported["model.blocks.0.causal_mask"], t.model.blocks[0].causal_mask)


@pytest.mark.parametrize("poison, region", [
    (lambda t: None, "model.blocks.0.causal_mask"),                                      # undeclared -inf buffer
    (lambda t: t.model.head.weight.data.__setitem__((3, 4), float("nan")), "model.head.weight"),  # a NaN parameter
])
def test_an_undeclared_non_finite_region_is_refused_at_save_and_nothing_is_published(store_dir, poison, region):
    t = Trainer(seed=0)
    good = alpha_ckpt.save({"model": t.model.state_dict()}, store=store_dir, run="r", step="s", update=1, cursor=0,
                           epoch=0, allow_nonfinite=MASKS)
    poison(t)
    patterns = () if region.endswith("mask") else MASKS
    with pytest.raises(Refusal) as info:
        alpha_ckpt.save({"model": t.model.state_dict()}, store=store_dir, run="r", step="s", update=2, cursor=0,
                        epoch=0, allow_nonfinite=patterns)
    assert info.value.code == RefusalCode.NON_FINITE and region in info.value.message
    assert _refs(store_dir) == [good]
    assert alpha_ckpt.latest(store_dir, "r", "s") == good


def test_the_allowance_is_part_of_the_checkpoint_identity(store_dir):
    state = {"m": torch.tensor([0.0, float("-inf")]), "w": torch.ones(2)}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0,
                           allow_nonfinite=("m",))
    again = alpha_ckpt.save({"m": torch.zeros(2), "w": torch.ones(2)}, store=store_dir, run="r", step="s", update=2,
                            cursor=0, epoch=0)
    from alpha_ckpt.generation.reader import open_generation
    with Store(store_dir, create=False) as s, open_generation(s, root) as g1, open_generation(s, again) as g2:
        assert [r.nonfinite for r in g1.manifest.regions] == [True, False]
        assert g1.manifest.schema_digest != g2.manifest.schema_digest


def test_an_update_not_after_the_newest_of_its_epoch_is_refused_and_the_store_is_unchanged(store_dir):
    for update in (3, 6):
        alpha_ckpt.save({"w": torch.full((2,), float(update))}, store=store_dir, run="r", step="s", update=update,
                        cursor=update, epoch=0)
    def listing(under: str) -> list:
        return sorted((p.relative_to(store_dir).as_posix(), p.stat().st_size) for p in store_dir.glob(f"{under}/**/*"))
    before = listing("*")
    newest = alpha_ckpt.latest(store_dir, "r", "s")
    with pytest.raises(Refusal) as info:  # update 3 after 6: refused before anything is written
        alpha_ckpt.save({"w": torch.zeros(2)}, store=store_dir, run="r", step="s", update=3, cursor=3, epoch=0)
    assert info.value.code == RefusalCode.RESET_CURSOR
    assert listing("*") == before
    refs = listing("refs")
    with pytest.raises(Refusal) as info:  # other content at update 6: refused at publish, once its root is known
        alpha_ckpt.save({"w": torch.zeros(2)}, store=store_dir, run="r", step="s", update=6, cursor=6, epoch=0)
    assert info.value.code == RefusalCode.RESET_CURSOR
    assert listing("refs") == refs
    assert alpha_ckpt.latest(store_dir, "r", "s") == newest
    # A continuation (a newer epoch) may restart from an older update.
    alpha_ckpt.save({"w": torch.zeros(2)}, store=store_dir, run="r", step="s", update=3, cursor=3, epoch=1)


def test_saving_the_newest_state_again_is_idempotent(store_dir):
    state = {"w": torch.ones(4), "n": 1}
    first = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    assert alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0) == first
    assert _refs(store_dir) == [first]


def test_latest_names_what_it_skipped(store_dir, caplog):
    good = alpha_ckpt.save({"w": torch.ones(4)}, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    bad = alpha_ckpt.save({"w": torch.ones(4) * 2}, store=store_dir, run="r", step="s", update=2, cursor=0, epoch=0)
    with Store(store_dir, create=False) as s:
        from alpha_ckpt.generation.reader import open_generation
        with open_generation(s, bad) as g:
            victim = s.object_path(next(iter(g.shards)))
    import os
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 1]))
    with caplog.at_level(logging.WARNING, logger="alpha_ckpt"):
        assert alpha_ckpt.latest(store_dir, "r", "s") == good
    assert any(bad in record.getMessage() for record in caplog.records if record.levelno == logging.WARNING)
    found = alpha_ckpt.latest(store_dir, "r", "s", explain=True)
    assert found.root == good
    assert [(s.root, s.code) for s in found.skipped] == [(bad, RefusalCode.CORRUPT_SHARD)]


def test_async_save_captures_values_at_the_call(store_dir):
    with Store(store_dir) as s:
        state = {"w": torch.ones(3), "meta": {"step": 1}}
        handle = alpha_ckpt.save_async(state, store=s, run="r", step="s", update=1, cursor=0, epoch=0)
        state["meta"]["step"] = 2
        state["w"].add_(1)
        root = handle.result().root
    destination = {"w": torch.zeros(3), "meta": {}}
    alpha_ckpt.restore(destination, store=store_dir, root=root)
    assert destination["meta"] == {"step": 1} and torch.equal(destination["w"], torch.ones(3))


def test_a_manifest_without_a_skeleton_loads_by_dotted_name(store_dir):
    from conftest import save_forged  # publishes regions only, as manifests were written before skeletons
    state = {"model": {"w": torch.arange(4.0), "b": torch.ones(2)}, "n": torch.tensor(3)}
    root = save_forged(state, store_dir)
    destination = {"n": torch.tensor(0), "model": {"b": torch.zeros(2), "w": torch.zeros(4)}}
    alpha_ckpt.restore(destination, store=store_dir, root=root)
    assert_identical(destination, {"n": torch.tensor(3), "model": {"b": torch.ones(2), "w": torch.arange(4.0)}})
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore({"model": {"w": torch.zeros(4)}, "n": torch.tensor(0)}, store=store_dir, root=root)
    assert info.value.code == RefusalCode.COVERAGE and "model.b" in info.value.message
