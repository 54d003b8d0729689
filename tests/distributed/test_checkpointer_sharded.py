"""The Checkpointer with sharded state: FSDP2 (DTensor) parameters and AdamW moments, resharded to any world size."""
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import alpha_ckpt
from alpha_ckpt import Checkpointer
from alpha_ckpt.state.placement import box_ranges, contiguous_words
from alpha_ckpt.generation.reader import open_generation, payload_bytes
from alpha_ckpt.store import Store
from ranks import run_ranks
from sharded_training import differing, fsdp2_gpt, full_state, train

pytestmark = pytest.mark.timeout(240)
MASKS = ["*.causal_mask"]


def _state(model, optim, step):
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "progress": {"step": step}}


def _save(rank, world, store, expected, fsdp):
    model, optim = fsdp2_gpt(world, fsdp)
    train(model, optim, 3, 0)
    ckpt = Checkpointer(store, run="gpt", allow_nonfinite=MASKS)
    root = ckpt.save(_state(model, optim, 3), update=3).root
    full = full_state(model, optim)
    losses = train(model, optim, 2, 3)
    if rank == 0:
        torch.save({"full": full, "losses": losses}, expected)  # the test's expectation, not a checkpoint
    ckpt.close()
    return {"root": root, "bytes_written": ckpt.last_save["bytes_written"]}


def _restore(rank, world, store, expected, fsdp):
    model, optim = fsdp2_gpt(world, fsdp)
    train(model, optim, 1, 9)  # another state, and optimizer moments to overwrite
    state = _state(model, optim, 0)
    ckpt = Checkpointer(store, run="gpt", allow_nonfinite=MASKS)
    counters = ckpt.restore(state, root="latest")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    want = torch.load(expected, weights_only=True)
    differ = differing(full_state(model, optim), want["full"])
    losses = train(model, optim, 2, 3)
    read = ckpt.last_restore
    ckpt.close()
    return {"update": counters.update, "step": state["progress"]["step"], "differ": differ[:5],
            "continued": losses == want["losses"], "bytes": read["bytes_read"] if read else None}


