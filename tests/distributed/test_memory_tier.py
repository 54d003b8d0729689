"""The memory tier: saves held in host memory on peers, recovered bit for bit, or every rank falls back to the store."""
import os
import shutil
from pathlib import Path

import pytest

from alpha_ckpt import Checkpointer
from alpha_ckpt.generation.opening import open_generation
from alpha_ckpt.tiers.memory.tier import holder_directory, holders_of
from alpha_ckpt.store import RefRecord, Store
from ranks import run_ranks
from test_checkpointer import IDENTITY, MASKS, Script

pytestmark = pytest.mark.timeout(240)


def _of_rank(memory: str | None, rank: int) -> str | None:
    """The tier directory of ``rank``: "{rank}" in it gives every rank one of its own, as on separate nodes."""
    return memory.format(rank=rank) if memory else memory


def save_steps(rank, world, store, memory, steps, durable_every, replicas=1):
    """Train ``steps`` steps with a save each; the process then ends without close(), as a killed one would."""
    script = Script(rank, world)
    ckpt = Checkpointer(store, run="r", identity=IDENTITY, allow_nonfinite=MASKS, memory=_of_rank(memory, rank),
                        durable_every=durable_every, replicas=replicas)
    assert ckpt.restore(script.state(), root=None) is None
    saves = []
    for _ in range(steps):
        script.train(1)
        result = ckpt.save(script.state(), update=script.step, cursor=script.step * 4 * world)
        saves.append({"root": result.root, "tier": ckpt.last_save["tier"], "memory_ok": ckpt.last_save.get("memory_ok"),
                      "held": ckpt.last_save.get("memory_held_bytes")})
    return {"saves": saves, "digest": script.digest(), "losses": script.losses}


def resume(rank, world, store, memory, steps, per_rank="keep"):
    script = Script(rank, world)
    ckpt = Checkpointer(store, run="r", identity=IDENTITY, allow_nonfinite=MASKS, memory=_of_rank(memory, rank))
    state = script.state()
    counters = ckpt.restore(state, per_rank=per_rank)
    script.step = state["progress"]["step"]
    script.train(steps - script.step)
    read = ckpt.last_restore
    ckpt.close()
    return {"update": counters.update, "digest": script.digest(), "losses": script.losses, "tier": read["tier"],
            "from_peers": read["bytes_from_peers"], "from_store": read["bytes_from_store"]}


def straight(rank, world, steps):
    script = Script(rank, world)
    script.train(steps)
    return {"digest": script.digest(), "losses": script.losses}


def _memory_refs(memory: Path, store: Path, rank: int) -> list[RefRecord]:
    with Store(holder_directory(holders_of(str(memory), str(store)), rank), create=False) as holder:
        return [r for r in holder.list_refs("r", "train") if isinstance(r, RefRecord)]


def test_a_rank_lost_after_memory_saves_resumes_the_newest_from_memory_bit_identical_reading_nothing_from_the_store(
        tmp_path):
    store, memory = tmp_path / "store", tmp_path / "memory"
    saved = run_ranks(2, save_steps, str(store), str(memory), 5, 3, tmp=tmp_path)
    tiers = [s["tier"] for s in saved[0]["saves"]]
    assert tiers == ["durable", "memory", "memory", "durable", "memory"]
    assert all(s["memory_ok"] for s in saved[0]["saves"])
    # the memory tier publishes the very root the store does
    with Store(str(store), create=False) as s:
        durable = [r.root for r in s.list_refs("r", "train")]
    assert durable == [saved[0]["saves"][0]["root"], saved[0]["saves"][3]["root"]]
    for rank in range(2):
        assert [r.root for r in _memory_refs(memory, store, rank)] == [saved[0]["saves"][3]["root"],
                                                                saved[0]["saves"][4]["root"]]  # the two newest
    shutil.rmtree(store / "objects")  # the store's bytes are gone: a memory recovery must not need them
    os.makedirs(store / "objects")
    resumed = run_ranks(2, resume, str(store), str(memory), 8, tmp=tmp_path)
    reference = run_ranks(2, straight, 8, tmp=tmp_path)
    for r in range(2):
        assert resumed[r]["tier"] == "memory" and resumed[r]["update"] == 5
        assert resumed[r]["from_store"] == 0 and resumed[r]["from_peers"] == 0
        assert saved[r]["losses"] + resumed[r]["losses"] == reference[r]["losses"]
        assert resumed[r]["digest"] == reference[r]["digest"]
    assert not os.path.exists(holder_directory(holders_of(str(memory), str(store)), 0))  # close(): the script is done with the tier


