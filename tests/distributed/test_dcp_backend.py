"""torch.distributed.checkpoint (dcp.save / async_save / load) with alpha_ckpt's StorageWriter and StorageReader."""
import gc
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from alpha_ckpt import RefusalCode
from alpha_ckpt.dcp import StorageReader, StorageWriter, box_words, decode_metadata, encode_metadata
from alpha_ckpt.errors import Refusal
from alpha_ckpt.format.records import MAGIC
from alpha_ckpt.generation.reader import verify_generation
from alpha_ckpt.store import Store
from alpha_ckpt.testing import launch
from cli_in_process import alpha_ckpt_cli
from ranks import run_ranks
from sharded_training import differing, fsdp2_gpt, full_state, train

pytestmark = pytest.mark.timeout(180)


class Counter:
    """A Stateful object of the training script (DCP calls state_dict / load_state_dict)."""

    def __init__(self, n: int = 0):
        self.n, self.history = n, [n]

    def state_dict(self):
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd):
        self.n, self.history = sd["n"], list(sd["history"])


def _full(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _values_state(counter_n: int) -> dict:
    return {"model": {"w": _full(1, 6, 5), "b": _full(2, 5), "steps": torch.tensor(7, dtype=torch.int64)},
            "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0, 1],
                                        "foreach": None, "name": "decay"}]},
            "progress": {"step": 12, "tokens": 2 ** 70, "tag": "nightly"},
            "app": Counter(counter_n)}


def _save_and_load_values(rank, world, store):
    state = _values_state(5)
    meta = dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1))
    root = meta.storage_meta.checkpoint_id
    dest = {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(5), "steps": torch.tensor(0, dtype=torch.int64)},
            "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "eps": 0.0, "params": [], "foreach": True,
                                        "name": ""}]},
            "progress": {"step": 0, "tokens": 0, "tag": ""}, "app": Counter(0)}  # DCP loads the keys it is given
    dcp.load(dest, storage_reader=StorageReader(store, run="r"))
    want = _values_state(5)
    same_tensors = all(torch.equal(dest["model"][k], want["model"][k]) for k in want["model"])
    return {"root": root, "tensors": same_tensors, "optim": dest["optim"] == want["optim"],
            "progress": dest["progress"] == want["progress"], "app": dest["app"].state_dict()}


def test_a_nested_state_with_values_and_a_stateful_round_trips_through_dcp_as_one_generation(tmp_path):
    store = str(tmp_path / "store")
    results = run_ranks(2, _save_and_load_values, store, tmp=tmp_path)
    assert results[0]["root"] == results[1]["root"] and len(results[0]["root"]) == 64
    for r in results:
        assert r["tensors"] and r["optim"] and r["progress"], r
        assert r["app"] == {"n": 5, "history": [5]}
    with Store(store, create=False) as s:
        (ref,) = s.list_refs("r", "train")
        assert ref.root == results[0]["root"] and ref.owners == 2
        with verify_generation(s, ref.root) as generation:  # every byte validates
            assert {r.name for r in generation.manifest.regions} == {"model.w", "model.b", "model.steps"}
    # Nothing pickled on disk: every object is a shard or manifest of our format, values included.
    objects = [p for p in (Path(store) / "objects").rglob("*") if p.is_file()]
    assert objects and all(p.read_bytes().startswith(MAGIC) for p in objects)


def _mesh(world):
    return init_device_mesh("cpu", (world,))


def _sharded(world, placement):
    mesh = _mesh(world)
    return {"emb": distribute_tensor(_full(3, 10, 6), mesh, [placement]),  # 10 rows: uneven on 3 and 4 ranks
            "proj": distribute_tensor(_full(4, 4, 9), mesh, [Shard(1)]),
            "norm": distribute_tensor(_full(5, 6), mesh, [Replicate()]),
            "step": torch.tensor(3.0)}


def _save_sharded(rank, world, store):
    # One row of "emb" per slice: a resharded load reads the slices of its rows only.
    writer = StorageWriter(store, run="r", update=1, slice_bytes=6 * 4)
    meta = dcp.save(_sharded(world, Shard(0)), storage_writer=writer)
    return meta.storage_meta.checkpoint_id


def _load_sharded(rank, world, store, root, placement):
    if world == 1:
        dest = {"emb": torch.zeros(10, 6), "proj": torch.zeros(4, 9), "norm": torch.zeros(6), "step": torch.tensor(0.0)}
    else:
        mesh = _mesh(world)
        dest = {"emb": distribute_tensor(torch.zeros(10, 6), mesh, [placement]),
                "proj": distribute_tensor(torch.zeros(4, 9), mesh, [Shard(0)]),
                "norm": distribute_tensor(torch.zeros(6), mesh, [Replicate()]), "step": torch.tensor(0.0)}
    reader = StorageReader(store, root)
    dcp.load(dest, storage_reader=reader)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in dest.items()}
    want = {"emb": _full(3, 10, 6), "proj": _full(4, 4, 9), "norm": _full(5, 6), "step": torch.tensor(3.0)}
    # A load of "emb" alone: what this rank read of it.
    reader = StorageReader(store, root)
    dcp.load({"emb": dest["emb"]}, storage_reader=reader)
    return {"equal": all(torch.equal(full[k], want[k]) for k in want), "emb_bytes_read": reader.bytes_read}


