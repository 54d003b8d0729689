"""Large objects are written buffered or with O_DIRECT, by measurement, with the same bytes either way."""
import errno
import fcntl
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import alpha_ckpt
from alpha_ckpt.store import durable
from alpha_ckpt.generation import writer
from alpha_ckpt.store import EXPLORE_EVERY, Store, WriteModes


def _auto(path, **kwargs) -> Store:
    # Most tests here are of "auto" (the measured choice), which a user opts into; the default is
    # tested with a store opened without a write mode. Each store learns on its own.
    return Store(path, write_mode="auto", **kwargs)


@pytest.fixture
def small_blocks(monkeypatch):
    # Small blocks and threshold so a few MiB exercise several blocks, a first block and a partial last one.
    monkeypatch.setattr(writer, "_DIRECT_BLOCK", 1 << 20)
    monkeypatch.setattr(writer, "DIRECT_MIN_BYTES", 1 << 20)


def _state():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(1_000_003, generator=g), "b": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "c": torch.arange(777, dtype=torch.int64)}


def _objects(store_dir):
    out = {}
    for d, _, files in os.walk(os.path.join(store_dir, "objects")):
        for f in files:
            out[f] = open(os.path.join(d, f), "rb").read()
    return out


def _save(tmp_path, name, monkeypatch, mode):
    store = Store(tmp_path / name, write_mode=mode)
    root = alpha_ckpt.save(_state(), store=store, run="r", step="s", update=1, cursor=1, epoch=0)
    return store, root


def test_direct_and_buffered_writes_give_identical_objects(tmp_path, monkeypatch, small_blocks):
    _, root_b = _save(tmp_path, "buffered", monkeypatch, "buffered")
    store, root_d = _save(tmp_path, "direct", monkeypatch, "direct")
    assert root_b == root_d
    assert _objects(tmp_path / "buffered") == _objects(tmp_path / "direct")
    assert store.write_modes.stats()["gbps"]["direct"], "the direct path was not taken"
    restored = {"a": torch.empty(1_000_003), "b": torch.empty(3, 5, dtype=torch.bfloat16),
                "c": torch.empty(777, dtype=torch.int64)}
    alpha_ckpt.restore(restored, store=store, root=root_d)
    assert all(torch.equal(restored[k], v) for k, v in _state().items())


