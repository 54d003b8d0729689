"""A restore into another optimizer class is refused ``coverage``, naming both classes, before any byte of the
state is written, at every door (alpha_ckpt.restore, the Checkpointer on every rank; a script under alpha-run:
tests/e2e/test_changed_optimizer_under_alpha_run.py);
an explicitly allowed change between classes of the same hyperparameters restores and steps; a Stateful whose
load_state_dict() raises after the copies says what was already written."""
import copy

import pytest
import torch

import alpha_ckpt
from alpha_ckpt import Checkpointer, RefusalCode, RestoreIncomplete, UsageError
from gpt_training import CONTEXT, GPT, VOCAB, assert_identical, optimizer_step
from ranks import run_ranks

MASK = "*.causal_mask"  # the GPT's -inf attention mask
OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=torch.Generator().manual_seed(seed))


def trained(optimizer: str, seed: int = 0, steps: int = 2) -> dict:
    """A small GPT and its optimizer after ``steps`` training steps (the optimizer holds per-parameter state)."""
    torch.manual_seed(seed)
    model = GPT()
    optim = OPTIMIZERS[optimizer](model.parameters())
    for i in range(steps):
        optimizer_step(model, optim, _batch(i))
    return {"model": model, "optim": optim}


def _words(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict) -> bool:
    after = model.state_dict()
    return all(torch.equal(after[k].view(torch.uint8), v.view(torch.uint8)) for k, v in before.items())


def _saved(tmp_path, optimizer: str) -> str:
    return alpha_ckpt.save(trained(optimizer), store=tmp_path / "s", run="r", step="s", update=2, cursor=0, epoch=0,
                           allow_nonfinite=MASK)


@pytest.mark.parametrize("saved,destination", [("SGD", "AdamW"), ("AdamW", "SGD"), ("AdamW", "Adagrad"),
                                               ("Adam", "AdamW")])
def test_a_restore_into_another_optimizer_class_is_refused_coverage_naming_both_and_writes_no_byte(
        tmp_path, saved, destination):
    root = _saved(tmp_path, saved)
    fresh = trained(destination, seed=1, steps=0)  # a resumed script's optimizer: no state before its first step
    before, optimizer_before = _words(fresh["model"]), copy.deepcopy(fresh["optim"].state_dict())
    with pytest.raises(alpha_ckpt.Refusal) as refused:
        alpha_ckpt.restore(fresh, store=tmp_path / "s", root=root)
    assert refused.value.code is RefusalCode.COVERAGE
    assert f"saved by {saved}" in refused.value.message and f"destination {destination}" in refused.value.message
    assert _unchanged(fresh["model"], before)
    assert_identical(fresh["optim"].state_dict(), optimizer_before, "optim")


def test_a_fresh_optimizer_of_the_saved_class_restores_the_saved_state_and_steps(tmp_path):
    root = _saved(tmp_path, "AdamW")
    fresh = trained("AdamW", seed=1, steps=0)
    alpha_ckpt.restore(fresh, store=tmp_path / "s", root=root)
    straight = trained("AdamW")
    for key, value in straight["optim"].state_dict()["state"].items():
        restored = fresh["optim"].state_dict()["state"][key]
        assert all(torch.equal(restored[k], v) for k, v in value.items())
    for run in (fresh, straight):
        torch.manual_seed(5)  # the same dropout masks
        optimizer_step(run["model"], run["optim"], _batch(2))
    assert _unchanged(fresh["model"], _words(straight["model"]))


def test_adam_state_into_adamw_restores_when_allowed_and_the_first_step_works(tmp_path):
    root = _saved(tmp_path, "Adam")
    fresh = trained("AdamW", seed=1, steps=0)
    alpha_ckpt.restore(fresh, store=tmp_path / "s", root=root, allow_optimizer_change=[("Adam", "AdamW")])
    assert fresh["optim"].param_groups[0]["decoupled_weight_decay"] is True  # AdamW's own, as torch's load sets it
    optimizer_step(fresh["model"], fresh["optim"], _batch(2))
    assert torch.isfinite(next(fresh["model"].parameters())).all()