@pytest.mark.parametrize("world,placement", [(1, None), (4, Shard(0)), (4, Shard(1)), (3, Replicate())])
def test_dtensors_saved_on_two_ranks_load_bit_for_bit_on_any_world_size_and_placement(tmp_path, world, placement):
    store = str(tmp_path / "store")
    roots = run_ranks(2, _save_sharded, store, tmp=tmp_path)
    assert roots[0] == roots[1]
    results = run_ranks(world, _load_sharded, store, roots[0], placement, tmp=tmp_path)
    assert all(r["equal"] for r in results), results
    if world == 4 and placement == Shard(0):
        # Each rank reads exactly its rows of "emb": DTensor splits 10 rows as 3, 3, 3, 1 (saved as 5 + 5).
        assert [r["emb_bytes_read"] for r in results] == [rows * 6 * 4 for rows in (3, 3, 3, 1)]


def _save_twice_then_flip(rank, world, store):
    state = {"w": _full(1, 64, 8), "v": _full(2, 16)}
    dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1))
    state["w"].add_(1)
    meta = dcp.save(state, storage_writer=StorageWriter(store, run="r", update=2))
    return meta.storage_meta.checkpoint_id


def _load_flipped(rank, world, store, root):
    dest = {"w": torch.full((64, 8), 7.0), "v": torch.full((16,), 7.0)}
    try:
        dcp.load(dest, storage_reader=StorageReader(store, root))
    except CheckpointException as exc:
        codes = sorted({e.code.value for e, _ in exc.failures.values() if isinstance(e, Refusal)})
        untouched = bool((dest["w"] == 7.0).all() and (dest["v"] == 7.0).all())
        return {"raised": True, "codes": codes, "untouched": untouched}
    return {"raised": False}


def test_a_flipped_byte_in_any_object_makes_dcp_load_raise_on_every_rank_with_nothing_copied(tmp_path):
    store = str(tmp_path / "store")
    roots = run_ranks(2, _save_twice_then_flip, store, tmp=tmp_path)
    with Store(store, create=False) as s:
        refs = s.list_refs("r", "train")
        assert [r.generation for r in refs] == [1, 2]  # the previous generation is kept
        with verify_generation(s, roots[0]) as generation:
            shard = generation.manifest.shards[-1].digest
        path = Path(s.object_path(shard))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a payload byte of the last shard
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    results = run_ranks(2, _load_flipped, store, roots[0], tmp=tmp_path)
    for r in results:
        assert r["raised"] and r["codes"] == [RefusalCode.CORRUPT_SHARD.value], results
        assert r["untouched"], results


def test_latest_skips_a_newest_generation_missing_an_object_and_refuses_one_whose_payload_is_damaged(tmp_path):
    # "latest" is chosen from refs and heads alone (no rank hashes a whole generation to choose):
    # a newest generation whose object is gone is skipped by every rank together; a damaged payload
    # byte is found by the rank that reads it, and every rank refuses before copying anything.
    store = str(tmp_path / "store")
    roots = run_ranks(2, _save_twice_then_flip, store, tmp=tmp_path)
    with Store(store, create=False) as s:
        with verify_generation(s, roots[0]) as generation:
            path = Path(s.object_path(generation.manifest.shards[-1].digest))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    refused = run_ranks(2, _load_latest, store, tmp=tmp_path)
    assert refused == [{"codes": [RefusalCode.CORRUPT_SHARD.value], "untouched": True}] * 2, refused
    path.unlink()
    fell_back = run_ranks(2, _load_latest, store, tmp=tmp_path)
    assert fell_back == [{"update": 1, "equal": True}] * 2, fell_back
    with Store(store, create=False) as s:
        assert [r.generation for r in s.list_refs("r", "train")] == [1, 2]  # nothing removed or rewritten


def _load_latest(rank, world, store):
    dest = {"w": torch.full((64, 8), 7.0), "v": torch.full((16,), 7.0)}
    reader = StorageReader(store, "latest", run="r")
    try:
        dcp.load(dest, storage_reader=reader)
    except CheckpointException as exc:
        codes = sorted({e.code.value for e, _ in exc.failures.values() if isinstance(e, Refusal)})
        return {"codes": codes, "untouched": bool((dest["w"] == 7.0).all() and (dest["v"] == 7.0).all())}
    return {"update": reader.prefix.update,
            "equal": torch.equal(dest["w"], _full(1, 64, 8)) and torch.equal(dest["v"], _full(2, 16))}


