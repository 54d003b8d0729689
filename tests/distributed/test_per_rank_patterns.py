"""Entries placed by name: BatchNorm statistics under DDP stored per rank (or rank 0's), everything else
replicated; and torchdata's StatefulDataLoader with its default generator resumed bit for bit."""
import random

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

import alpha_ckpt
from alpha_ckpt import Checkpointer, RefusalCode
from alpha_ckpt.generation.reader import open_generation
from alpha_ckpt.state.capture import capture_state
from alpha_ckpt.state.rules import PlacementRules
from alpha_ckpt.store import Store
from ranks import run_ranks

BN = ["*.running_mean", "*.running_var", "*.num_batches_tracked"]


def _net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    return DistributedDataParallel(net)


def _trained(rank):
    """A DDP model whose BatchNorm statistics differ per rank (each rank saw its own batches)."""
    model = _net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        loss = model(torch.randn(4, 3, 6, 6, generator=g)).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    return model, optim


def _buffers(model):
    return {k: v.tolist() for k, v in model.module.state_dict().items() if "running" in k or "batches" in k}


def _params(model):
    return {k: v.tolist() for k, v in model.module.named_parameters()}


def save_bn(rank, world, store, per_rank, from_rank0, publisher="star"):
    model, optim = _trained(rank)
    ckpt = Checkpointer(store, run="bn", per_rank=per_rank, from_rank0=from_rank0, publisher=publisher)
    ckpt.restore({}, root=None)
    ckpt.save({"model": model, "optim": optim}, update=1)
    ckpt.close()
    return {"buffers": _buffers(model), "params": _params(model)}


def restore_bn(rank, world, store, drop=False):
    model = _net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(store, run="bn")  # the placement is the saved one, read from the checkpoint
    ckpt.restore({"model": model, "optim": optim}, root="latest", per_rank="drop" if drop else "keep")
    ckpt.close()
    return {"buffers": _buffers(model), "params": _params(model), "optim": len(optim.state)}


@pytest.mark.timeout(180)
def test_ddp_batchnorm_statistics_are_stored_per_rank_by_pattern_and_everything_else_once(tmp_path):
    store = str(tmp_path / "s")
    refused = run_ranks(2, save_bn, store, (), (), tmp=tmp_path)
    assert [r["refusal"] for r in refused] == ["mixed-capture"] * 2  # without patterns: diverged replicas
    saved = run_ranks(2, save_bn, store, BN, (), tmp=tmp_path)
    assert saved[0]["buffers"] != saved[1]["buffers"] and saved[0]["params"] == saved[1]["params"]
    restored = run_ranks(2, restore_bn, store, tmp=tmp_path)
    for rank in range(2):
        assert restored[rank]["buffers"] == saved[rank]["buffers"]  # each rank its own statistics
        assert restored[rank]["params"] == saved[rank]["params"] and restored[rank]["optim"] == 5
    with Store(store, create=False) as s, open_generation(s, s.newest_ref("bn", "train").root, role=0,
                                                          wanted=[]) as g:
        names = [r.name for r in g.manifest.regions]
        assert g.manifest.metadata["placement_patterns"] == {"per_rank": BN, "from_rank0": []}
    assert {"model.module.1.running_mean.0", "model.module.1.running_mean.1", "model.module.1.running_var.1",
            "model.module.1.num_batches_tracked.0"} <= set(names)
    assert names.count("model.module.1.weight") == 1 and "model.module.0.weight" in names  # replicated: once


@pytest.mark.timeout(180)
def test_per_rank_pattern_entries_of_two_ranks_are_refused_placement_bound_on_one_rank_unless_dropped(tmp_path):
    store = str(tmp_path / "s")
    saved = run_ranks(2, save_bn, store, BN, (), tmp=tmp_path)
    refused = run_ranks(1, restore_bn, store, tmp=tmp_path)[0]
    assert refused["refusal"] == "placement-bound" and "model.module.1.running_mean" in refused["message"]
    dropped = run_ranks(1, restore_bn, store, True, tmp=tmp_path)[0]
    assert dropped["params"] == saved[0]["params"]  # replicated entries restore on any rank count
    assert dropped["buffers"]["1.running_var"] == [1.0] * 4  # the fresh model's statistics, left as built