@pytest.fixture(scope="module")
def fsdp2_saved(tmp_path_factory):
    """One FSDP2 checkpoint on 2 ranks (restores only read it): (store, expected, root)."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    store, expected = str(tmp / "store"), str(tmp / "expected.pt")
    saved = run_ranks(2, _save, store, expected, True, tmp=tmp)
    assert saved[0]["root"] == saved[1]["root"]
    return store, expected, saved[0]["root"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_an_fsdp2_gpt_saved_on_two_ranks_restores_bit_for_bit_on_one_to_four_ranks(tmp_path, fsdp2_saved, world):
    store, expected, _ = fsdp2_saved
    results = run_ranks(world, _restore, store, expected, True, tmp=tmp_path)
    for r in results:
        assert r["differ"] == [] and r["update"] == 3 and r["step"] == 3, results
    if world in (1, 2):  # the same summation order as the uninterrupted run: training goes on identically
        assert all(r["continued"] for r in results), results


def test_a_ddp_checkpoint_restores_under_fsdp2_and_an_fsdp2_one_under_ddp(tmp_path, fsdp2_saved):
    store, expected = str(tmp_path / "store"), str(tmp_path / "expected.pt")
    run_ranks(2, _save, store, expected, False, tmp=tmp_path)  # DDP: plain replicated tensors
    results = run_ranks(2, _restore, store, expected, True, tmp=tmp_path)
    assert all(r["differ"] == [] for r in results), results
    store, expected, _ = fsdp2_saved
    results = run_ranks(2, _restore, store, expected, False, tmp=tmp_path)
    assert all(r["differ"] == [] for r in results), results


def test_an_fsdp2_checkpoint_loads_whole_in_one_process_and_exports_full_tensors(tmp_path, fsdp2_saved):
    from safetensors.torch import load_file
    store, expected, root = fsdp2_saved
    want = torch.load(expected, weights_only=True)["full"]
    model, optim = fsdp2_gpt(1)
    train(model, optim, 1, 9)
    state = _state(model, optim, 0)
    alpha_ckpt.restore(state, store=store, root=root)  # one process, no process group: the logical tensors
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert differing(full_state(model, optim), want) == []
    out = tmp_path / "gpt.safetensors"
    from alpha_ckpt.upkeep.export import export_generation
    export_generation(store, root, out)
    exported = load_file(out)
    assert all(torch.equal(exported[k], want[k]) for k in want if k.startswith("model."))


def _rows(rank, world, store, placement, save):
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    ckpt = Checkpointer(store, run="rows")
    if save:
        ckpt.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "b": distribute_tensor(full[0], mesh, [Replicate()])},
                  update=1)
        return {}
    dest = {"w": distribute_tensor(torch.zeros(12, 5), mesh, [placement]), "b": torch.zeros(5)}
    ckpt.restore(dest, root="latest")
    return {"equal": torch.equal(dest["w"].full_tensor(), full) and torch.equal(dest["b"], full[0]),
            "bytes": ckpt.last_restore["bytes_read"]}


def test_a_resharded_restore_reads_the_saved_slices_of_its_rows_plus_the_replicated_ones(tmp_path):
    store = str(tmp_path / "store")
    run_ranks(4, _rows, store, None, True, tmp=tmp_path)
    results = run_ranks(2, _rows, store, Shard(0), False, tmp=tmp_path)
    assert all(r["equal"] for r in results), results
    # 12 rows of 5 float32 saved by 4 ranks (3 rows each), restored on 2: 6 rows (120 bytes) each, read
    # from exactly two saved slices, plus the replicated 5 words (20 bytes). (A saved slice is read whole:
    # on 3 ranks rank 1's rows 4-7 would read the slices of rows 3-8.)
    assert [r["bytes"] for r in results] == [120 + 20] * 2


MATRICES = {"w1": (3001, 2048), "w2": (2048, 4096)}  # 23 and 32 MiB of float32, Shard(0) as FSDP2 holds them


def _large_rows(rank, world, store, save):
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh("cpu", (world,))

    def local(name, rows, cols):  # this rank's rows as DTensor's Shard(0) cuts them, without any collective
        lo, hi = _chunk_rows(rows, world, rank)
        return torch.arange(lo * cols, hi * cols, dtype=torch.float64).to(torch.float32).reshape(-1, cols) + len(name)

    ckpt = Checkpointer(store, run="large")
    bias = torch.linspace(0, 1, 4096)
    if save:
        ckpt.save({"b": bias, **{n: DTensor.from_local(local(n, *shape), mesh, [Shard(0)], shape=torch.Size(shape),
                                                      stride=(shape[1], 1)) for n, shape in MATRICES.items()}},
                  update=1)
        return {}
    dest = {"b": torch.zeros(4096), **{n: DTensor.from_local(torch.zeros_like(local(n, *shape)), mesh, [Shard(0)],
                                                             shape=torch.Size(shape), stride=(shape[1], 1))
                                       for n, shape in MATRICES.items()}}
    ckpt.restore(dest, root="latest")
    equal = torch.equal(dest["b"], bias) and all(torch.equal(dest[n].to_local(), local(n, *shape))
                                                 for n, shape in MATRICES.items())
    share = sum(dest[n].to_local().numel() * 4 for n in MATRICES)
    return {"equal": equal, "bytes": ckpt.last_restore["bytes_read"], "share": share, "replicated": 4096 * 4}


def _chunk_rows(rows, world, rank):
    per = -(-rows // world)  # torch.chunk: ceil-sized chunks, the last ones shorter or empty
    return min(rows, rank * per), min(rows, (rank + 1) * per)


@pytest.mark.timeout(300)
def test_a_resharded_restore_reads_at_most_its_share_plus_one_percent_and_the_replicated_bytes(tmp_path):
    store = str(tmp_path / "store")
    run_ranks(2, _large_rows, store, True, tmp=tmp_path)
    results = run_ranks(3, _large_rows, store, False, tmp=tmp_path)
    assert all(r["equal"] for r in results), results
    for rank, r in enumerate(results):
        # Rank 1's rows straddle both saved halves: it reads only the saved slices that hold them.
        assert r["share"] <= r["bytes"] - r["replicated"] <= r["share"] * 1.01, (rank, r)


def test_a_partial_dtensor_is_refused_on_every_rank_naming_it_and_nothing_is_published(tmp_path):
    results = run_ranks(2, _partial, str(tmp_path / "store"), tmp=tmp_path)
    assert [r["refusal"] for r in results] == ["format", "format"], results
    assert all("'w'" in r["message"] and "partial" in r["message"] for r in results), results
    with Store(str(tmp_path / "store"), create=False) as s:
        assert s.list_refs("partial", "train") == []


def _partial(rank, world, store):
    from torch.distributed.tensor import DTensor, Partial
    mesh = init_device_mesh("cpu", (world,))
    Checkpointer(store, run="partial").save({"w": DTensor.from_local(torch.ones(4, 6), mesh, [Partial()])}, update=1)
    return {}


def test_contiguous_words_is_the_flat_range_of_a_box_or_none():
    assert contiguous_words((12, 5), (4, 0), (4, 5)) == (20, 40)
    assert contiguous_words((12, 5), (4, 0), (0, 5)) == (0, 0)
    assert contiguous_words((4, 6), (0, 3), (4, 3)) is None
    assert contiguous_words((1, 6), (0, 3), (1, 3)) == (3, 6)
    assert contiguous_words((2, 3, 4), (1, 1, 0), (1, 2, 4)) == (16, 24)
    assert contiguous_words((), (), ()) == (0, 1)


def test_box_ranges_are_the_rows_of_a_box_in_order_with_where_each_starts_in_the_box():
    assert box_ranges((12, 5), (4, 0), (4, 5)) == ((20, 40, 0),)
    assert box_ranges((4, 6), (0, 3), (4, 3)) == ((3, 6, 0), (9, 12, 3), (15, 18, 6), (21, 24, 9))
    assert box_ranges((2, 4, 6), (1, 2, 0), (1, 2, 3)) == ((36, 39, 0), (42, 45, 3))
    assert box_ranges((4, 6), (2, 0), (0, 6)) == ()


def _meshed(rank, world, store, mesh_shape, placements, save, publisher="star"):
    mesh = init_device_mesh("cpu", mesh_shape)
    full = {"w": torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6), "v": torch.arange(6, dtype=torch.float32).reshape(3, 2) - 7,
            "b": torch.arange(5 * 4 * 3, dtype=torch.float64).reshape(5, 4, 3)}
    ckpt = Checkpointer(store, run="mesh", publisher=publisher)
    if save:
        ckpt.save({k: distribute_tensor(t, mesh, placements) for k, t in full.items()}, update=1)
        return {}
    dest = {k: distribute_tensor(torch.zeros_like(t), mesh, placements) for k, t in full.items()}
    ckpt.restore(dest, root="latest")
    return {"equal": all(torch.equal(dest[k].full_tensor(), full[k]) for k in full)}


@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_a_2d_mesh_checkpoint_of_row_and_column_shards_restores_bit_for_bit_on_a_1d_mesh(tmp_path, publisher):
    store = str(tmp_path / "store")
    # FSDP x TP on a 2 x 2 mesh: rows over the first dimension, columns (TP row-wise) over the second.
    run_ranks(4, _meshed, store, (2, 2), [Shard(0), Shard(1)], True, publisher, tmp=tmp_path)
    # Columns on 2 ranks, rows on 3 ("b": 5 rows over 3: 2, 2, 1); Replicate is the one-process case below.
    results = run_ranks(2, _meshed, store, (2,), [Shard(1)], False, publisher, tmp=tmp_path)
    assert all(r["equal"] for r in results), results
    results = run_ranks(3, _meshed, store, (3,), [Shard(0)], False, publisher, tmp=tmp_path)
    assert all(r["equal"] for r in results), results


def test_an_hsdp_checkpoint_is_saved_once_per_shard_and_restores_on_any_mesh(tmp_path):
    store = str(tmp_path / "store")
    # Replicated over the first mesh dimension, sharded over the second: ranks 2 and 3 hold replicas.
    run_ranks(4, _meshed, store, (2, 2), [Replicate(), Shard(0)], True, tmp=tmp_path)
    results = run_ranks(4, _meshed, store, (4,), [Shard(1)], False, tmp=tmp_path)  # "v": 2 columns over 4 ranks
    assert all(r["equal"] for r in results), results
    with Store(store, create=False) as s:
        (ref,) = s.list_refs("mesh", "train")
        with open_generation(s, ref.root) as generation:  # each word stored once, not once per replica
            assert payload_bytes(generation) == 8 * 6 * 4 + 6 * 4 + 5 * 4 * 3 * 8


def _tp_model(mesh_shape):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    if len(mesh_shape) == 2:  # FSDP2 over tensor parallel, as torchtitan builds it
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", mesh_shape))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _fsdp_tp(rank, world, store, mesh_shape, save, expected):
    model, optim = _tp_model(mesh_shape)
    ckpt = Checkpointer(store, run="fsdp-tp")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    if save:
        for _ in range(2):
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
        ckpt.save(_state(model, optim, 2), update=2)
        full = full_state(model, optim)
        if rank == 0:
            torch.save(full, expected)
        return {}
    state = _state(model, optim, 0)
    ckpt.restore(state, root="latest")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"differ": differing(full_state(model, optim), torch.load(expected, weights_only=True))}


def test_an_fsdp2_over_tensor_parallel_checkpoint_on_a_2x2_mesh_restores_bit_for_bit_on_a_1d_mesh(tmp_path):
    store, expected = str(tmp_path / "store"), str(tmp_path / "expected.pt")
    run_ranks(4, _fsdp_tp, store, (2, 2), True, expected, tmp=tmp_path)  # _StridedShard and Shard(1) parameters
    results = run_ranks(2, _fsdp_tp, store, (2,), False, expected, tmp=tmp_path)
    assert all(r["differ"] == [] for r in results), results