def test_a_save_at_an_update_that_goes_backwards_is_refused_and_the_history_is_unchanged(tmp_path):
    store = str(tmp_path / "store")
    run_ranks(1, _save_twice_then_flip, store, tmp=tmp_path)
    results = run_ranks(1, _save_at, store, 2, tmp=tmp_path)
    assert results == [[RefusalCode.RESET_CURSOR.value]]
    with Store(store, create=False) as s:
        assert [r.generation for r in s.list_refs("r", "train")] == [1, 2]


def _save_at(rank, world, store, update):
    try:
        dcp.save({"w": torch.ones(3)}, storage_writer=StorageWriter(store, run="r", update=update))
    except CheckpointException as exc:
        return sorted({e.code.value for e, _ in exc.failures.values() if isinstance(e, Refusal)})
    return []


def _async_save(rank, world, store):
    state = {"w": _full(1, 32, 4), "progress": {"step": 1}}
    future = dcp.async_save(state, storage_writer=StorageWriter(store, run="r", update=1))
    state["w"].add_(100)  # after the call: the staged copy is what is saved
    root = future.result().storage_meta.checkpoint_id
    dest = {"w": torch.zeros(32, 4), "progress": {"step": 0}}
    dcp.load(dest, storage_reader=StorageReader(store, root))
    return {"root": root, "equal": torch.equal(dest["w"], _full(1, 32, 4)), "progress": dest["progress"]}


def test_async_save_publishes_the_state_staged_at_the_call(tmp_path):
    results = run_ranks(2, _async_save, str(tmp_path / "store"), tmp=tmp_path)
    assert results[0]["root"] == results[1]["root"]
    assert all(r["equal"] and r["progress"] == {"step": 1} for r in results), results


def test_dcp_metadata_round_trips_through_typed_json_and_hostile_json_is_refused():
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan, create_default_local_save_plan
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    sd, mappings = flatten_state_dict({"a": {"w": torch.ones(2, 3, dtype=torch.bfloat16)}, "n": 3})
    plan = create_default_local_save_plan(sd, True)
    _, metadata = create_default_global_save_plan([plan.__class__(plan.items, planner_data=mappings)])
    decoded = decode_metadata(encode_metadata(metadata))
    assert decoded.state_dict_metadata == metadata.state_dict_metadata
    assert decoded.planner_data == metadata.planner_data
    for hostile in ({}, {"state_dict_metadata": [["x", {"tensor": {"dtype": "complex64"}}]]},
                    {**encode_metadata(metadata), "storage_data": [[["x", [-1]], {}]]}):
        with pytest.raises(Refusal) as raised:
            decode_metadata(hostile)
        assert raised.value.code == RefusalCode.FORMAT


def test_box_words_is_the_first_to_last_word_of_a_box_and_exact_for_row_blocks():
    assert box_words((10, 6), (3, 0), (3, 6)) == (18, 36)
    assert box_words((4, 9), (0, 5), (4, 4)) == (5, 36)
    assert box_words((4, 9), (1, 0), (0, 9)) == (0, 0)
    assert box_words((), (), ()) == (0, 1)


_KILLED_SAVE = textwrap.dedent('''
    import os, signal, sys
    from datetime import timedelta
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from alpha_ckpt.dcp import StorageWriter

    class DiesAfterWriting(StorageWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            os.kill(os.getpid(), signal.SIGKILL)  # its shards are durable; the ref is not out

    rank, store, rendezvous = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    state = {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64) + rank * 0, "step": torch.tensor(1)}
    dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1))
    state["w"].add_(1)
    writer = DiesAfterWriting if rank == 1 else StorageWriter
    try:
        dcp.save(state, storage_writer=writer(store, run="r", update=2))
    except BaseException as exc:  # rank 0: its peer is gone
        print("rank 0 failed:", type(exc).__name__, flush=True)
        os._exit(9)
    os._exit(0)
''')


def test_a_rank_killed_during_dcp_save_leaves_the_previous_generation_newest_and_verifiable(tmp_path):
    store, script = str(tmp_path / "store"), tmp_path / "killed_save.py"
    script.write_text(_KILLED_SAVE)
    rendezvous = str(tmp_path / "rendezvous")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store, rendezvous], env=launch.child_env())
             for r in range(2)]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes[1] == -signal.SIGKILL and codes[0] != 0
    with Store(store, create=False) as s:
        refs = s.list_refs("r", "train")
        assert [r.generation for r in refs] == [1] and refs[0].prefix.update == 1
        with verify_generation(s, refs[0].root):
            pass
    # The store goes on: the next save publishes generation 2 after generation 1.
    results = run_ranks(2, _save_at, store, 2, tmp=tmp_path)
    assert results == [[], []]
    with Store(store, create=False) as s:
        assert [r.prefix.update for r in s.list_refs("r", "train")] == [1, 2]


