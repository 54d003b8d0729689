"""Property: whatever holders are lost and whichever copy is damaged, a restore with the memory tier gives
exactly the newest generation some tier holds intact (memory when every object has a surviving, intact
copy; else the store's newest), bit for bit, on every rank, and never anything else."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from alpha_ckpt import Checkpointer, PerRank
from alpha_ckpt.tiers.memory.tier import holder_directory, holders_of
from alpha_ckpt.store import Store
from ranks import run_ranks

pytestmark = pytest.mark.timeout(900)


def state_at(update: int, rank: int, world: int) -> dict:
    """A state that changes at every update, on every rank (no object is shared by two generations)."""
    g = torch.Generator().manual_seed(1000 * update + 7)
    return {"weights": torch.randn(64, 33, generator=g),               # replicated: one rank writes it
            "moments": torch.randn(5000, generator=g),                  # replicated, large enough to spread
            "own": PerRank(torch.full((17,), float(update * 10 + rank))),  # every rank writes one of its own
            "progress": {"update": update}}


def save_all(rank, world, store, memory, saves, durable_every, replicas):
    ckpt = Checkpointer(store, run="p", memory=memory, durable_every=durable_every, replicas=replicas)
    for update in range(1, saves + 1):
        ckpt.save(state_at(update, rank, world), update=update)
    return [ckpt.last_save["root"]]


def restore_any(rank, world, store, memory):
    ckpt = Checkpointer(store, run="p", memory=memory)
    state = {"weights": torch.zeros(64, 33), "moments": torch.zeros(5000), "own": PerRank(torch.zeros(17)),
             "progress": {"update": -1}}
    counters = ckpt.restore(state)
    update = counters.update
    want = state_at(update, rank, world)
    exact = all(torch.equal(state[k], want[k]) for k in ("weights", "moments")) \
        and torch.equal(state["own"].value, want["own"].value)
    return {"update": update, "tier": ckpt.last_restore["tier"], "exact": exact,
            "progress": state["progress"]["update"]}


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(world=st.sampled_from([2, 3]), replicas=st.sampled_from([1, 2]), saves=st.integers(2, 5),
       durable_every=st.integers(1, 4), data=st.data())
def test_a_restore_with_the_memory_tier_gives_the_newest_intact_generation_bit_for_bit(world, replicas, saves,
                                                                                       durable_every, data):
    tmp = Path(tempfile.mkdtemp())
    try:
        store, memory = str(tmp / "store"), str(tmp / "memory")
        run_ranks(world, save_all, store, memory, saves, durable_every, replicas, tmp=tmp)
        durable = [u for u in range(1, saves + 1) if (u - 1) % durable_every == 0]
        lost = data.draw(st.sets(st.integers(0, world - 1), max_size=world), label="lost holders")
        flip = data.draw(st.none() | st.integers(0, world - 1), label="holder with a flipped copy")
        with Store(holder_directory(holders_of(memory, store), 0), create=False) as h0:
            newest = max((r for r in h0.list_refs("p", "train")), key=lambda r: r.generation)
            with open_root(h0, newest.root) as names:
                closure = names
        damaged = False
        if flip is not None and flip not in lost:
            with Store(holder_directory(holders_of(memory, store), flip), create=False) as h:
                held = sorted(d for d in closure if h.has_object(d))
                target = data.draw(st.sampled_from(held), label="flipped object")
                _flip(h.object_path(target))
                damaged = True
        for rank in lost:
            shutil.rmtree(holder_directory(holders_of(memory, store), rank))
        copies = min(1 + replicas, world)
        # every rank writes objects; the copies of rank w's are on w .. w + copies - 1
        orphaned = any(all((w + j) % world in lost for j in range(copies)) for w in range(world))
        from_memory = len(lost) < world and not orphaned and not damaged
        want = saves if from_memory else max(durable)
        got = run_ranks(world, restore_any, store, memory, tmp=tmp)
        for r in got:
            assert r["update"] == want and r["progress"] == want and r["exact"]
            assert r["tier"] == ("memory" if from_memory else "durable")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class open_root:
    """The objects a memory generation names (its root manifest and shards), read from a holder."""

    def __init__(self, holder: Store, root: str):
        from alpha_ckpt.generation.opening import open_generation
        self.generation = open_generation(holder, root, role=0, wanted=[])

    def __enter__(self) -> set:
        return {self.generation.root} | {s.digest for s in self.generation.manifest.shards}

    def __exit__(self, *exc) -> None:
        self.generation.close()
