"""The collective Checkpointer on gloo ranks, with a DDP GPT-style training script as its client."""
import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import alpha_ckpt
from alpha_ckpt import Checkpointer, PerRank, RefusalCode
from alpha_ckpt.store import Store
from gpt_training import GPT, Batches, Tokens, optimizer_step
from ranks import run_ranks

IDENTITY = {"model": "gpt-tiny", "lr": 3e-3}
MASKS = ("*.causal_mask",)


class Script:
    """A DDP training script: model, AdamW (two groups), warmup LambdaLR, DistributedSampler, per-rank RNG."""

    def __init__(self, rank: int, world: int):
        torch.manual_seed(0)  # the same initial model on every rank
        # DDP's first iteration reduces the gradients in declaration order, then rebuilds its bucket in the
        # order they became ready: a restarted process would take one step in the other layout. On 3 or more
        # ranks gloo sums each element in an order set by its offset in the bucket, so that step differs in
        # its last bits. find_unused_parameters keeps the constructor's layout for good (no rebuild).
        self.model = DistributedDataParallel(GPT(), find_unused_parameters=True)
        params = list(self.model.named_parameters())
        self.optim = torch.optim.AdamW([{"params": [p for n, p in params if p.dim() >= 2], "weight_decay": 0.1},
                                        {"params": [p for n, p in params if p.dim() < 2], "weight_decay": 0.0}],
                                       lr=3e-3)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: min(1.0, (s + 1) / 4))
        data = Tokens(32)
        self.data = Batches(StatefulDataLoader(data, batch_size=4, sampler=DistributedSampler(data, world, rank, seed=0)))
        torch.manual_seed(100 + rank)  # each rank's own dropout and augmentation draws
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        self.step, self.losses = 0, []

    def state(self) -> dict:
        # The data position before the generators: restoring it makes its iterator, which draws.
        return {"model": self.model, "optim": self.optim, "sched": self.sched,
                "data": PerRank(self.data), "rng": PerRank(alpha_ckpt.RNGState()), "progress": {"step": self.step}}

    def train(self, n: int) -> None:
        for _ in range(n):
            self.losses.append(optimizer_step(self.model, self.optim, next(self.data)))
            self.sched.step()
            self.step += 1

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in list(self.model.state_dict().values()) + [v for s in self.optim.state_dict()["state"].values()
                                                           for v in s.values()]:
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        h.update(json.dumps(self.sched.state_dict(), default=str).encode())
        return h.hexdigest()


def train_and_save(rank, world, store, steps, save_at, save="sync", publisher="star"):
    script = Script(rank, world)
    ckpt = Checkpointer(store, run="r", identity=IDENTITY, allow_nonfinite=MASKS, save=save, publisher=publisher)
    assert ckpt.restore(script.state(), root=None) is None
    roots = []
    for _ in range(steps):
        script.train(1)
        if script.step in save_at:
            roots.append(ckpt.save(script.state(), update=script.step, cursor=script.step * 4 * world))
    ckpt.close()  # async: drains the save in flight
    assert all(isinstance(r, alpha_ckpt.SaveResult) for r in roots)  # sync or async: one type
    roots = [r.root for r in roots]  # async: waits for each (close() drained them already)
    return {"roots": roots, "digest": script.digest(), "losses": script.losses}