def _fsdp2_save(rank, world, store, out):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, optim = fsdp2_gpt(world)
    train(model, optim, 3, 0)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd},
             storage_writer=StorageWriter(store, run="gpt", update=3, allow_nonfinite=["*.causal_mask"]))
    full = full_state(model, optim)
    losses = train(model, optim, 2, 3)
    if rank == 0:
        torch.save({"full": full, "losses": losses}, out)  # the test's own expectation, not a checkpoint
    return losses


def _fsdp2_load(rank, world, store, expected):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, optim = fsdp2_gpt(world)
    train(model, optim, 1, 40)  # another state (and optimizer moments to overwrite)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=StorageReader(store, run="gpt"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    want = torch.load(expected, weights_only=True)
    differ = differing(full_state(model, optim), want["full"])
    losses = train(model, optim, 2, 3)
    return {"equal": not differ, "differ": differ[:5], "continued": losses == want["losses"]}


@pytest.fixture(scope="module")
def fsdp2_saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2-dcp")
    store, expected = str(tmp / "store"), str(tmp / "expected.pt")
    run_ranks(2, _fsdp2_save, store, expected, tmp=tmp)
    return store, expected


@pytest.mark.parametrize("world", [1, 2, 3])
def test_an_fsdp2_gpt_with_adamw_saved_through_dcp_on_two_ranks_restores_bit_for_bit_on_any_world(tmp_path, fsdp2_saved,
                                                                                                   world):
    store, expected = fsdp2_saved
    results = run_ranks(world, _fsdp2_load, store, expected, tmp=tmp_path)
    assert all(r["equal"] for r in results), results
    if world == 2:  # the same sharding: training goes on exactly as the uninterrupted run did
        assert all(r["continued"] for r in results), results


def test_verify_inspect_and_export_work_on_a_dcp_checkpoint_and_export_gives_whole_tensors(tmp_path):
    from safetensors.torch import load_file
    store = str(tmp_path / "store")
    root = run_ranks(2, _save_sharded, store, tmp=tmp_path)[0]
    assert alpha_ckpt_cli("verify", "--store", store, root).returncode == 0
    assert alpha_ckpt_cli("inspect", "--store", store, "--json", root).returncode == 0
    out = tmp_path / "model.safetensors"
    assert alpha_ckpt_cli("export", "--store", store, "--to", out, root).returncode == 0
    tensors = load_file(out)
    want = {"emb": _full(3, 10, 6), "proj": _full(4, 4, 9), "norm": _full(5, 6), "step": torch.tensor(3.0)}
    assert sorted(tensors) == sorted(want) and all(torch.equal(tensors[k], want[k]) for k in want)


def test_a_nan_in_one_ranks_chunk_refuses_the_dcp_save_on_every_rank_and_publishes_nothing(tmp_path):
    store = str(tmp_path / "store")
    results = run_ranks(2, _save_nan_sharded, store, tmp=tmp_path)
    assert [r["codes"] for r in results] == [[RefusalCode.NON_FINITE.value]] * 2
    # The coordinator's lease (gc spares objects while one is held) is given back with the failed save's writer.
    assert [r["leases"] for r in results] == [[], []]
    with Store(store, create=False) as s:
        assert [r.prefix.update for r in s.list_refs("r", "train")] == [1]


def _save_nan_sharded(rank, world, store):
    state = {"w": distribute_tensor(_full(1, 8, 4), _mesh(world), [Shard(0)]), "mask": torch.full((4,), float("-inf"))}
    dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1, allow_nonfinite=["mask"]))
    if rank == 1:
        state["w"].to_local()[0, 3] = float("nan")
    codes = []
    try:
        dcp.save(state, storage_writer=StorageWriter(store, run="r", update=2, allow_nonfinite=["mask"]))
    except CheckpointException as exc:
        codes = sorted({e.code.value for e, _ in exc.failures.values() if isinstance(e, Refusal)})
    # The coordinator learns another rank's failure only from DCP's exception (the writer runs no collective
    # of its own): its lease goes with the writer, which that exception's traceback holds in a cycle.
    gc.collect()
    dist.barrier()
    return {"codes": codes, "leases": os.listdir(os.path.join(store, "pending"))}


def _save_and_load_alone_on(rank, world, store, alone):
    """Only rank ``alone`` saves and loads, with no_dist=True, beside a process group of every rank."""
    out = {}
    if rank == alone:
        state = {"w": _full(3, 64, 8), "steps": 7}
        root = dcp.save(state, storage_writer=StorageWriter(store, run="solo", update=1),
                        no_dist=True).storage_meta.checkpoint_id
        dest = {"w": torch.zeros(64, 8), "steps": 0}
        dcp.load(dest, storage_reader=StorageReader(store, root), no_dist=True)
        with Store(store, create=False) as s:
            out = {"equal": torch.equal(dest["w"], state["w"]) and dest["steps"] == 7,
                   "owners": s.find_ref(root).owners}
    dist.barrier()  # the other ranks wait here: a save or load that waited for them would never return
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alone", [0, 1])
def test_one_rank_saves_and_loads_alone_with_no_dist_beside_a_process_group(tmp_path, alone):
    results = run_ranks(2, _save_and_load_alone_on, str(tmp_path / "store"), alone, tmp=tmp_path, timeout=60)
    assert results[alone] == {"equal": True, "owners": 1}


