"""A restore reads each object from the store once per node: replicated state is read by one rank of the
node and mapped by the others; per-rank objects by their owners. Counted by a wrapper around the store's
backend (tests/counting_backend.py), compared with every rank reading for itself, bit for bit."""
import hashlib
import os
from pathlib import Path

import pytest
import torch

from alpha_ckpt import Checkpointer, Store
from alpha_ckpt.store.layout import StoreLayout
from alpha_ckpt.store.posix import PosixBackend
from counting_backend import CountingBackend
from ranks import run_ranks

TENSORS, WORDS = 8, 256 << 10  # 8 replicated tensors of 1 MiB: an object each, spread over the readers


def _state(rank: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(WORDS, generator=g) for i in range(TENSORS)},
            "rank_stats": torch.full((1024,), float(rank + seed)),  # per rank: each rank's own
            "progress": {"step": seed}}


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state["model"]):
        h.update(state["model"][name].numpy().tobytes())
    h.update(state["rank_stats"].numpy().tobytes())
    return h.hexdigest()


def _save(rank, world, store_dir, publisher):
    ckpt = Checkpointer(store_dir, run="r", publisher=publisher, per_rank=["rank_stats"])
    ckpt.restore(_state(rank, 0), None)
    root = ckpt.save(_state(rank, 7), update=1, cursor=1).root
    ckpt.close()
    return root


def _backend(store_dir):
    if store_dir.startswith("s3://"):
        from alpha_ckpt.store.s3 import S3Backend
        return S3Backend(store_dir, True)
    return PosixBackend(StoreLayout(store_dir), True)


def _restore(rank, world, store_dir, share, nodes):
    if nodes > 1:  # a launcher per node sets its node rank (torchrun's GROUP_RANK) in its ranks
        os.environ["GROUP_RANK"] = str(rank * nodes // world)
    backend = CountingBackend(_backend(store_dir))
    state = _state(rank, 0)
    ckpt = Checkpointer(Store(backend), run="r", per_rank=["rank_stats"], share_reads=share)
    ckpt.restore(state, "latest")
    ckpt.close()
    return {"served": backend.bytes_served, "digest": _digest(state), "step": state["progress"]["step"],
            "pid": os.getpid()}


def _left_behind(results) -> list[str]:
    """The node's shared files of these ranks still in place (each reader removes its own)."""
    from alpha_ckpt.collective.node_reads import PREFIX, SHARED_PARENT
    pids = {r["pid"] for r in results}
    return [p.name for p in Path(SHARED_PARENT).glob(f"{PREFIX}*") if int(p.name[len(PREFIX):].split("-")[0]) in pids]


def _unique_bytes(store_dir) -> int:
    """Every object the newest generation names (manifests and shards), once: what one restore needs."""
    from alpha_ckpt.generation.reader import open_generation
    with Store(store_dir) as store:
        record = store.history("r", "train").records[-1]
        with open_generation(store, record.root, record) as generation:
            return (sum(obj.size for obj, _ in generation.shards.values())
                    + sum(m.size for m in generation.manifests))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,nodes,publisher", [(1, 1, "star"), (2, 1, "star"), (4, 1, "star"), (4, 2, "star"),
                                                   (4, 1, "tree")])