@pytest.mark.timeout(180)
def test_from_rank0_patterns_store_rank_0s_statistics_and_restore_them_on_any_rank_count(tmp_path):
    store = str(tmp_path / "s")
    saved = run_ranks(2, save_bn, store, (), "*.running_*", "tree", tmp=tmp_path)  # a bare string: one pattern
    assert saved[0]["buffers"] != saved[1]["buffers"]
    for world in (1, 2):
        for got in run_ranks(world, restore_bn, store, tmp=tmp_path):
            assert got["buffers"] == saved[0]["buffers"] and got["params"] == saved[0]["params"]


def test_a_bare_string_pattern_is_one_pattern_and_other_kinds_are_refused():
    assert PlacementRules.of("*.running_mean", "*.x") == PlacementRules(("*.running_mean",), ("*.x",))
    with pytest.raises(ValueError):
        PlacementRules.of(5)
    with pytest.raises(ValueError):
        PlacementRules.of([""])
    captured = capture_state({"bn": {"running_mean": torch.zeros(2), "weight": torch.ones(2)}}, rank=1, world=2,
                             rules=PlacementRules.of("*.running_mean"))
    assert [n for n, _ in captured.named] == ["bn.running_mean.1", "bn.weight"]
    assert captured.placement == ("per-rank", "replicated")
    with pytest.raises(ValueError, match="both"):
        capture_state({"a": torch.zeros(1)}, rules=PlacementRules.of("a", "a"))


def _loader():
    data = torch.arange(60, dtype=torch.float32).reshape(30, 2)
    return StatefulDataLoader(data, batch_size=4, shuffle=True)  # its default generator


def _train(loader, rng_first, steps, out, store=None, stop=None):
    """Batches and a draw from torch's generator per step, saving at step ``stop``; True when it stopped."""
    state = {"rng": alpha_ckpt.RNGState(), "data": loader} if rng_first else \
        {"data": loader, "rng": alpha_ckpt.RNGState()}
    for epoch in range(3):
        for batch in loader:
            out.append((batch.tolist(), torch.rand(()).item(), random.random()))
            if len(out) == stop:
                return alpha_ckpt.save(state, store=store, run="d", step="train", update=stop, cursor=0, epoch=0)
            if len(out) == steps:
                return None
    return None


@pytest.mark.parametrize("rng_first", [False, True])
def test_a_statefuldataloader_with_its_default_generator_resumes_bit_identical_to_a_run_that_never_stopped(
        tmp_path, rng_first):
    torch.manual_seed(1), random.seed(1)
    straight = []
    _train(_loader(), rng_first, 20, straight)
    torch.manual_seed(1), random.seed(1)
    before = []
    root = _train(_loader(), rng_first, 20, before, store=str(tmp_path / "s"), stop=9)  # mid-epoch (8 per epoch)
    torch.manual_seed(999), random.seed(999)  # a new process: other generator states until the restore
    loader = _loader()
    state = {"rng": alpha_ckpt.RNGState(), "data": loader} if rng_first else \
        {"data": loader, "rng": alpha_ckpt.RNGState()}
    alpha_ckpt.restore(state, store=str(tmp_path / "s"), root=root)
    after = []
    for batch in loader:  # the rest of the interrupted epoch, then new epochs as the script makes them
        after.append((batch.tolist(), torch.rand(()).item(), random.random()))
    while len(before) + len(after) < 20:
        for batch in loader:
            after.append((batch.tolist(), torch.rand(()).item(), random.random()))
    assert before + after[:20 - len(before)] == straight