def test_a_ranks_chunks_go_into_shards_of_at_most_the_limit_and_a_larger_one_alone():
    from alpha_ckpt.generation.writer import group_parts
    parts = [(i, b"x" * n, "raw") for i, n in enumerate([3, 4, 10, 2, 2])]
    assert [[p[0] for p in shard] for shard in group_parts(parts, 6)] == [[0], [1], [2], [3, 4]]
    assert group_parts([], 6) == []


def test_a_ranks_slices_go_into_shards_of_at_most_shard_bytes_and_load_back_whole(tmp_path):
    store = str(tmp_path / "store")
    state = {"w": torch.arange(40_000, dtype=torch.float32), "b": torch.ones(10)}
    root = dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1, slice_bytes=16 << 10,
                                                        shard_bytes=48 << 10),  # 48 KiB stands in for 32 MiB
                    no_dist=True).storage_meta.checkpoint_id
    with Store(store, create=False) as s, verify_generation(s, root) as generation:
        raw = [sum((hi - lo) * 4 for _, lo, hi in shard.slices) for shard in generation.manifest.shards]
    # w: nine 16 KiB slices and one of 12,544 bytes, b: 40 bytes; three slices per shard at most
    assert sorted(raw) == sorted([3 * 16384] * 3 + [12_544 + 40]), raw
    dest = {"w": torch.zeros(40_000), "b": torch.zeros(10)}
    dcp.load(dest, storage_reader=StorageReader(store, root), no_dist=True)
    assert torch.equal(dest["w"], state["w"]) and torch.equal(dest["b"], state["b"])


def test_a_shard_of_small_slices_hands_all_its_payload_to_writeback_before_its_fsync(tmp_path, monkeypatch):
    # DCP's 4 MiB slices are each under the writeback threshold: unless runs of them start writeback,
    # a shard's whole size is left dirty for its fsync to write (measured: 0.4 s of a 0.6 s save).
    from alpha_ckpt.store import durable
    from alpha_ckpt.generation import writer
    monkeypatch.setattr(writer, "_WRITEBACK_MIN_BYTES", 32 << 10)  # stands in for 8 MiB
    handed: dict[int, list[tuple[int, int]]] = {}
    monkeypatch.setattr(durable, "start_writeback",
                        lambda fd, offset, length: handed.setdefault(os.fstat(fd).st_ino, []).append((offset, length)))
    store = str(tmp_path / "store")
    state = {"w": torch.arange(60_000, dtype=torch.float32)}
    root = dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1, slice_bytes=16 << 10,
                                                        shard_bytes=96 << 10),  # 96 KiB stands in for 32 MiB
                    no_dist=True).storage_meta.checkpoint_id
    with Store(store, create=False) as s, verify_generation(s, root) as generation:
        digests = [shard.digest for shard in generation.manifest.shards]
    payload = 0
    for digest in digests:
        path = next(Path(store, "objects").rglob(digest))
        size = path.stat().st_size
        covered = set()
        for offset, length in handed.get(path.stat().st_ino, []):
            assert 0 <= offset and offset + length <= size
            covered.update(range(offset >> 12, (offset + length + 4095) >> 12))  # 4 KiB pages
        # every page from the first slice's to the end was handed over (the head at 0 is written last)
        assert set(range(1, (size + 4095) >> 12)) <= covered, (digest, size, sorted(covered))
        payload += size
    assert payload >= 240_000


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _descriptors_over_saves_and_loads(rank, world, store):
    # DCP makes a writer and a reader per checkpoint, as a training loop does; each opens the store by
    # its path. A store's directories (root, objects/ and its fans, tmp/, pending/) held past the save
    # would pile up with every checkpoint of a long run.
    w = _full(3, 256, 64)
    counts = []
    for update in range(1, 5):
        w.add_(1)
        root = dcp.save({"w": w}, storage_writer=StorageWriter(store, run="r", update=update)).storage_meta.checkpoint_id
        dest = {"w": torch.zeros(256, 64)}
        dcp.load(dest, storage_reader=StorageReader(store, root))
        assert torch.equal(dest["w"], w)
        counts.append(_open_descriptors())
    return counts


def test_dcp_saves_and_loads_by_store_path_hold_no_descriptors_from_one_checkpoint_to_the_next(tmp_path):
    results = run_ranks(2, _descriptors_over_saves_and_loads, str(tmp_path / "store"), tmp=tmp_path)
    for counts in results:  # the coordinator and the other rank alike
        assert counts == [counts[0]] * len(counts), counts


