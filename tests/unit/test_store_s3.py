"""A store on S3 (a real server, SeaweedFS, behind a proxy that counts the requests as the server sees
them): real training state saves and restores bit for bit, the save and the restore never list the
bucket, a URL is its own store, and a server that ignores a conditional write is refused."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

import alpha_ckpt
import alpha_ckpt.store.s3 as s3
from alpha_ckpt.format.records import digest_bytes
from alpha_ckpt.errors import StoreUsageError
from alpha_ckpt.store import Store
from alpha_ckpt.store.s3 import S3Backend, MAX_PARTS, MIN_PART_BYTES, MAX_PART_BYTES, part_bytes, part_ranges, parse_url
from alpha_ckpt.testing.s3_proxy import S3Proxy
from gpt_training import Trainer, assert_identical
from hypothesis import given, strategies as st

MASKS = ("*.causal_mask",)


def _state(t: Trainer) -> dict:
    return {"model": t.model, "optim": t.optim, "warmup": t.warmup, "steps": t.steps, "side": t.side,
            "cycle": t.cycle, "loader": t.data, "rng": alpha_ckpt.RNGState(), "step": t.step}


@pytest.fixture
def counted(s3_server, s3_store, monkeypatch):
    """(the store's URL, the proxy counting its requests)."""
    with S3Proxy(s3_server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield s3_store, proxy


def test_training_state_saved_on_s3_restores_bit_for_bit_and_neither_path_lists_the_bucket(counted):
    url, proxy = counted
    uninterrupted = Trainer(seed=0)
    uninterrupted.train(5)
    fresh, trained = Trainer(seed=7), Trainer(seed=0)
    trained.train(3)
    root = alpha_ckpt.save(_state(trained), store=url, run="r", step="s", update=3, cursor=12, epoch=0,
                           allow_nonfinite=MASKS)
    saved = dict(proxy.counts)
    assert alpha_ckpt.latest(url, "r", "s") == root
    counters = alpha_ckpt.restore(_state(fresh), store=url, root=root)
    assert (counters.update, counters.cursor, counters.epoch) == (3, 12, 0)
    assert proxy.counts["LIST"] == 0 and saved["PUT"] > 0 and proxy.counts["GET"] > 0
    assert_identical(fresh.model.state_dict(), trained.model.state_dict())
    assert_identical(fresh.optim.state_dict(), trained.optim.state_dict())
    assert_identical(fresh.loader.state_dict(), trained.loader.state_dict())
    fresh.train(2)
    assert fresh.losses == uninterrupted.losses[3:]  # training goes on as if never interrupted
    alpha_ckpt.verify(url, root)


def test_a_second_generation_finds_the_head_without_a_listing_and_reuses_what_is_unchanged(counted):
    url, proxy = counted
    trained = Trainer(seed=0)
    roots = []
    for update in (1, 2, 3):
        trained.train(1)
        roots.append(alpha_ckpt.save(_state(trained), store=url, run="r", step="s", update=update, cursor=update,
                                     epoch=0, allow_nonfinite=MASKS))
    with Store(url, create=False) as store:
        assert [r.root for r in store.list_refs("r", "s")] == roots
        assert store.newest_ref("r", "s").generation == 3
    assert alpha_ckpt.latest(url, "r", "s") == roots[-1]


def test_a_large_object_is_uploaded_in_parts_and_read_back_in_ranges(counted):
    import torch
    url, proxy = counted
    state = {"w": torch.arange(12 << 20, dtype=torch.float32)}  # 48 MiB: a multipart upload
    root = alpha_ckpt.save(state, store=url, run="r", step="big", update=1, cursor=0, epoch=0)
    assert proxy.counts["POST"] >= 2  # create and complete of a multipart upload
    back = {"w": torch.zeros(12 << 20, dtype=torch.float32)}
    alpha_ckpt.restore(back, store=url, root=root)
    assert torch.equal(back["w"], state["w"]) and proxy.counts["LIST"] == 0


@given(st.integers(min_value=0, max_value=6 << 40))
def test_parts_cover_an_object_within_s3s_limits(size):
    part = part_bytes(size)
    ranges = part_ranges(size, part)
    assert MIN_PART_BYTES <= part <= MAX_PART_BYTES and len(ranges) <= MAX_PARTS
    assert sum(hi - lo for lo, hi in ranges) == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("url, bucket, prefix", [
    ("s3://ckpt", "ckpt", ""), ("s3://ckpt/", "ckpt", ""), ("s3://ckpt/a/b/", "ckpt", "a/b"),
    ("s3://ckpt//a//b", "ckpt", "a/b"),
])
def test_an_s3_url_names_a_bucket_and_a_prefix(url, bucket, prefix):
    assert parse_url(url) == (bucket, prefix)


@pytest.mark.parametrize("url", ["s3://Upper/x", "s3://ab/x", "s3://ckpt/../x", "s3://ckpt/a b", "s3:///x"])
def test_an_s3_url_that_names_no_bucket_or_an_odd_prefix_is_a_usage_error(url):
    with pytest.raises(StoreUsageError) as refused:
        parse_url(url)
    assert url in str(refused.value)


def test_a_missing_bucket_is_a_usage_error_naming_the_store(s3_server, monkeypatch):
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StoreUsageError) as refused:
        Store("s3://no-such-bucket/x")
    assert "s3://no-such-bucket/x" in str(refused.value) and s3_server.SECRET_KEY not in str(refused.value)


def test_of_jobs_racing_to_publish_one_generation_on_s3_exactly_one_wins_and_the_others_refuse(s3_store):
    import threading
    from alpha_ckpt.errors import PublishConflict, Refusal
    from alpha_ckpt.format.records import CapturePrefix
    stores = [Store(s3_store) for _ in range(6)]  # each its own client, as separate jobs
    start, outcomes = threading.Barrier(len(stores)), []

    def publish(i: int) -> None:
        start.wait()
        try:
            stores[i].publish_ref(CapturePrefix("r", "s", 1, 1, 0), f"{i:064x}", 100, 100, 1, follows=0)
            outcomes.append("won")
        except PublishConflict:
            outcomes.append("conflict")
        except Refusal as refusal:
            outcomes.append(refusal.code.value)
    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcomes.count("won") == 1 and len(outcomes) == len(stores)
    assert set(outcomes) - {"won"} <= {"conflict", "fenced"}
    with stores[0].backend.ref_dir("r", "s", create=False) as refs:
        assert refs.numbers() == [1]
    for store in stores:
        store.close()


def test_a_restore_asks_for_the_first_range_of_every_object_before_any_other_range(s3_store, monkeypatch):
    # A restore reads every object's head (in its first range) before it verifies a payload byte: heads queued
    # behind whole objects would keep the verification waiting for almost every byte to arrive.
    monkeypatch.setattr(s3, "READ_PART_BYTES", 1 << 16)
    objects = [bytes([i]) * ((3 << 16) + 7) for i in range(3)]
    backend = S3Backend(s3_store)
    try:
        backend.put_objects([_put(data) for data in objects], 2)
        backend._parts.shutdown()
        backend._parts = ThreadPoolExecutor(1)  # one GET at a time: the order they are asked for
        asked: list[tuple[str, int]] = []
        read_sized = backend._read_sized
        monkeypatch.setattr(backend, "_read_sized",
                            lambda obj, view, span, what: asked.append((obj.digest, span[0])) or
                            read_sized(obj, view, span, what))
        opened = backend.open_objects([(digest_bytes(d), len(d)) for d in objects], "shard")
        try:
            assert [bytes(obj.view()) for obj in opened] == objects
        finally:
            for obj in opened:
                obj.close()
        names = [digest_bytes(d) for d in objects]
        assert asked[:3] == [(name, 0) for name in names]
        assert sorted(asked[3:]) == sorted((name, lo) for name in names for lo in (1 << 16, 2 << 16, 3 << 16))
    finally:
        backend.close()


def _put(data: bytes):
    def write(fd: int) -> str:
        os.write(fd, data)
        return digest_bytes(data)
    return write