def test_a_restore_reads_each_object_once_per_node_and_restores_the_same_bits(tmp_path, world, nodes, publisher):
    store_dir = str(tmp_path / "s")
    run_ranks(world, _save, store_dir, publisher, tmp=tmp_path)
    unique = _unique_bytes(store_dir)
    shared = run_ranks(world, _restore, store_dir, True, nodes, tmp=tmp_path)
    alone = run_ranks(world, _restore, store_dir, False, nodes, tmp=tmp_path)
    expected = [_digest(_state(rank, 7)) for rank in range(world)]
    assert [r["digest"] for r in shared] == [r["digest"] for r in alone] == expected
    assert all(r["step"] == 7 for r in shared)
    assert not _left_behind(shared)
    per_node = world // nodes
    for node in range(nodes):
        served = sum(r["served"] for r in shared[node * per_node:(node + 1) * per_node])
        assert served <= 1.05 * unique, (served, unique)
    # Each rank reading for itself: every rank reads the replicated state (the baseline this replaces).
    if world > 1:
        assert sum(r["served"] for r in alone) >= (world - 0.5) * unique


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nodes", [1, 2])
def test_a_restore_from_s3_gets_each_object_once_per_node(tmp_path, s3_server, s3_store, nodes):
    env = s3_server.environment()
    run_ranks(4, _with, env, _save, s3_store, "star", tmp=tmp_path)
    unique = _unique_bytes(s3_store)
    shared = run_ranks(4, _with, env, _restore, s3_store, True, nodes, tmp=tmp_path)
    assert [r["digest"] for r in shared] == [_digest(_state(rank, 7)) for rank in range(4)]
    for node in range(nodes):
        served = sum(r["served"] for r in shared[node * 4 // nodes:(node + 1) * 4 // nodes])
        assert served <= 1.05 * unique, (served, unique)
    assert not _left_behind(shared)


def _with(rank, world, env, fn, *args):
    os.environ.update(env)  # a rank comes from the fork server, not from this test's environment
    return fn(rank, world, *args)


def _dcp_save(rank, world, store_dir):
    import torch.distributed.checkpoint as dcp
    from alpha_ckpt.dcp import StorageWriter
    meta = dcp.save(_state(rank, 7)["model"], storage_writer=StorageWriter(store_dir, run="r", update=1))
    return meta.storage_meta.checkpoint_id


def _dcp_load(rank, world, store_dir, root, share, nodes):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from alpha_ckpt.dcp import StorageReader
    if nodes > 1:
        os.environ["GROUP_RANK"] = str(rank * nodes // world)
    backend = CountingBackend(_backend(store_dir))
    dest = _state(rank, 0)["model"]
    dcp.load(dest, storage_reader=StorageReader(Store(backend), root, group=dist.group.WORLD if share else None))
    want = _state(rank, 7)["model"]
    return {"served": backend.bytes_served, "same": all(torch.equal(dest[k], want[k]) for k in want)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 1), (4, 2)])
def test_a_dcp_load_given_its_group_reads_each_object_once_per_node(tmp_path, world, nodes):
    store_dir = str(tmp_path / "s")
    (root, *_) = run_ranks(world, _dcp_save, store_dir, tmp=tmp_path)
    unique = _unique_bytes(store_dir)
    shared = run_ranks(world, _dcp_load, store_dir, root, True, nodes, tmp=tmp_path)
    alone = run_ranks(world, _dcp_load, store_dir, root, False, nodes, tmp=tmp_path)
    assert all(r["same"] for r in shared + alone)
    per_node = world // nodes
    for node in range(nodes):
        served = sum(r["served"] for r in shared[node * per_node:(node + 1) * per_node])
        assert served <= 1.05 * unique, (served, unique)
    assert sum(r["served"] for r in alone) >= (world - 0.5) * unique


def _restore_refused(rank, world, store_dir):
    state = _state(rank, 0)
    ckpt = Checkpointer(store_dir, run="r", per_rank=["rank_stats"])
    try:
        ckpt.restore(state, "latest")
        return {"refused": None, "pid": os.getpid()}
    except Exception as exc:  # the refusal every rank must raise
        return {"refused": getattr(getattr(exc, "code", None), "value", repr(exc)), "pid": os.getpid(),
                "untouched": _digest(state) == _digest(_state(rank, 0))}
    finally:
        ckpt.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["flipped-byte", "missing"])
def test_a_damaged_replicated_object_is_refused_on_every_rank_before_a_byte_is_copied(tmp_path, damage):
    from alpha_ckpt.generation.reader import open_generation
    store_dir = str(tmp_path / "s")
    run_ranks(4, _save, store_dir, "star", tmp=tmp_path)
    with Store(store_dir) as store:
        record = store.history("r", "train").records[-1]
        with open_generation(store, record.root, record) as generation:
            name = max(generation.shards, key=lambda d: generation.shards[d][0].size)  # a replicated tensor's
    path = next(p for p in (tmp_path / "s").rglob(name))
    if damage == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01  # a payload byte
        os.chmod(path, 0o644)
        path.write_bytes(bytes(data))
    results = run_ranks(4, _restore_refused, store_dir, tmp=tmp_path)
    code = "corrupt-shard" if damage == "flipped-byte" else "missing-shard"
    assert [r["refused"] for r in results] == [code] * 4, results
    assert all(r["untouched"] for r in results)
    assert not _left_behind(results)