def test_a_store_handle_dropped_without_close_gives_its_descriptors_back(tmp_path):
    Store(tmp_path / "store").close()  # created once
    before = _open_descriptors()
    store = Store(tmp_path / "store")
    store.pending_publish("r", "s").release()  # opens pending/ too
    assert _open_descriptors() >= before + 4
    del store
    assert _open_descriptors() == before


# ---------------------------------------------------------------- metadata, history and exit codes the backend checks


def _refusal_codes(exc: CheckpointException) -> list[str]:
    return sorted({e.code.value for e, _ in exc.failures.values() if isinstance(e, Refusal)})


def _forge(state, store, root, kind):
    """Republish ``root`` with its DCP Metadata altered (every digest valid again)."""
    from alpha_ckpt.testing.forge import republish_with_metadata

    def edit(metadata):
        dcp_meta = metadata["dcp"]
        entries = dict(dcp_meta["state_dict_metadata"])
        items = dcp_meta["storage_data"]
        by_fqn = {index[0]: data for index, data in items}
        if kind == "swapped-regions":  # a's chunk names b's region and b's names a's (both [4, 3] float32)
            by_fqn["a"]["region"], by_fqn["b"]["region"] = by_fqn["b"]["region"], by_fqn["a"]["region"]
        elif kind == "negative-region":  # Python would index the last region
            by_fqn["a"]["region"] = -1
        elif kind == "duplicate-storage-key":  # a second item for a's chunk, naming b's region
            items.append([["a", [0, 0]], {"region": by_fqn["b"]["region"]}])
        elif kind == "dropped-chunk":  # "a" says it is [8, 3]: rows 4-7 were never saved
            entries["a"]["tensor"]["size"] = [8, 3]
        elif kind == "out-of-bounds-chunk":  # a's one chunk moved to rows 6-9 of a [4, 3] tensor
            entries["a"]["tensor"]["chunks"] = [[[6, 0], [4, 3]]]
            next(index for index, _ in items if index[0] == "a")[1] = [6, 0]
        dcp_meta["state_dict_metadata"] = [[k, v] for k, v in entries.items()]
        return metadata
    with Store(store, create=False) as s:
        return republish_with_metadata(s, root, edit)


FORGERIES = {"swapped-regions": "format", "negative-region": "coverage", "duplicate-storage-key": "format",
             "dropped-chunk": "coverage", "out-of-bounds-chunk": "coverage"}


@pytest.mark.parametrize("kind", sorted(FORGERIES))
def test_forged_dcp_metadata_with_digests_repaired_is_refused_by_load_verify_and_export(tmp_path, kind):
    store = str(tmp_path / "store")
    state = {"a": _full(1, 4, 3), "b": _full(2, 4, 3), "n": 5}
    root = dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1), no_dist=True).storage_meta.checkpoint_id
    forged = _forge(state, store, root, kind)
    dest = {"a": torch.full((4, 3), 7.0), "b": torch.full((4, 3), 7.0), "n": 0}
    with pytest.raises(CheckpointException) as raised:
        dcp.load(dest, storage_reader=StorageReader(store, forged), no_dist=True)
    assert _refusal_codes(raised.value) == [FORGERIES[kind]]
    assert bool((dest["a"] == 7.0).all() and (dest["b"] == 7.0).all()) and dest["n"] == 0  # nothing copied
    verified = alpha_ckpt_cli("verify", "--store", store, forged)
    assert verified.returncode == 3 and FORGERIES[kind] in verified.stdout + verified.stderr
    out = tmp_path / "forged.safetensors"
    assert alpha_ckpt_cli("export", "--store", store, "--to", out, forged).returncode == 3
    assert not out.exists()
    assert alpha_ckpt_cli("verify", "--store", store, root).returncode == 0  # the original is intact


def _save_own_shard_alone(rank, world, store):
    state = {"w": distribute_tensor(_full(1, 8, 4), _mesh(world), [Shard(0)])}
    codes = None
    if rank == 0:
        try:
            dcp.save(state, storage_writer=StorageWriter(store, run="solo", update=1), no_dist=True)
            codes = []
        except CheckpointException as exc:
            codes = _refusal_codes(exc)
    dist.barrier()
    return codes


def test_a_no_dist_save_of_one_ranks_dtensor_shard_is_refused_before_anything_is_published(tmp_path):
    store = str(tmp_path / "store")
    results = run_ranks(2, _save_own_shard_alone, store, tmp=tmp_path)
    assert results[0] == [RefusalCode.COVERAGE.value]  # rows 4-7 are rank 1's: no load could restore them
    with Store(store) as s:
        assert s.list_refs("solo", "train") == []


