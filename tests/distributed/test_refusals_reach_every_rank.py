"""A save that one rank cannot capture refuses on every rank at once, not after the group's timeout."""
import time

import pytest
import torch

from alpha_ckpt import Checkpointer
from ranks import run_ranks

PG_TIMEOUT_S = 60  # tests/ranks.py's process-group timeout: a rank left waiting would die only after it


class Unencodable:
    """A value no state may hold (not a tensor, not Stateful, not a plain value)."""


def save_where_rank_1_cannot_encode(rank, world, store, publisher, save):
    ckpt = Checkpointer(store, run="r", publisher=publisher, save=save)
    state = {"w": torch.arange(4.0), "tag": Unencodable() if rank == 1 else "fine"}
    t0 = time.monotonic()
    try:
        handle = ckpt.save(state, update=1)
        if save == "async":
            handle.result()
        return {"published": True}
    finally:
        elapsed = time.monotonic() - t0
        assert elapsed < PG_TIMEOUT_S / 4, f"rank {rank} waited {elapsed:.1f} s for a refusal"
        try:
            ckpt.close()
        except Exception:  # noqa: BLE001 - async: close raises the save's failure again
            pass


@pytest.mark.timeout(90)
@pytest.mark.parametrize("publisher,save", [("star", "sync"), ("tree", "sync"), ("star", "async")])
def test_a_value_only_rank_1_cannot_encode_refuses_on_every_rank_promptly(tmp_path, publisher, save):
    results = run_ranks(2, save_where_rank_1_cannot_encode, str(tmp_path / "s"), publisher, save, tmp=tmp_path)
    assert [r.get("refusal") for r in results] == ["format", "format"], results
    assert results[0]["message"] == results[1]["message"]  # the same refusal, naming rank 1's entry


def save_where_rank_0s_root_publish_fails_unexpectedly(rank, world, store):
    from alpha_ckpt.errors import PublishFailed
    from alpha_ckpt.tiers.durable import star as module

    def broken(*args, **kwargs):
        raise RuntimeError("an unexpected failure while writing the root manifest")
    if rank == 0:
        module.write_manifest = broken  # this rank's process only
    ckpt = Checkpointer(store, run="r", publisher="star")
    t0 = time.monotonic()
    try:
        ckpt.save({"w": torch.arange(4.0)}, update=1)
        outcome = "published"
    except PublishFailed:
        outcome = "publish-failed"
    elapsed = time.monotonic() - t0
    ckpt.close()
    return {"outcome": outcome, "prompt": elapsed < PG_TIMEOUT_S / 4}


@pytest.mark.timeout(90)
def test_an_unexpected_failure_of_rank_0s_root_publish_fails_the_save_on_every_rank_at_once(tmp_path):
    from alpha_ckpt.store import Store
    store = str(tmp_path / "store")
    results = run_ranks(2, save_where_rank_0s_root_publish_fails_unexpectedly, store, tmp=tmp_path)
    assert results == [{"outcome": "publish-failed", "prompt": True}] * 2
    with Store(store, create=False) as s:
        assert s.list_refs("r", "train") == []


class _LeasesRefused:
    """A file system store whose pending-publish leases cannot be written (a full file system)."""

    def __init__(self, own):
        self.own, self.location = own, own.location

    def __getattr__(self, name: str):
        return getattr(self.own, name)

    def put_lease(self, name: str, body: bytes) -> None:
        import errno
        raise OSError(errno.ENOSPC, "No space left on device")


def save_where_rank_1_cannot_take_its_lease(rank, world, path, publisher):
    from alpha_ckpt.errors import PublishFailed
    from alpha_ckpt.store import PosixBackend, Store, StoreLayout
    if rank == 0:
        Store(path).close()
    torch.distributed.barrier()
    backend = PosixBackend(StoreLayout(path), create=False)
    store = Store(_LeasesRefused(backend) if rank == 1 else backend, create=False)
    ckpt = Checkpointer(store, run="r", publisher=publisher)
    t0 = time.monotonic()
    try:
        ckpt.save({"w": torch.arange(4.0)}, update=1)
        outcome = "published"
    except PublishFailed as exc:
        outcome = str(exc)
    elapsed = time.monotonic() - t0
    ckpt.close()
    store.close()
    return {"outcome": outcome, "prompt": elapsed < PG_TIMEOUT_S / 4}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_a_lease_one_rank_cannot_write_fails_the_save_on_every_rank_promptly_naming_it(tmp_path, publisher):
    from alpha_ckpt.store import Store
    path = str(tmp_path / "s")
    results = run_ranks(2, save_where_rank_1_cannot_take_its_lease, path, publisher, tmp=tmp_path)
    assert all(r["prompt"] for r in results), results
    assert all("lease" in r["outcome"] and "1" in r["outcome"] for r in results), results
    with Store(path, create=False) as store:
        assert store.list_refs("r", "train") == []  # nothing published