def test_a_file_system_that_refuses_o_direct_is_written_buffered(tmp_path, monkeypatch, small_blocks):
    real = fcntl.fcntl

    def refusing(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(writer.fcntl, "fcntl", refusing)
    store, root = _save(tmp_path, "refused", monkeypatch, "auto")
    stats = store.write_modes.stats()
    assert stats["direct_refused"] and stats["next"] == "buffered"
    _, expected = _save(tmp_path, "plain", monkeypatch, "buffered")
    assert root == expected
    alpha_ckpt.verify(store, root)


def test_auto_alternates_then_keeps_the_faster_mode(tmp_path, monkeypatch):
    store = _auto(tmp_path)
    assert store.write_modes.mode == "auto"
    picks = []
    for gbps in ({"direct": 2.0, "buffered": 1.0}, ) * 4:
        mode = store.write_modes.for_next_object()
        picks.append(mode)
        store.write_modes.record(mode, 1 << 30, (1 << 30) / 1e9 / gbps[mode])
    assert sorted(picks) == ["buffered", "buffered", "direct", "direct"]
    assert store.write_modes.for_next_object() == "direct"
    for _ in range(5):
        store.write_modes.record("direct", 1 << 30, 10.0)   # the disk changed: direct is now slow
    assert store.write_modes.for_next_object() == "buffered"


def test_auto_measures_the_mode_it_does_not_use_again_after_eight_writes(tmp_path, monkeypatch):
    # Two unlucky early measurements of buffered writes must not keep them out for good.
    store = _auto(tmp_path)
    rates = {"direct": 1.0, "buffered": 0.5}
    picks = []
    for i in range(4 + EXPLORE_EVERY + 1):
        if i == 4:
            rates["buffered"] = 2.0  # from now on buffered is the faster mode, but only a new measurement shows it
        mode = store.write_modes.for_next_object()
        picks.append(mode)
        store.write_modes.record(mode, 1 << 30, (1 << 30) / 1e9 / rates[mode])
    assert picks[4:4 + EXPLORE_EVERY] == ["direct"] * EXPLORE_EVERY
    assert picks[4 + EXPLORE_EVERY] == "buffered"
    assert store.write_modes.for_next_object() == "direct"  # its median is still the lower until more samples
    store.write_modes.record("buffered", 1 << 30, (1 << 30) / 1e9 / 2.0)
    assert store.write_modes.for_next_object() == "buffered"


def test_a_store_writes_buffered_unless_told_otherwise_even_where_o_direct_measured_faster(tmp_path, monkeypatch,
                                                                                          small_blocks):
    # A buffered save leaves its objects in the page cache for the restore that follows it on the same
    # node; O_DIRECT is only taken by write_mode="auto" or "direct".
    store = Store(tmp_path / "store")
    for _ in range(2):
        store.write_modes.record("direct", 1 << 30, 0.1)
        store.write_modes.record("buffered", 1 << 30, 10.0)
    assert store.write_modes.next() == ("buffered", False)
    assert store.write_modes.for_save(4) == "buffered"
    alpha_ckpt.save(_state(), store=store, run="r", step="s", update=1, cursor=1, epoch=0)
    assert store.write_modes.stats()["modes"][4:] == ["buffered"], "the save's large object was not written buffered"


def test_an_unknown_write_mode_is_a_usage_error(tmp_path, monkeypatch):
    from alpha_ckpt.errors import StoreUsageError
    with pytest.raises(StoreUsageError, match="write_mode"):
        Store(tmp_path, write_mode="fast")


def _many_shards():
    g = torch.Generator().manual_seed(5)
    return {f"t{i}": torch.randn(300_000 + i, generator=g) for i in range(6)}


@pytest.mark.parametrize("setting, threads", [(None, 4), (1, 1), (3, 3)])
def test_a_saves_shards_are_written_as_many_at_once_as_write_threads_says(tmp_path, monkeypatch, setting, threads):
    batches, real = [], durable.durable_commit_all
    monkeypatch.setattr(durable, "durable_commit_all", lambda tmp_dir, commits, write_threads=1: (
        batches.append((len(commits), write_threads)), real(tmp_dir, commits, write_threads))[1])
    store = Store(tmp_path / "s", **({} if setting is None else {"write_threads": setting}))
    root = alpha_ckpt.save(_many_shards(), store=store, run="r", step="s", update=1, cursor=1, epoch=0,
                           max_shard_bytes=1 << 20)
    # the six 1.2 MB tensors' shards in one batch, written `threads` at a time
    assert any(n >= 6 and t == threads for n, t in batches), batches
    restored = {k: torch.empty_like(v) for k, v in _many_shards().items()}
    alpha_ckpt.restore(restored, store=store, root=root)
    assert all(torch.equal(restored[k], v) for k, v in _many_shards().items())


def test_shards_written_four_at_once_with_o_direct_hold_the_bytes_of_shards_written_one_at_a_time(
        tmp_path, monkeypatch, small_blocks):
    roots = []
    for name, mode, threads in (("one", "buffered", 1), ("four", "direct", 4)):
        store = Store(tmp_path / name, write_mode=mode, write_threads=threads)
        roots.append(alpha_ckpt.save(_many_shards(), store=store, run="r", step="s", update=1, cursor=1, epoch=0,
                                     max_shard_bytes=1 << 20))
    assert store.write_modes.stats()["gbps"]["direct"], "the direct path was not taken"
    assert roots[0] == roots[1] and _objects(tmp_path / "one") == _objects(tmp_path / "four")


@pytest.mark.parametrize("setting", [0, -2, "four", "4", True, 1.5, None])
def test_a_write_threads_setting_that_is_not_a_positive_number_is_a_usage_error(tmp_path, setting):
    from alpha_ckpt.errors import StoreUsageError
    with pytest.raises(StoreUsageError, match="write_threads"):
        Store(tmp_path, write_threads=setting)


def test_a_head_larger_than_one_direct_block_is_written_whole(tmp_path, monkeypatch):
    # Block digests make a head about 1/1024 of its payload: with 4 KiB blocks, this 4 MB region's
    # head spans two of them, and a fresh thread's buffers are too small for it.
    monkeypatch.setattr(writer, "_DIRECT_BLOCK", 4096)
    monkeypatch.setattr(writer, "DIRECT_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(writer, "_direct_buffers", threading.local())
    _, root_b = _save(tmp_path, "buffered", monkeypatch, "buffered")
    store, root_d = _save(tmp_path, "direct", monkeypatch, "direct")
    assert store.write_modes.stats()["gbps"]["direct"], "the direct path was not taken"
    assert root_b == root_d and _objects(tmp_path / "buffered") == _objects(tmp_path / "direct")
    assert max(len(b) for b in _objects(tmp_path / "direct").values()) > 4_000_000


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(head_len=st.integers(0, 3 * 4096 + 5), gaps=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 20_000)),
                                                             min_size=1, max_size=6),
       block_pages=st.integers(1, 3))