def resume_and_train(rank, world, store, steps, root, identity=IDENTITY, per_rank="keep"):
    script = Script(rank, world)
    ckpt = Checkpointer(store, run="r", identity=identity, allow_nonfinite=MASKS)
    state = script.state()
    counters = ckpt.restore(state, root=root, per_rank=per_rank)
    script.step = state["progress"]["step"]
    script.train(steps - script.step)
    ckpt.save(script.state(), update=script.step, cursor=script.step * 4 * world)  # published in the new epoch
    return {"update": counters.update, "digest": script.digest(), "losses": script.losses, "epoch": ckpt.epoch}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Six steps that never stopped, on ``world`` ranks (each rank count run once)."""
    runs = {}

    def on(world):
        if world not in runs:
            tmp = tmp_path_factory.mktemp(f"straight{world}")
            runs[world] = run_ranks(world, train_and_save, str(tmp / "a"), 6, (), tmp=tmp)
        return runs[world]
    return on


@pytest.mark.timeout(180)
@pytest.mark.parametrize("save, publisher, world", [("sync", "star", 2), ("async", "star", 2), ("sync", "tree", 2),
                                                    ("async", "tree", 2),
                                                    # 3 ranks: a sum of three gradients depends on the order it is taken in
                                                    ("sync", "star", 3)])
def test_a_ddp_script_resumed_from_its_checkpoint_ends_bit_identical_to_one_that_never_stopped(tmp_path, straight,
                                                                                               save, publisher, world):
    never_stopped = straight(world)
    saved = run_ranks(world, train_and_save, str(tmp_path / "b"), 3, (2, 3), save, publisher, tmp=tmp_path)
    assert all(s["roots"] == saved[0]["roots"] for s in saved) and len(saved[0]["roots"]) == 2
    resumed = run_ranks(world, resume_and_train, str(tmp_path / "b"), 6, "latest", tmp=tmp_path)
    for r in range(world):
        assert resumed[r]["update"] == 3 and resumed[r]["epoch"] == 1
        assert saved[r]["losses"] + resumed[r]["losses"] == never_stopped[r]["losses"]
        assert resumed[r]["digest"] == never_stopped[r]["digest"]


def diverge_then_save(rank, world, store, publisher):
    script = Script(rank, world)
    ckpt = Checkpointer(store, run="r", identity=IDENTITY, allow_nonfinite=MASKS, publisher=publisher)
    ckpt.restore(script.state(), root=None)
    script.train(1)
    ckpt.save(script.state(), update=1)
    if rank == 1:
        with torch.no_grad():
            script.model.module.head.weight[0, 0] += 1.0  # this rank's replica no longer equals rank 0's
    ckpt.save(script.state(), update=2)
    return {"saved": True}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_a_diverged_replica_is_refused_on_every_rank_and_nothing_is_published(tmp_path, publisher):
    results = run_ranks(2, diverge_then_save, str(tmp_path), publisher, tmp=tmp_path)
    assert [r.get("refusal") for r in results] == [RefusalCode.MIXED_CAPTURE.value] * 2
    assert "model.module.head.weight" in results[0]["message"]
    with Store(tmp_path, create=False) as s:
        assert [r.prefix.update for r in s.list_refs("r", "train")] == [1]


def _tree(path):
    return sorted((p.relative_to(path).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*") if "pending" not in p.parts)


@pytest.mark.timeout(240)
def test_another_identity_an_older_epoch_and_a_flipped_byte_are_refused_on_every_rank_with_the_store_unchanged(tmp_path):
    store = tmp_path / "s"
    first = run_ranks(2, train_and_save, str(store), 2, (1, 2), tmp=tmp_path)[0]["roots"]
    before = _tree(store)
    foreign = run_ranks(2, resume_and_train, str(store), 3, "latest", {"model": "another"}, tmp=tmp_path)
    assert [r["refusal"] for r in foreign] == [RefusalCode.FOREIGN_LEARNER.value] * 2
    assert _tree(store) == before
    run_ranks(2, resume_and_train, str(store), 3, "latest", tmp=tmp_path)  # a continuation: epoch 1 publishes
    with Store(store, create=False) as s:
        after_continuation = [r.root for r in s.list_refs("r", "train")]
    older = run_ranks(2, resume_and_train, str(store), 3, first[0], tmp=tmp_path)  # epoch 0's generation: stale
    assert [r["refusal"] for r in older] == [RefusalCode.STALE_EPOCH.value] * 2
    with Store(store, create=False) as s:
        assert [r.root for r in s.list_refs("r", "train")] == after_continuation
        victim = s.object_path(after_continuation[-1])
    os.chmod(victim, 0o644)
    data = bytearray(open(victim, "rb").read())
    data[30] ^= 1
    open(victim, "wb").write(bytes(data))
    snapshot = _tree(store)
    flipped = run_ranks(2, resume_and_train, str(store), 4, after_continuation[-1], tmp=tmp_path)
    assert [r["refusal"] for r in flipped] == [RefusalCode.CORRUPT_SHARD.value] * 2
    assert _tree(store) == snapshot


@pytest.mark.timeout(180)
def test_a_newest_generation_damaged_where_only_rank_1_reads_makes_every_rank_fall_back_together(tmp_path):
    store = tmp_path / "s"
    roots = run_ranks(2, train_and_save, str(store), 2, (1, 2), tmp=tmp_path)[0]["roots"]
    from alpha_ckpt.generation.reader import open_generation
    with Store(store, create=False) as s, open_generation(s, roots[1]) as g:
        rank1_shard = s.object_path(g.manifest.shards[1].digest)  # rank 1's own words: only rank 1 reads them
    os.chmod(rank1_shard, 0o644)
    data = bytearray(open(rank1_shard, "rb").read())
    data[-1] ^= 1
    open(rank1_shard, "wb").write(bytes(data))
    resumed = run_ranks(2, resume_and_train, str(store), 3, "latest", tmp=tmp_path)
    assert [r["update"] for r in resumed] == [1, 1]


@pytest.mark.timeout(180)
def test_a_two_rank_checkpoint_resumes_on_three_ranks_only_when_per_rank_entries_may_be_dropped(tmp_path):
    store = str(tmp_path / "s")
    run_ranks(2, train_and_save, store, 2, (2,), tmp=tmp_path)
    refused = run_ranks(3, resume_and_train, store, 3, "latest", tmp=tmp_path)
    assert [r["refusal"] for r in refused] == [RefusalCode.PLACEMENT_BOUND.value] * 3
    assert "rng" in refused[0]["message"] and "data" in refused[0]["message"]
    dropped = run_ranks(3, resume_and_train, store, 3, "latest", IDENTITY, "drop", tmp=tmp_path)
    assert [r["update"] for r in dropped] == [2, 2, 2]
    assert len({r["digest"] for r in dropped}) == 1  # the replicated model and optimizer agree on every rank


# ---------------------------------------------------------------- four ranks, ZeRO-style state

MODEL_WORDS, MOMENT_WORDS = 48_000, 200_003  # the moments do not split evenly over 4 ranks


def zero_style_state(rank, world, value):
    """A replicated model, AdamW-like moments partitioned by rank (uneven ranges), a per-rank generator."""
    from alpha_ckpt import Partitioned
    from alpha_ckpt.job.learner.data import shares
    lo, hi = shares(MOMENT_WORDS, world)[rank]
    moments = torch.arange(lo, hi, dtype=torch.float32) * value
    return {"model": {"w": torch.full((MODEL_WORDS,), value, dtype=torch.float32)},
            "moments": Partitioned(moments, lo, hi, (MOMENT_WORDS,)),
            "rng": PerRank({"seed": 100 + rank, "draws": torch.full((16,), rank, dtype=torch.int64)}),
            "step": int(value)}


def save_zero_style(rank, world, store, generations):
    ckpt = Checkpointer(store, run="z", publisher="tree", fanout=2)
    ckpt.restore(zero_style_state(rank, world, 0.0), root=None)
    roots = [ckpt.save(zero_style_state(rank, world, float(g)), update=g, cursor=g).root
             for g in range(1, generations + 1)]
    return {"roots": roots}


def restore_zero_style(rank, world, store):
    dest = zero_style_state(rank, world, -1.0)
    ckpt = Checkpointer(store, run="z", publisher="tree", fanout=2)
    counters = ckpt.restore(dest, root="latest")
    expect = zero_style_state(rank, world, float(counters.update))
    equal = (torch.equal(dest["model"]["w"], expect["model"]["w"])
             and torch.equal(dest["moments"].tensor, expect["moments"].tensor)
             and torch.equal(dest["rng"].value["draws"], expect["rng"].value["draws"])
             and dest["rng"].value["seed"] == 100 + rank and dest["step"] == counters.update)
    return {"update": counters.update, "equal": equal, **ckpt.last_restore}


@pytest.mark.timeout(240)
def test_four_ranks_each_read_only_their_share_and_fall_back_together_when_the_newest_is_damaged(tmp_path):
    """Tree of 4 roles (fanout 2): every rank validates only what it restores, never the whole generation."""
    store = tmp_path / "s"
    roots = run_ranks(4, save_zero_style, str(store), 2, tmp=tmp_path)[0]["roots"]
    restored = run_ranks(4, restore_zero_style, str(store), tmp=tmp_path)
    assert [r["update"] for r in restored] == [2] * 4 and all(r["equal"] for r in restored)
    from alpha_ckpt.job.learner.data import shares
    replicated = MODEL_WORDS * 4
    for rank, r in enumerate(restored):
        lo, hi = shares(MOMENT_WORDS, 4)[rank]
        share = (hi - lo) * 4 + 16 * 8  # its moments and its own generator's words
        assert r["bytes_read"] <= replicated + share * 1.01, (rank, r["bytes_read"], replicated + share)
    with Store(store, create=False) as s:
        total = s.find_ref(roots[1]).bytes
    assert max(r["bytes_read"] for r in restored) < total / 2  # no rank reads the generation whole
    # Manifests too: only those on the paths to the roles holding a rank's words (root 0; 1 and 2 under role 1).
    assert [r["manifests"] for r in restored] == [1, 2, 3, 2]

    # Damage what only rank 3 reads in the newest generation: rank 3's own shard.
    from alpha_ckpt.generation.reader import open_generation
    with Store(store, create=False) as s, open_generation(s, roots[1]) as g:
        [group3] = [m for m in g.manifests if m.publisher.role == 3]
        victim = s.object_path(group3.shards[0].digest)
    os.chmod(victim, 0o644)
    data = bytearray(open(victim, "rb").read())
    data[-1] ^= 1
    open(victim, "wb").write(bytes(data))
    fallen = run_ranks(4, restore_zero_style, str(store), tmp=tmp_path)
    assert [r["update"] for r in fallen] == [1] * 4 and all(r["equal"] for r in fallen)
    assert {r["root"] for r in fallen} == {roots[0]}


SPREAD_WORDS = 800_000  # a partitioned float32 region of 3.2 MB beside the replicas


def spread_state(rank, world, value):
    from alpha_ckpt import Partitioned
    from alpha_ckpt.job.learner.data import shares
    lo, hi = shares(SPREAD_WORDS, world)[rank]
    return {"a": torch.arange(600_000, dtype=torch.float32) * value, "b": torch.arange(500_000, dtype=torch.float64) * value,
            "small": torch.ones(10) * value,
            "p": Partitioned(torch.arange(lo, hi, dtype=torch.float32) * value, lo, hi, (SPREAD_WORDS,))}


def spread_and_restore(rank, world, store, saved_on, publisher):
    ckpt = Checkpointer(store, run="spread", publisher=publisher)
    wrote = None
    if world == saved_on:
        ckpt.restore(spread_state(rank, world, 0.0), root=None)
        before = ckpt.store.bytes_written
        ckpt.save(spread_state(rank, world, 1.0), update=1, cursor=1)
        wrote = ckpt.store.bytes_written - before
    dest, expect = spread_state(rank, world, -1.0), spread_state(rank, world, 1.0)
    ckpt.restore(dest, root="latest")
    equal = all(torch.equal(dest[k], expect[k]) for k in ("a", "b", "small")) and torch.equal(dest["p"].tensor,
                                                                                           expect["p"].tensor)
    return {"equal": equal, "wrote": wrote}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_every_rank_writes_its_own_words_and_its_share_of_large_replicas_and_any_rank_count_restores_them(
        tmp_path, publisher):
    store = str(tmp_path / "s")
    saved = run_ranks(2, spread_and_restore, store, 2, publisher, tmp=tmp_path)
    assert all(r["equal"] for r in saved)
    # The larger replica (b, 4 MB) and the small one by rank 0, a (2.4 MB) by rank 1, each rank its half of p:
    # no rank writes (or receives) another's words, in the star as in the tree.
    own = [4_000_000 + 40 + SPREAD_WORDS * 2, 2_400_000 + SPREAD_WORDS * 2]
    for rank, r in enumerate(saved):
        assert own[rank] <= r["wrote"] <= own[rank] + (256 << 10), (rank, r["wrote"], own[rank])
    if publisher == "tree":
        from alpha_ckpt.generation.reader import open_generation
        with Store(store, create=False) as s:
            root = s.newest_ref("spread", "train").root
            with open_generation(s, root) as g:
                holders = {}
                for m in g.manifests:
                    for shard in m.shards:
                        for sl in shard.slices:
                            holders.setdefault(g.manifest.regions[sl[0]].name, set()).add(m.publisher.role)
        assert holders == {"a": {1}, "b": {0}, "small": {0}, "p": {0, 1}}
    assert all(r["equal"] for r in run_ranks(1, spread_and_restore, store, 2, publisher, tmp=tmp_path))
    assert all(r["equal"] for r in run_ranks(3, spread_and_restore, store, 2, publisher, tmp=tmp_path))


CUT_BYTES = 256 << 10  # stands in for the 2 GiB a piece is cut at, so a test can afford several cuts


def cut_state(rank, world, value):
    from alpha_ckpt import Partitioned
    from alpha_ckpt.job.learner.data import shares
    lo, hi = shares(700_001, world)[rank]
    return {"model": torch.arange(400_000, dtype=torch.float32) * value,
            "moments": Partitioned(torch.arange(lo, hi, dtype=torch.float64) * value, lo, hi, (700_001,)),
            "norms": {f"n{i}": torch.full((25_600,), float(i)) * value for i in range(5)}}  # 100 KiB each


def save_cut_and_restore(rank, world, store, publisher, saved_on, diverge):
    import alpha_ckpt.collective.checkpointer as collective
    import alpha_ckpt.generation.writer
    alpha_ckpt.generation.writer.MAX_PIECE_BYTES = CUT_BYTES
    hashed_whole = []  # the replica hashed whole by the collective layer (beside what its writes hash)
    block_digests = collective.block_digests

    def counting_block_digests(view):
        if len(view) == 400_000 * 4:
            hashed_whole.append(1)
        return block_digests(view)
    collective.block_digests = counting_block_digests
    ckpt = Checkpointer(store, run="cut", publisher=publisher)
    if world == saved_on:
        ckpt.restore(cut_state(rank, world, 0.0), root=None)
        state = cut_state(rank, world, 3.0)
        if diverge and rank == 1:
            state["model"][-1] += 1.0  # in the last cut of the replica
        ckpt.save(state, update=1)
    dest = cut_state(rank, world, -1.0)
    ckpt.restore(dest, root="latest")
    expect = cut_state(rank, world, 3.0)
    return {"equal": torch.equal(dest["model"], expect["model"])
            and torch.equal(dest["moments"].tensor, expect["moments"].tensor)
            and all(torch.equal(dest["norms"][k], expect["norms"][k]) for k in expect["norms"]),
            "hashed_whole": len(hashed_whole)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_a_piece_larger_than_the_cut_size_is_written_as_several_shards_and_restores_on_any_rank_count(tmp_path,
                                                                                                      publisher):
    """Each shard's head grows with its payload (a block digest per 64 KiB), so pieces are cut."""
    store = str(tmp_path / "s")
    saved = run_ranks(2, save_cut_and_restore, store, publisher, 2, False, tmp=tmp_path)
    assert all(r["equal"] for r in saved)
    # Its writer knows the cut replica's digest from the writes (joined); only the other rank hashes it.
    assert sorted(r["hashed_whole"] for r in saved) == [0, 1]
    from alpha_ckpt.generation.reader import open_generation
    with Store(store, create=False) as s, open_generation(s, s.newest_ref("cut", "train").root) as g:
        slices = [(g.manifest.regions[sl.ordinal].name, sl.lo, sl.hi, sl.raw)
                  for _, head in g.shards.values() for sl in head.slices]
        small = sorted(sorted(g.manifest.regions[sl.ordinal].name for sl in head.slices)
                       for _, head in g.shards.values() if head.slices[0].raw < 1 << 20 and
                       g.manifest.regions[head.slices[0].ordinal].name.startswith("norms"))
    # The small regions stay together, in shards of at most the cut size: 2 + 2 + 1 of 100 KiB.
    assert sorted(map(len, small)) == [1, 2, 2] and sum(small, []) == sorted(f"norms.n{i}" for i in range(5))
    for name, words, size in (("model", 400_000, 4), ("moments", 700_001, 8)):
        mine = sorted((lo, hi, raw) for n, lo, hi, raw in slices if n == name)
        assert [(lo, hi) for lo, hi, _ in mine] == [(lo, min(lo + CUT_BYTES // size, hi)) for lo, hi in
                                                   _cuts(name, words, size)]
        assert max(raw for *_, raw in mine) == CUT_BYTES
    assert all(r["equal"] for r in run_ranks(3, save_cut_and_restore, store, publisher, 2, False, tmp=tmp_path))
    assert all(r["equal"] for r in run_ranks(1, save_cut_and_restore, store, publisher, 2, False, tmp=tmp_path))


def _cuts(name, words, size):
    """The (lo, hi) ranges a 2-rank save cuts a region into: per rank's piece, every CUT_BYTES."""
    from alpha_ckpt.job.learner.data import shares
    pieces = [(0, words)] if name == "model" else shares(words, 2)
    step = CUT_BYTES // size
    return [(lo, hi) for a, b in pieces for lo in range(a, b, step) for hi in [min(lo + step, b)]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_a_replica_that_diverges_only_in_its_last_cut_is_refused_on_every_rank(tmp_path, publisher):
    results = run_ranks(2, save_cut_and_restore, str(tmp_path / "s"), publisher, 2, True, tmp=tmp_path)
    assert [r.get("refusal") for r in results] == [RefusalCode.MIXED_CAPTURE.value] * 2
    assert "model" in results[0]["message"]
    with Store(tmp_path / "s", create=False) as s:
        assert s.list_refs("cut", "train") == []
