"""FSDP2 x tensor parallel on a 2-D (dp, tp) mesh with modules that are FSDP-only (an embedding, a norm, a
head sharded over dp alone): every tp rank holds a replica of its dp shard of them. Saved once per shard,
the replicas compared, restored at other meshes as DCP restores them."""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from alpha_ckpt import Checkpointer
from alpha_ckpt.dcp import StorageReader, StorageWriter
from alpha_ckpt.generation.reader import open_generation, payload_bytes
from alpha_ckpt.store import Store
from ranks import run_ranks
from sharded_training import differing, full_state

pytestmark = pytest.mark.timeout(240)
VOCAB, WIDTH = 32, 16


class TinyLM(nn.Module):
    """Embedding, a tensor-parallel MLP pair, a norm and a head, as a torchtitan-style model lays them out."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx)
        return self.head(self.norm(x + self.mlp(x)))


def tiny_lm(mesh_shape):
    """The model on a (dp, tp) mesh: the MLP tensor-parallel over tp and FSDP over dp, everything else FSDP over
    dp only (replicated over tp); ``(n,)``: plain FSDP2 over n ranks. AdamW after two fixed steps' worth of setup."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    model = TinyLM()
    if len(mesh_shape) == 2:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        parallelize_module(model.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model.mlp, mesh=mesh["dp"])
        fully_shard(model.tok, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])  # the norm and the head: FSDP-only
    else:
        mesh = init_device_mesh("cpu", mesh_shape)
        fully_shard(model.mlp, mesh=mesh)
        fully_shard(model.tok, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optim, steps, seed):
    # The same batch on every rank: the dp ranks' gradients average to this batch's, on any mesh.
    idx = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        nn.functional.cross_entropy(model(idx).reshape(-1, VOCAB), idx.reshape(-1)).backward()
        optim.step()
        optim.zero_grad()


def _state(model, optim, step):
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "progress": {"step": step}}


def _save(rank, world, store, mesh_shape, expected):
    model, optim = tiny_lm(mesh_shape)
    _train(model, optim, 2, 3)
    state = _state(model, optim, 2)
    ckpt = Checkpointer(store, run="lm")
    root = ckpt.save(state, update=2).root
    ckpt.close()
    # The oracle: DCP saves the same state (through alpha_ckpt's writer, which DCP's planner dedups for).
    dcp.save(_state(model, optim, 2), storage_writer=StorageWriter(store, run="lm-dcp", update=2))
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, expected)  # the test's expectation, not a checkpoint
    return {"root": root}


def _restore(rank, world, store, mesh_shape, expected):
    model, optim = tiny_lm(mesh_shape)
    _train(model, optim, 1, 11)  # another state, and optimizer moments to overwrite
    state = _state(model, optim, 0)
    ckpt = Checkpointer(store, run="lm")
    counters = ckpt.restore(state, root="latest")
    ckpt.close()
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ours = full_state(model, optim)
    model, optim = tiny_lm(mesh_shape)  # DCP's own load of the same state at this mesh
    _train(model, optim, 1, 11)
    state = _state(model, optim, 0)
    dcp.load(state, storage_reader=StorageReader(store, "latest", run="lm-dcp"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"update": counters.update, "step": state["progress"]["step"],
            "differ": differing(ours, torch.load(expected, weights_only=True))[:5],
            "differ_from_dcp": differing(ours, full_state(model, optim))[:5]}


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    """One checkpoint of the model on a 2 x 2 (dp, tp) mesh: (store, expected)."""
    tmp = tmp_path_factory.mktemp("lm2x2")
    store, expected = str(tmp / "store"), str(tmp / "expected.pt")
    saved = run_ranks(4, _save, store, (2, 2), expected, tmp=tmp)
    assert len({r["root"] for r in saved}) == 1, saved
    return store, expected


def test_fsdp_only_modules_on_a_2x2_dp_tp_mesh_save_once_per_shard_and_restore_bit_for_bit_at_2x2(tmp_path, saved_2x2):
    store, expected = saved_2x2
    results = run_ranks(4, _restore, store, (2, 2), expected, tmp=tmp_path)
    for r in results:
        assert r["differ"] == [] and r["differ_from_dcp"] == [] and r["update"] == 2 and r["step"] == 2, results
    with Store(store, create=False) as s:
        (ref,) = s.list_refs("lm", "train")
        with open_generation(s, ref.root) as generation:  # each word once, not once per tp replica
            want = torch.load(expected, weights_only=True)
            assert payload_bytes(generation) == sum(t.numel() * t.element_size() for t in want.values())


@pytest.mark.parametrize("mesh_shape", [(2,), (4, 1), (1, 4)])
def test_a_2x2_dp_tp_checkpoint_with_fsdp_only_modules_restores_as_dcp_does_at_other_meshes(
        tmp_path, saved_2x2, mesh_shape):
    store, expected = saved_2x2
    world = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) == 2 else 1)
    results = run_ranks(world, _restore, store, mesh_shape, expected, tmp=tmp_path)
    for r in results:
        assert r["differ"] == [] and r["differ_from_dcp"] == [] and r["update"] == 2, results