def test_a_direct_write_puts_every_byte_at_its_offset_whatever_the_alignment(tmp_path, monkeypatch, head_len, gaps,
                                                                              block_pages):
    # Only the aligned run holding the head waits for the digests and the unaligned end is written
    # buffered: heads, payloads and ends that fall anywhere around page boundaries still give the file
    # the buffered path gives, byte for byte, and its exact size.
    monkeypatch.setattr(writer, "_DIRECT_BLOCK", 4096 * block_pages)
    monkeypatch.setattr(writer, "_direct_buffers", threading.local())
    rng = random.Random(head_len * 7919 + len(gaps))
    segments, offset = [], head_len
    for gap, length in gaps:
        offset += gap
        segments.append((offset, memoryview(bytes(rng.getrandbits(8) for _ in range(length)))))
        offset += length
    total = offset
    head = bytes(rng.getrandbits(8) for _ in range(head_len))
    expected = bytearray(total)
    expected[:head_len] = head
    for at, view in segments:
        expected[at:at + len(view)] = view
    path = tmp_path / f"direct-{head_len}-{total}-{block_pages}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            assert writer.write_direct(fd, total, segments, lambda: head, pool, head_len)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(expected)


def test_a_new_process_probes_each_mode_on_single_shards_then_commits_the_rest_as_one_batch(tmp_path, monkeypatch,
                                                                                            small_blocks):
    # The first large writes alternate between the modes one shard at a time (two samples of each),
    # so one save measures both; its remaining shards go in one batch, in the mode measured faster.
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(300_000, generator=g) for i in range(8)}  # 1.2 MB each: one shard each
    store = _auto(tmp_path / "store")
    root = alpha_ckpt.save(state, store=store, run="r", step="s", update=1, cursor=1, epoch=0,
                           max_shard_bytes=1_300_000)
    stats = store.write_modes.stats()
    modes = stats["modes"]
    assert modes[:4] == ["direct", "buffered", "direct", "buffered"] and len(modes) == 5
    # the rest: one batch, in the mode whose median (of two: the higher) of the probes was higher,
    # O_DIRECT only by the margin
    from alpha_ckpt.store import DIRECT_MARGIN
    probes = {m: sorted(stats["gbps"][m][:2])[1] for m in ("direct", "buffered")}
    assert modes[4] == ("direct" if probes["direct"] >= DIRECT_MARGIN * probes["buffered"] else "buffered")
    alpha_ckpt.verify(store, root)