@pytest.mark.parametrize("nodes", ["one", "one-per-rank"])
def test_a_lost_holder_is_refilled_from_its_peers_and_the_job_resumes_on_another_rank_count(tmp_path, nodes):
    # One node: a rank copies from its peers' holders through the shared tmpfs. A node per rank (a tier
    # directory each): the copies go over the tier's gloo group.
    store, memory = tmp_path / "store", str(tmp_path / "memory") + ("-{rank}" if nodes == "one-per-rank" else "")
    run_ranks(2, save_steps, str(store), memory, 3, 5, tmp=tmp_path)
    shutil.rmtree(holder_directory(holders_of(_of_rank(memory, 1), str(store)), 1))  # rank 1's memory is gone
    resumed = run_ranks(3, resume, str(store), memory, 3, "drop", tmp=tmp_path)
    assert [r["tier"] for r in resumed] == ["memory"] * 3
    assert all(r["update"] == 3 and r["from_store"] == 0 for r in resumed)
    assert resumed[1]["from_peers"] > 0 and resumed[2]["from_peers"] > 0  # pulled by digest from rank 0
    # the same state as a resume of the same generation from the store alone
    saved = run_ranks(2, save_steps, str(tmp_path / "s2"), None, 3, None, tmp=tmp_path)
    assert [s["tier"] for s in saved[0]["saves"]] == ["durable"] * 3
    durable = run_ranks(3, resume, str(tmp_path / "s2"), None, 3, "drop", tmp=tmp_path)
    assert [r["tier"] for r in durable] == ["durable"] * 3
    assert [r["digest"] for r in resumed] == [r["digest"] for r in durable]


def _flip_one_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("damage", ["flipped-peer-copy", "both-holders-lost"])
def test_a_damaged_or_lost_memory_copy_makes_every_rank_fall_back_to_the_newest_durable_generation(tmp_path, damage):
    store, memory = tmp_path / "store", tmp_path / "memory"
    saved = run_ranks(3, save_steps, str(store), str(memory), 4, 3, tmp=tmp_path)
    newest = _memory_refs(memory, store, 0)[-1].root
    assert newest == saved[0]["saves"][3]["root"]
    if damage == "flipped-peer-copy":
        # A shard of the newest memory generation, and of no older one the tier holds (so the damage is to the
        # generation meant, whatever order a directory lists its objects in), in the copy rank 2 holds of
        # rank 1's objects; the lowest digest of those, so every run flips the same one.
        with Store(holder_directory(holders_of(str(memory), str(store)), 1), create=False) as h1, \
                Store(holder_directory(holders_of(str(memory), str(store)), 2), create=False) as h2:
            def shards_of(root: str) -> set[str]:
                with open_generation(h1, root, role=0, wanted=[]) as head:
                    return {s.digest for s in head.manifest.shards}
            older = set().union(*(shards_of(r.root) for r in _memory_refs(memory, store, 1) if r.root != newest))
            only_newest = sorted(d for d in shards_of(newest) - older if h1.has_object(d) and h2.has_object(d))
            assert only_newest, "no shard of the newest generation alone is held by ranks 1 and 2"
            _flip_one_byte(h2.object_path(only_newest[0]))
    else:
        shutil.rmtree(holder_directory(holders_of(str(memory), str(store)), 0))
        shutil.rmtree(holder_directory(holders_of(str(memory), str(store)), 1))  # rank 0's shards had copies only there
    with Store(str(store), create=False) as s:
        before = sorted(os.listdir(s.root))
    resumed = run_ranks(3, resume, str(store), str(memory), 6, tmp=tmp_path)
    assert before == sorted(os.listdir(store))
    # the reference: the same save of update 4 resumed from a store alone
    run_ranks(3, save_steps, str(tmp_path / "s2"), None, 4, None, tmp=tmp_path)
    reference = run_ranks(3, resume, str(tmp_path / "s2"), None, 6, tmp=tmp_path)
    for r in range(3):
        assert resumed[r]["tier"] == "durable" and resumed[r]["update"] == 4  # save 4 was durable too
        assert resumed[r]["digest"] == reference[r]["digest"]
        assert resumed[r]["losses"] == reference[r]["losses"]