def test_tp_replicas_of_an_fsdp_only_shard_that_differ_are_refused_on_every_rank_and_nothing_is_published(tmp_path):
    store, expected = str(tmp_path / "store"), str(tmp_path / "expected.pt")
    results = run_ranks(4, _save_diverged, store, expected, tmp=tmp_path)
    assert [r.get("refusal") for r in results] == ["mixed-capture"] * 4, results
    with Store(store, create=False) as s:
        assert s.list_refs("lm", "train") == []


def _save_diverged(rank, world, store, expected):
    model, optim = tiny_lm((2, 2))
    _train(model, optim, 1, 3)
    if rank == 1:  # rank 1 (dp 0, tp 1) holds a replica of rank 0's shard of the head: it differs
        with torch.no_grad():
            model.head.weight.to_local().add_(1.0)
    Checkpointer(store, run="lm").save(_state(model, optim, 1), update=1)
    return {}


def _descriptor(pieces, dtensors=("w",)):
    from alpha_ckpt.tiers.durable.messages import Descriptor
    return Descriptor(pieces=[list(p) for p in pieces], dtensors=list(dtensors))


def test_a_dtensor_shard_that_ranks_hold_alike_gets_one_writer_the_least_loaded_holder():
    from alpha_ckpt.collective.agreement import shared_piece_writers
    from alpha_ckpt.format.records import RegionDecl
    regions = (RegionDecl(0, "w", "float32", (8,)), RegionDecl(1, "v", "float32", (100,)))
    # (dp, tp) = (2, 2): ranks 0 and 1 hold w[0:4], ranks 2 and 3 w[4:8]; rank 0 alone writes all of v.
    descriptors = [_descriptor([("w", 0, 4), ("v", 0, 100)], ("w",)), _descriptor([("w", 0, 4)]),
                   _descriptor([("w", 4, 8)]), _descriptor([("w", 4, 8)])]
    assert shared_piece_writers(descriptors, regions) == {("w", 0, 4): 1, ("w", 4, 8): 2}


def test_a_partitioned_range_that_two_ranks_both_hold_is_not_a_shared_shard():
    from alpha_ckpt.collective.agreement import shared_piece_writers
    from alpha_ckpt.format.records import RegionDecl
    regions = (RegionDecl(0, "w", "float32", (4,)),)
    assert shared_piece_writers([_descriptor([("w", 0, 4)], ()), _descriptor([("w", 0, 4)], ())], regions) == {}


def test_the_write_verdict_refuses_copies_of_a_shared_shard_that_differ_and_passes_equal_ones():
    from alpha_ckpt.tiers.durable.messages import WriteReport, written_verdict
    same = [WriteReport(replicas={}, shared=[["w", 0, 4, "aa"]]), WriteReport(replicas={}, shared=[["w", 0, 4, "aa"]]),
            WriteReport(replicas={}, shared=[["w", 4, 8, "cc"]])]
    assert written_verdict(same).ok
    differ = written_verdict(same[:1] + [WriteReport(replicas={}, shared=[["w", 0, 4, "bb"]])])
    assert not differ.ok and differ.code == "mixed-capture"


def _hsdp_diverged(rank, world, store):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cpu", (2, 2))  # replicated over the first dimension: rank 2 holds rank 0's shard
    local = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 12 * (rank % 2) + (1 if rank == 2 else 0)
    w = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], shape=torch.Size((6, 4)), stride=(4, 1))
    Checkpointer(store, run="hsdp").save({"w": w}, update=1)
    return {}


def test_hsdp_replicas_that_differ_are_refused_on_every_rank_and_nothing_is_published(tmp_path):
    store = str(tmp_path / "store")
    results = run_ranks(4, _hsdp_diverged, store, tmp=tmp_path)
    assert [r.get("refusal") for r in results] == ["mixed-capture"] * 4, results
    with Store(store, create=False) as s:
        assert s.list_refs("hsdp", "train") == []