def test_auto_learns_each_count_of_concurrent_writers_on_its_own(tmp_path, monkeypatch):
    # Alone, direct is the faster mode here; with four writers at once, buffered is. Samples of one
    # count must not decide the other's mode.
    store = _auto(tmp_path)
    rates = {1: {"direct": 2.0, "buffered": 1.0}, 4: {"direct": 0.3, "buffered": 0.9}}
    for writers in (1, 4, 1, 4, 1, 4, 1, 4):
        mode = store.write_modes.for_next_object(writers)
        store.write_modes.record(mode, 1 << 30, (1 << 30) / 1e9 / rates[writers][mode], writers=writers)
    assert store.write_modes.for_next_object(1) == "direct"
    assert store.write_modes.for_next_object(4) == "buffered"
    assert {m: [round(r, 6) for r in v] for m, v in store.write_modes.stats(4)["gbps"].items()} == \
        {"direct": [0.3, 0.3], "buffered": [0.9, 0.9]}
    assert store.write_modes.measured_bytes_per_s(2) is None  # a count never seen starts its own probes
    assert store.write_modes.next(2) == ("direct", True)


def test_a_refusal_of_o_direct_holds_for_every_count_of_writers(tmp_path, monkeypatch):
    store = _auto(tmp_path)
    store.write_modes.record("direct", 1 << 20, 0.1, refused=True, writers=3)
    assert all(store.write_modes.for_next_object(n) == "buffered" for n in (1, 2, 3, 8))


def test_writers_is_a_positive_count(tmp_path):
    from alpha_ckpt.errors import StoreUsageError
    store = _auto(tmp_path)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(StoreUsageError, match="writers"):
            store.write_modes.for_next_object(bad)


def _collective_saves_write_in_the_coordinators_mode(rank, world, store_dir, publisher):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from alpha_ckpt import Checkpointer
    from alpha_ckpt import dcp as alpha_dcp
    writer.DIRECT_MIN_BYTES = 1 << 20  # each rank's shard of 2 MB takes part in the mode choice
    # Each rank's own measurements (of saves by 2 ranks) favour another mode: rank 0 buffered, rank 1 direct.
    faster = "buffered" if rank == 0 else "direct"
    store = _auto(os.path.join(store_dir, "ckpt"))  # the DCP backend's store shares its measurements
    for mode in ("direct", "buffered") * 2:
        store.write_modes.record(mode, 1 << 30, 0.5 if mode == faster else 2.0, writers=world)
    w = distribute_tensor(torch.randn(1_000_000, generator=torch.Generator().manual_seed(1)),
                          init_device_mesh("cpu", (world,)), [Shard(0)])
    Checkpointer(store, run="r", step="s", publisher=publisher).save(
        {"w": w}, update=1, cursor=1)
    after_checkpointer = store.write_modes.stats(world)["modes"][4:]
    shared = Store(os.path.join(store_dir, "dcp"), write_mode=store.write_modes)
    dcp.save({"w": w}, storage_writer=alpha_dcp.StorageWriter(shared, run="r", update=1))
    dist.barrier()
    return {"checkpointer": after_checkpointer, "dcp": store.write_modes.stats(world)["modes"][5:],
            "alone": store.write_modes.stats(1)["modes"]}


@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_the_ranks_of_a_collective_save_write_in_the_coordinators_mode(tmp_path, publisher):
    # The Checkpointer and the DCP backend tell the store how many ranks write at once, and rank 0's
    # choice of mode holds for every rank: a save is written all buffered or all with O_DIRECT.
    from ranks import run_ranks
    results = run_ranks(2, _collective_saves_write_in_the_coordinators_mode, str(tmp_path), publisher, tmp=tmp_path,
                        timeout=120)
    assert results == [{"checkpointer": ["buffered"], "dcp": ["buffered"], "alone": []}] * 2