def _async_save_beside_training(rank, world, store):
    pg = dist.new_group(backend="gloo")  # DCP's group; training all_reduces on the default group meanwhile
    state = {"w": _full(1, 1024, 1024), "b": _full(2, 64), "progress": {"step": 1}}
    future = dcp.async_save(state, storage_writer=StorageWriter(store, run="r", update=1), process_group=pg)
    steps = 0
    while True:  # a training step's collective, until the save is done on every rank
        done = torch.tensor([float(future.done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        steps += 1
        if done.item() == 1.0:
            break
    t = torch.ones(1)
    dist.all_reduce(t)  # the default group still answers in step after it
    root = future.result().storage_meta.checkpoint_id
    dest = {"w": torch.zeros(1024, 1024), "b": torch.zeros(64), "progress": {"step": 0}}
    dcp.load(dest, storage_reader=StorageReader(store, root))
    return {"root": root, "equal": torch.equal(dest["w"], state["w"]) and torch.equal(dest["b"], state["b"]),
            "in_step": t.item() == world, "steps": steps}


@pytest.mark.timeout(120)
def test_async_save_over_its_own_process_group_runs_beside_training_collectives_on_the_default_group(tmp_path):
    results = run_ranks(2, _async_save_beside_training, str(tmp_path / "store"), tmp=tmp_path, timeout=90)
    assert results[0]["root"] == results[1]["root"]
    assert all(r["equal"] and r["in_step"] for r in results), results
    assert results[0]["steps"] == results[1]["steps"]


def _two_jobs(rank, world, store, resume):
    """Rank 0 and rank 1 are two jobs of one run, each saving alone (no_dist): A, then B, then A again."""
    def save(update):
        try:
            dcp.save({"w": torch.full((4,), float(update))}, no_dist=True,
                     storage_writer=StorageWriter(store, run="r", update=update))
            return []
        except CheckpointException as exc:
            return _refusal_codes(exc)
    out = {}
    if rank == 0:
        out["a1"] = save(1)
    dist.barrier()
    if rank == 1:
        if resume:  # B resumes the run as a continuation (the next epoch)
            dest = {"w": torch.zeros(4)}
            dcp.load(dest, storage_reader=StorageReader(store, run="r"), no_dist=True)
        out["b2"] = save(2)
    dist.barrier()
    if rank == 0:
        out["a3"] = save(3)
    dist.barrier()
    return out


@pytest.mark.parametrize("resume,code", [(False, "fenced"), (True, "stale-epoch")])
def test_a_second_job_saving_through_dcp_into_one_run_fences_the_first(tmp_path, resume, code):
    store = str(tmp_path / "store")
    a, b = run_ranks(2, _two_jobs, store, resume, tmp=tmp_path)
    assert a == {"a1": [], "a3": [code]} and b == {"b2": []}
    with Store(store, create=False) as s:
        refs = s.list_refs("r", "train")
    assert [(r.prefix.update, r.prefix.epoch) for r in refs] == [(1, 0), (2, 1 if resume else 0)]


def _save_differing_replicas(rank, world, store, name):
    # DDP with BatchNorm: the weights are the same on every rank, the running statistics are not
    # (nor is a per-rank data loader's position saved under one name).
    state = {"model": {"w": _full(1, 4, 3), "bn.running_mean": torch.full((3,), 1.0)}, "loader": {"seen": 8}}
    if name == "model.bn.running_mean":
        state["model"]["bn.running_mean"] += rank
    else:
        state["loader"]["seen"] += rank
    try:
        dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1))
    except CheckpointException as exc:
        refusals = [e for e, _ in exc.failures.values() if isinstance(e, Refusal)]
        return {"codes": _refusal_codes(exc), "named": all(repr(name) in e.message for e in refusals)}
    return {"codes": []}


@pytest.mark.parametrize("name", ["model.bn.running_mean", "loader.seen"])
def test_a_replicated_entry_that_differs_across_ranks_refuses_the_dcp_save_naming_it(tmp_path, name):
    store = str(tmp_path / "store")
    results = run_ranks(2, _save_differing_replicas, store, name, tmp=tmp_path)
    assert results == [{"codes": [RefusalCode.MIXED_CAPTURE.value], "named": True}] * 2
    with Store(store, create=False) as s:
        assert s.list_refs("r", "train") == []


def test_a_storage_writer_refuses_a_negative_cursor_at_construction():
    with pytest.raises(ValueError):
        StorageWriter("unused", run="r", update=1, cursor=-5)


def test_a_bare_string_allow_nonfinite_is_one_pattern_in_the_storage_writer(tmp_path):
    store = str(tmp_path / "store")
    state = {"mask": torch.full((3,), float("-inf")), "w": torch.tensor([1.0, float("nan")])}
    with pytest.raises(CheckpointException) as raised:  # "*.mask" is not "*", ".", "m", ...: w's NaN is refused
        dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1, allow_nonfinite="mask"), no_dist=True)
    assert _refusal_codes(raised.value) == [RefusalCode.NON_FINITE.value]
    state["w"][1] = 0.0
    root = dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1, allow_nonfinite="mask"),
                    no_dist=True).storage_meta.checkpoint_id
    assert alpha_ckpt_cli("verify", "--store", store, root).returncode == 0