def test_each_holder_keeps_only_the_two_newest_memory_generations(tmp_path):
    store, memory = tmp_path / "store", tmp_path / "memory"
    saved = run_ranks(2, save_steps, str(store), str(memory), 6, 10, tmp=tmp_path)
    held = [s["held"] for s in saved[0]["saves"]]
    assert max(held[2:]) <= 1.5 * held[1]  # bounded: two generations' worth, not one more per save
    for rank in range(2):
        assert len(_memory_refs(memory, store, rank)) == 2


def test_alpha_run_removes_the_memory_tiers_of_launchers_that_died_and_keeps_the_living_ones(tmp_path):
    from alpha_ckpt.launch.launcher import MEMORY_PREFIX, remove_orphaned_tiers
    import subprocess
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    (tmp_path / f"{MEMORY_PREFIX}{dead.pid}-abc" / "rank-00000").mkdir(parents=True)
    (tmp_path / f"{MEMORY_PREFIX}{os.getpid()}-def").mkdir()
    (tmp_path / "something-else").mkdir()
    remove_orphaned_tiers(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{MEMORY_PREFIX}{os.getpid()}-def",
                                                                  "something-else"])


@pytest.mark.parametrize("flags", [["--replicas", "2"], ["--durable-every", "3"], ["--memory", "--replicas", "0"]])
def test_memory_flags_without_the_tier_or_out_of_range_are_usage_errors(tmp_path, flags):
    from alpha_ckpt.launch.launcher import main
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    assert main(["--nproc", "2", "--store", str(tmp_path / "s"), *flags, str(script)]) == 2


def save_async_or_auto(rank, world, store, memory, mode):
    script = Script(rank, world)
    options = dict(save="async") if mode == "async" else dict(every="auto", mtbf=0.05)
    ckpt = Checkpointer(store, run="r", identity=IDENTITY, allow_nonfinite=MASKS, memory=memory, durable_every=
                        3 if mode == "async" else None, **options)
    assert ckpt.restore(script.state(), root=None) is None
    tiers = []
    for _ in range(6 if mode == "async" else 10):
        script.train(1)
        if mode == "async" or ckpt.due(script.step):
            ckpt.save(script.state(), update=script.step, cursor=script.step * 4 * world)
            ckpt.wait()
            tiers.append(ckpt.last_save["tier"])
    return {"tiers": tiers, "digest": script.digest()}


@pytest.mark.parametrize("mode", ["async", "auto"])
def test_asynchronous_and_planned_saves_go_to_both_tiers_alike_on_every_rank_and_resume_from_memory(tmp_path, mode):
    store, memory = tmp_path / "store", tmp_path / "memory"
    saved = run_ranks(2, save_async_or_auto, str(store), str(memory), mode, tmp=tmp_path)
    tiers = saved[0]["tiers"]
    assert saved[1]["tiers"] == tiers and tiers[0] == "durable" and "memory" in tiers  # the first measures the store
    if mode == "async":
        assert tiers == ["durable", "memory", "memory"] * 2
    steps = 6 if mode == "async" else 10
    resumed = run_ranks(2, resume, str(store), str(memory), steps, tmp=tmp_path)
    assert [r["tier"] for r in resumed] == ["memory"] * 2  # memory holds the newest, whichever tier it went to
    assert [r["digest"] for r in resumed] == [s["digest"] for s in saved]


def test_copies_go_a_node_apart_when_the_job_spans_nodes(monkeypatch):
    from alpha_ckpt.tiers.memory.tier import replica_stride
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert replica_stride(8) == 2 and replica_stride(2) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert replica_stride(8) == 1