def _save_with_agreed_mode(store, monkeypatch, agreed, shards):
    commit = writer.commit_shards
    monkeypatch.setattr(writer, "commit_shards", lambda st, sh, writers=1, agreed_mode=None: commit(st, sh, writers, agreed))
    g = torch.Generator().manual_seed(5)
    alpha_ckpt.save({f"t{i}": torch.randn(300_000, generator=g) for i in range(shards)}, store=store, run="r",
                    step="s", update=1, cursor=1, epoch=0, max_shard_bytes=1_300_000)


@pytest.mark.parametrize("seeded, expected", [
    # measured: direct far faster; agreed: buffered -> the save is buffered
    ({"direct": [1e-3, 1e-3], "buffered": [10.0, 10.0]}, ["buffered"]),
    # still probing (one direct sample): the probe is made in direct whatever was agreed
    ({"direct": [1.0], "buffered": [1.0, 1.0]}, ["direct", "buffered"]),
])
def test_an_agreed_mode_holds_except_for_probes(tmp_path, monkeypatch, small_blocks, seeded, expected):
    store = _auto(tmp_path / "store")
    for mode, seconds in seeded.items():
        for s in seconds:
            store.write_modes.record(mode, 1 << 30, s)
    _save_with_agreed_mode(store, monkeypatch, "buffered", 2)
    assert store.write_modes.stats()["modes"][sum(map(len, seeded.values())):] == expected


@pytest.mark.parametrize("direct_over_margin, chosen", [(0.9, "buffered"), (1.05, "direct")])
def test_auto_takes_o_direct_only_when_it_is_clearly_faster(tmp_path, monkeypatch, direct_over_margin, chosen):
    # An O_DIRECT object is not left in the page cache, so a restore right after its save pays the
    # device: a small gain in the save does not buy that. Buffered writes here: 1.0 GB/s.
    from alpha_ckpt.store import DIRECT_MARGIN
    assert DIRECT_MARGIN > 1.0
    store = _auto(tmp_path)
    direct_gbps = DIRECT_MARGIN * direct_over_margin  # faster than buffered either way
    for _ in range(2):
        store.write_modes.record("direct", 1 << 30, (1 << 30) / 1e9 / direct_gbps)
        store.write_modes.record("buffered", 1 << 30, (1 << 30) / 1e9 / 1.0)
    assert store.write_modes.next() == (chosen, False)


def _first_collective_save(rank, world, store_dir, publisher):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from alpha_ckpt import Checkpointer
    writer.DIRECT_MIN_BYTES = 1 << 20  # each rank's 2 MB share of a tensor is a large shard
    # No measurements yet, so rank 0 probes; each rank's probes then favour another mode (rank 0's
    # buffered, rank 1's direct), which each rank alone would take for the rest of the save.
    faster = "buffered" if rank == 0 else "direct"
    real = WriteModes.record
    WriteModes.record = lambda self, mode, nbytes, seconds, refused=False, writers=1: real(
        self, mode, nbytes, seconds / 100 if mode == faster else seconds, refused, writers)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": distribute_tensor(torch.randn(1_000_000, generator=g), mesh, [Shard(0)]) for i in range(6)}
    ckpt = Checkpointer(_auto(os.path.join(store_dir, "ckpt")), run="r", step="s", publisher=publisher)
    ckpt.save(state, update=1, cursor=1)
    return ckpt.store.write_modes.stats(world)["modes"]


@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_a_first_collective_save_writes_buffered_beyond_each_ranks_probes(tmp_path, publisher):
    # While rank 0 has no measurement to send, the ranks make their probes (one large shard each, in
    # the same order on every rank) and write the rest of the save buffered, not each in its own choice.
    from ranks import run_ranks
    results = run_ranks(2, _first_collective_save, str(tmp_path), publisher, tmp=tmp_path, timeout=120)
    assert results == [["direct", "buffered", "direct", "buffered", "buffered"]] * 2