def test_an_allowed_change_between_classes_of_other_hyperparameters_is_still_refused(tmp_path):
    root = _saved(tmp_path, "SGD")
    fresh = trained("AdamW", seed=1, steps=0)
    before = _words(fresh["model"])
    with pytest.raises(alpha_ckpt.Refusal) as refused:
        alpha_ckpt.restore(fresh, store=tmp_path / "s", root=root, allow_optimizer_change=[("SGD", "AdamW")])
    assert refused.value.code is RefusalCode.COVERAGE
    assert _unchanged(fresh["model"], before)


@pytest.mark.parametrize("value", ["Adam", [("Adam",)], [("Adam", 3)], {"Adam": "AdamW"}])
def test_an_allow_optimizer_change_that_is_not_pairs_of_class_names_is_a_usage_error(tmp_path, value):
    with pytest.raises(UsageError):
        alpha_ckpt.CheckpointerOptions(store=tmp_path / "s", run="r", allow_optimizer_change=value)
    with pytest.raises(UsageError):
        alpha_ckpt.restore({}, store=tmp_path, root="0" * 64, allow_optimizer_change=value)


def restore_sgd_into_adamw_on_every_rank(rank, world, store, allow):
    ckpt = Checkpointer(store, run="r", allow_nonfinite=MASK)
    ckpt.save(trained("SGD"), update=2)
    fresh = trained("AdamW", seed=1, steps=0)
    before = _words(fresh["model"])
    resumed = Checkpointer(store, run="r", allow_nonfinite=MASK, allow_optimizer_change=allow)
    try:
        resumed.restore(fresh)
        return {"restored": True}
    except alpha_ckpt.Refusal as refusal:
        return {"refusal": refusal.code.value, "message": refusal.message,
                "untouched": _unchanged(fresh["model"], before)}
    finally:
        resumed.close()
        ckpt.close()


@pytest.mark.timeout(120)
def test_the_checkpointer_refuses_another_optimizer_class_on_every_rank_before_a_byte_is_written(tmp_path):
    results = run_ranks(2, restore_sgd_into_adamw_on_every_rank, str(tmp_path / "s"), (), tmp=tmp_path, timeout=100)
    assert [r.get("refusal") for r in results] == ["coverage", "coverage"], results
    assert all("SGD" in r["message"] and "AdamW" in r["message"] and r["untouched"] for r in results), results


class Fails:
    """A Stateful whose load raises (a script's own object, with a bug in its load_state_dict)."""

    def state_dict(self) -> dict:
        return {"position": 7}

    def load_state_dict(self, state) -> None:
        raise KeyError("cursor")


def test_a_stateful_whose_load_raises_names_the_entries_already_written_and_those_not(tmp_path):
    saved = trained("AdamW")
    saved = {"model": saved["model"], "data": Fails(), "optim": saved["optim"], "rng": alpha_ckpt.RNGState()}
    root = alpha_ckpt.save(saved, store=tmp_path / "s", run="r", step="s", update=2, cursor=0, epoch=0,
                           allow_nonfinite=MASK)
    fresh = trained("AdamW", seed=1, steps=0)
    fresh = {"model": fresh["model"], "data": Fails(), "optim": fresh["optim"], "rng": alpha_ckpt.RNGState()}
    with pytest.raises(RestoreIncomplete) as incomplete:
        alpha_ckpt.restore(fresh, store=tmp_path / "s", root=root)
    assert (incomplete.value.loaded, incomplete.value.failed, incomplete.value.not_loaded) == (
        ("model",), "data", ("optim", "rng"))
    assert isinstance(incomplete.value.__cause__, KeyError)
    assert _unchanged(fresh["model"], _words(saved["model"]))  # the tensors were written, as it says
