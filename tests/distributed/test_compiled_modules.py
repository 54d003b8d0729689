"""torch.compile'd and plain modules restore into each other, bit for bit, through every door.

``torch.compile(model)`` wraps the model (``_orig_mod``), so its ``state_dict()`` keys gain an
``_orig_mod.`` segment. The tests compile with ``backend="eager"``: the wrapper and its keys are
the default backend's, without inductor's minutes of compiling (and a step of the eager-compiled
GPT is bit-identical to the plain one's, so both continue alike after a restore).
"""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import alpha_ckpt
from alpha_ckpt import Checkpointer, RefusalCode
from alpha_ckpt.dcp import StorageReader, StorageWriter
from alpha_ckpt.state import capture_state
from gpt_training import GPT, Tokens, assert_identical, optimizer_step
from ranks import run_ranks

pytestmark = pytest.mark.timeout(180)

MASKS = ("*.causal_mask",)


class Run:
    """A GPT and its AdamW (two groups), ``kind``: "plain", "compiled" (the whole model) or
    "compiled-blocks" (each block compiled inside a plain model)."""

    def __init__(self, kind: str, seed: int = 0):
        torch.manual_seed(seed)
        self.gpt = GPT()
        self.model = self.gpt
        if kind == "compiled":
            self.model = torch.compile(self.gpt, backend="eager")
        elif kind == "compiled-blocks":
            for i, block in enumerate(self.gpt.blocks):
                self.gpt.blocks[i] = torch.compile(block, backend="eager")
        params = list(self.model.named_parameters())
        self.optim = torch.optim.AdamW([{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": 0.1},
                                        {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
                                       lr=3e-3, betas=(0.9, 0.95))
        self.batch = Tokens().data[:4]  # fixed sequences (its augmentation draws from the global generators)

    def train(self, steps: int, seed: int = 7) -> None:
        for i in range(steps):
            torch.manual_seed(seed + i)  # the same dropout draws in every run that takes this step
            optimizer_step(self.model, self.optim, self.batch)

    def state(self) -> dict:
        return {"model": self.model, "optim": self.optim}

    def snapshot(self) -> dict:
        """Model (keys of the plain GPT) and optimizer state, copied."""
        model = {k.replace("_orig_mod.", ""): v.clone() for k, v in self.model.state_dict().items()}
        optim = self.optim.state_dict()
        optim = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in optim["state"].items()},
                 "param_groups": optim["param_groups"]}
        return {"model": model, "optim": optim}


def _restored_and_next_step(source: Run, destination: Run) -> None:
    """The destination holds the source's state exactly, and its next step is the source's next step."""
    assert_identical(destination.snapshot(), source.snapshot())
    source.train(1, seed=50)
    destination.train(1, seed=50)
    assert_identical(destination.snapshot(), source.snapshot())


DIRECTIONS = [("compiled", "plain"), ("plain", "compiled"), ("compiled-blocks", "plain"),
              ("plain", "compiled-blocks")]


@pytest.mark.parametrize("door", ["save", "save_async"])
@pytest.mark.parametrize("source_kind, destination_kind", DIRECTIONS)
def test_compiled_and_plain_gpts_restore_into_each_other_bit_exact_with_adamw_through_the_one_process_api(
        tmp_path, door, source_kind, destination_kind):
    source = Run(source_kind)
    source.train(3)
    store = str(tmp_path / "store")
    if door == "save":
        root = alpha_ckpt.save(source.state(), store=store, run="r", step="fit", update=3, cursor=12, epoch=0,
                               allow_nonfinite=MASKS)
    else:
        with alpha_ckpt.Store(store, create=True) as s:
            root = alpha_ckpt.save_async(source.state(), store=s, run="r", step="fit", update=3, cursor=12, epoch=0,
                                         allow_nonfinite=MASKS).result().root
    destination = Run(destination_kind, seed=1)
    destination.train(1)  # its own optimizer state and weights, all replaced by the restore
    counters = alpha_ckpt.restore(destination.state(), store=store, root=root)
    assert counters.update == 3
    _restored_and_next_step(source, destination)


def _checkpointer_switch(rank, world, store, source_kind, destination_kind):
    source = Run(source_kind)
    source.train(2)
    ckpt = Checkpointer(store, run="r", allow_nonfinite=MASKS)
    root = ckpt.save(source.state(), update=2, cursor=8).root
    ckpt.close()
    destination = Run(destination_kind, seed=1)
    ckpt = Checkpointer(store, run="r", allow_nonfinite=MASKS)
    counters = ckpt.restore(destination.state(), root=root)
    ckpt.close()
    _restored_and_next_step(source, destination)
    return {"update": counters.update}


@pytest.mark.parametrize("source_kind, destination_kind", DIRECTIONS[:2])
def test_compiled_and_plain_gpts_restore_into_each_other_bit_exact_with_adamw_through_the_checkpointer(
        tmp_path, source_kind, destination_kind):
    results = run_ranks(2, _checkpointer_switch, str(tmp_path / "store"), source_kind, destination_kind,
                        tmp=tmp_path, timeout=150)
    assert results == [{"update": 2}, {"update": 2}]


@pytest.mark.parametrize("source_kind, destination_kind", DIRECTIONS)
def test_compiled_and_plain_gpts_restore_into_each_other_bit_exact_through_dcp_with_torchs_get_state_dict(
        tmp_path, source_kind, destination_kind):
    source = Run(source_kind)
    source.train(2)
    model, optim = get_state_dict(source.model, source.optim)
    dcp.save({"model": model, "optim": optim}, storage_writer=StorageWriter(tmp_path, run="r", update=2,
                                                                            allow_nonfinite=MASKS), no_dist=True)
    destination = Run(destination_kind, seed=1)
    model, optim = get_state_dict(destination.model, destination.optim)
    dcp.load({"model": model, "optim": optim}, storage_reader=StorageReader(tmp_path, run="r"), no_dist=True)
    set_state_dict(destination.model, destination.optim, model_state_dict=model, optim_state_dict=optim)
    _restored_and_next_step(source, destination)


def test_a_compiled_models_own_state_dict_goes_through_dcp_with_its_prefix_as_dcps_filesystem_storage_takes_it(
        tmp_path):
    """DCP saves the keys it is given: the prefixed keys load into the compiled model's state_dict() and
    not into a plain one's, with this backend as with DCP's own file storage."""
    source = Run("compiled")
    source.train(1)
    outcomes = {}
    for name, writer, reader in [
            ("alpha_ckpt", StorageWriter(tmp_path / "store", run="r", update=1, allow_nonfinite=MASKS),
             lambda: StorageReader(tmp_path / "store", run="r")),
            ("filesystem", FileSystemWriter(tmp_path / "fs"), lambda: FileSystemReader(tmp_path / "fs"))]:
        dcp.save({"model": source.model.state_dict()}, storage_writer=writer, no_dist=True)
        compiled = Run("compiled", seed=1)
        dcp.load({"model": compiled.model.state_dict()}, storage_reader=reader(), no_dist=True)
        assert_identical(compiled.snapshot()["model"], source.snapshot()["model"])
        plain = Run("plain", seed=1)
        before = plain.snapshot()["model"]
        with pytest.raises(CheckpointException) as refused:
            dcp.load({"model": plain.model.state_dict()}, storage_reader=reader(), no_dist=True)
        assert_identical(plain.snapshot()["model"], before)
        outcomes[name] = {rank: type(failure) for rank, (failure, _) in refused.value.failures.items()}
    assert outcomes["alpha_ckpt"] == outcomes["filesystem"] == {0: RuntimeError}  # the planner's missing key


class HoldsOrigMod(nn.Module):
    """A plain module with its own child named ``_orig_mod`` and a parameter ``weight`` beside it:
    dropping every ``_orig_mod.`` text from its keys would make ``weight`` twice."""

    def __init__(self):
        super().__init__()
        self._orig_mod = nn.Linear(3, 3)
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self._orig_mod(x) * self.weight


@pytest.mark.parametrize("source_kind, destination_kind", [("compiled", "plain"), ("plain", "compiled")])
def test_a_module_with_its_own_child_named_orig_mod_keeps_that_name_and_restores_across_compile(
        tmp_path, source_kind, destination_kind):
    def build(kind, seed):
        torch.manual_seed(seed)
        module = HoldsOrigMod()
        model = torch.compile(module, backend="eager") if kind == "compiled" else module
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        torch.manual_seed(3)
        model(torch.randn(2, 3)).sum().backward()
        optim.step()
        return module, model, optim

    module, model, optim = build(source_kind, 0)
    names = [name for name, _ in capture_state({"model": model}).named]
    assert names == ["model.weight", "model._orig_mod.weight", "model._orig_mod.bias"]
    root = alpha_ckpt.save({"model": model, "optim": optim}, store=tmp_path, run="r", step="s", update=1, cursor=0,
                           epoch=0)
    other_module, other_model, other_optim = build(destination_kind, 1)
    alpha_ckpt.restore({"model": other_model, "optim": other_optim}, store=tmp_path, root=root)
    assert_identical(other_module.state_dict(), module.state_dict())
    assert_identical(other_optim.state_dict(), optim.state_dict())


def test_a_default_backend_compiled_model_restores_from_a_plain_one_before_its_first_call(tmp_path):
    # Compiling happens at the first call: the default backend's wrapper costs nothing until then.
    source = Run("plain")
    source.train(1)
    root = alpha_ckpt.save(source.state(), store=tmp_path, run="r", step="s", update=1, cursor=0, epoch=0,
                           allow_nonfinite=MASKS)
    destination = Run("plain", seed=1)
    destination.model = torch.compile(destination.gpt)
    alpha_ckpt.restore(destination.state(), store=tmp_path, root=root)
    assert_identical(destination.snapshot(), source.snapshot())


def test_a_checkpoint_holding_the_compiled_keys_restores_into_the_compiled_model_and_is_refused_by_a_plain_one(
        tmp_path):
    """What a compiled model saved before compiled and plain were matched: its keys with ``_orig_mod.``."""
    source = Run("compiled")
    source.train(2)
    root = alpha_ckpt.save({"model": source.model.state_dict(), "optim": source.optim}, store=tmp_path, run="r",
                           step="s", update=2, cursor=0, epoch=0, allow_nonfinite=MASKS)
    compiled = Run("compiled", seed=1)
    alpha_ckpt.restore(compiled.state(), store=tmp_path, root=root)
    _restored_and_next_step(source, compiled)
    plain = Run("plain", seed=1)
    before = plain.snapshot()
    with pytest.raises(alpha_ckpt.Refusal) as refused:
        alpha_ckpt.restore(plain.state(), store=tmp_path, root=root)
    assert refused.value.code is RefusalCode.COVERAGE
    assert_identical(plain.snapshot(), before)