def _fewer_rows_than_ranks(rank, world, store):
    mesh = _mesh(world)
    state = {"head": distribute_tensor(_full(6, 1, 5), mesh, [Shard(0)]),  # one rank's shard is empty
             "tail": distribute_tensor(_full(7, 5, 1), mesh, [Shard(1)])}
    root = dcp.save(state, storage_writer=StorageWriter(store, run="r", update=1)).storage_meta.checkpoint_id
    dest = {"head": distribute_tensor(torch.zeros(1, 5), mesh, [Shard(0)]),
            "tail": distribute_tensor(torch.zeros(5, 1), mesh, [Shard(1)])}
    dcp.load(dest, storage_reader=StorageReader(store, root))
    return {"root": root, "equal": torch.equal(dest["head"].full_tensor(), _full(6, 1, 5))
            and torch.equal(dest["tail"].full_tensor(), _full(7, 5, 1))}


def test_dtensors_with_fewer_rows_than_ranks_save_verify_and_load_through_dcp(tmp_path):
    store = str(tmp_path / "store")
    results = run_ranks(2, _fewer_rows_than_ranks, store, tmp=tmp_path)
    assert all(r["equal"] for r in results), results
    assert alpha_ckpt_cli("verify", "--store", store, results[0]["root"]).returncode == 0


def test_dcp_chunks_must_tile_their_tensor_exactly_empty_chunks_included():
    from alpha_ckpt.dcp import check_chunks

    def code(size, chunks):
        try:
            check_chunks("x", size, chunks)
        except Refusal as refusal:
            return refusal.code.value
        return None
    assert code((10, 6), [((0, 0), (5, 6)), ((5, 0), (5, 6))]) is None       # Shard(0)
    assert code((4, 9), [((0, 0), (4, 5)), ((0, 5), (4, 4))]) is None        # Shard(1), uneven
    assert code((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))]) is None  # 2-D mesh
    assert code((1, 5), [((0, 0), (1, 5)), ((1, 0), (0, 5))]) is None        # an empty shard
    assert code((), [((), ())]) is None and code((0, 3), []) is None
    assert code((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 3))]) == "coverage"  # a gap
    assert code((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((1, 1), (2, 2))]) == "coverage"
    assert code((4, 4), [((0, 0), (4, 4)), ((0, 0), (4, 4))]) == "coverage"  # the same chunk twice
    assert code((4, 4), [((0, 0), (2, 4)), ((2, 0), (3, 4))]) == "coverage"  # past the end
    assert code((4,), [((-1,), (4,))]) == "coverage"
    assert code((), [((), ()), ((), ())]) == "coverage"
    assert code((4,), [((0, 0), (4, 4))]) == "format"


def _save_and_load_over_a_subgroup(rank, world, store, marker):
    import time
    solo = dist.new_group([0])  # DCP's process group, which neither storage object is told about
    out = {}
    if rank == 0:
        state = {"w": _full(3, 64, 8), "steps": 7}
        root = dcp.save(state, storage_writer=StorageWriter(store, run="sub", update=1),
                        process_group=solo).storage_meta.checkpoint_id
        dest = {"w": torch.zeros(64, 8), "steps": 0}
        dcp.load(dest, storage_reader=StorageReader(store, run="sub"), process_group=solo)
        out = {"root": root, "equal": torch.equal(dest["w"], state["w"]) and dest["steps"] == 7}
        Path(marker).write_text("done")
    else:  # busy with anything but a collective on the default group until rank 0 is done
        deadline = time.monotonic() + 45
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        out = {"waited_out": not os.path.exists(marker)}
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_dcp_save_and_load_over_a_process_group_of_their_own_run_no_collective_on_the_default_group(tmp_path):
    results = run_ranks(2, _save_and_load_over_a_subgroup, str(tmp_path / "store"), str(tmp_path / "marker"),
                        tmp=tmp_path, timeout=100)
    assert results[0]["equal"] and results[1] == {"waited_out": False}, results


def test_a_store_emptied_and_made_anew_in_one_process_takes_a_dcp_save_as_a_fresh_history(tmp_path):
    # The process's history of the run is fenced against the store it was saved in; a store removed and
    # created again at the same path (its directory may get the same inode) holds nothing to fork.
    import shutil
    store = tmp_path / "store"
    for update in (1, 2):
        dcp.save({"w": torch.ones(3) * update}, storage_writer=StorageWriter(str(store), run="r", update=update),
                 no_dist=True)
    shutil.rmtree(store)
    root = dcp.save({"w": torch.full((3,), 5.0)}, storage_writer=StorageWriter(str(store), run="r", update=1),
                    no_dist=True).storage_meta.checkpoint_id
    with Store(str(store), create=False) as s:
        assert [(r.generation, r.prefix.update, r.root) for r in s.list_refs("r", "train")] == [(1, 1, root)]
