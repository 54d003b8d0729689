"""gc, retention and pins on an S3 store (a real server, SeaweedFS): what no kept generation reaches goes,
what a save reuses while gc runs stays (the renewal and the doomed marker meet), abandoned multipart
uploads older than the grace period are aborted, and a pin keeps its generation whatever the retention."""
import threading
import time

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.store import Store
from alpha_ckpt.store import s3 as s3_backend
from alpha_ckpt.generation.packing import ShardCarry
from alpha_ckpt.store.leases import CLOCK_SLACK_S
from alpha_ckpt.upkeep.gc import apply_gc, plan_gc, retain_newest
from alpha_ckpt.upkeep.pins import list_pins, pin_generation, unpin_generation


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(9, generator=g).double()}


def _save(url: str, state: dict, update: int) -> str:
    return alpha_ckpt.save(state, store=url, run="r", step="s", update=update, cursor=update, epoch=0)


def _restores(url: str, root: str, state: dict) -> bool:
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    alpha_ckpt.restore(back, store=url, root=root)
    return all(torch.equal(back[k], state[k]) for k in state)


def _objects(url: str) -> set[str]:
    with Store(url, create=False) as store:
        return set(store.iter_objects())


@pytest.mark.slow
def test_retention_on_s3_keeps_the_newest_and_removes_only_what_nothing_kept_reaches(s3_store):
    states = [_state(i) for i in range(4)]
    roots = [_save(s3_store, s, i + 1) for i, s in enumerate(states)]
    before = _objects(s3_store)
    time.sleep(CLOCK_SLACK_S + 1.5)  # older than what gc protects with --grace 0 (server times: whole seconds)
    with Store(s3_store) as store:
        plan = retain_newest(store, "r", "s", 2)
        assert [r.root for r in store.list_refs("r", "s")] == roots[2:]
        assert alpha_ckpt.latest(store, "r", "s") == roots[-1]
    assert {r.root for r in plan.refs} == set(roots[:2])
    assert _objects(s3_store) < before and roots[0] not in _objects(s3_store)
    assert _restores(s3_store, roots[2], states[2]) and _restores(s3_store, roots[3], states[3])
    alpha_ckpt.verify(s3_store, roots[3])
    # A later save continues the history after the removed numbers.
    assert _save(s3_store, _state(9), 5) == alpha_ckpt.latest(s3_store, "r", "s")
    with Store(s3_store, create=False) as store:
        assert [r.generation for r in store.list_refs("r", "s")] == [3, 4, 5]


def test_an_object_a_save_reuses_after_gc_planned_is_not_removed(s3_store):
    carry = ShardCarry()  # what this writer stored: an unchanged region's shard is named again, and renewed
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1 << 19, generator=g)  # 2 MiB: a shard of its own, carried while unchanged

    def save(state: dict, update: int, carry: ShardCarry | None = None) -> str:
        return alpha_ckpt.save(state, store=s3_store, run="r", step="s", update=update, cursor=update, epoch=0,
                               carry=carry)
    roots = [save({"big": big, "small": torch.ones(3)}, 1, carry)]
    with Store(s3_store) as store:
        big_shard = {d for d in store.iter_objects() if store.object_size(d) > 1 << 20}
    roots += [save({"big": torch.randn(1 << 19, generator=g), "small": torch.zeros(3)}, u) for u in (2, 3, 4)]
    time.sleep(CLOCK_SLACK_S + 1.5)  # server times are whole seconds
    with Store(s3_store) as store:
        plan = plan_gc(store, keep=2, grace=0.0)
        assert len(big_shard) == 1 and big_shard <= set(plan.objects)  # nothing kept reaches it: planned to go
        again = save({"big": big, "small": torch.full((3,), 2.0)}, 5, carry)  # carries it: renewed after planning
        assert carry.bytes_carried > 0
        apply_gc(store, plan)
    assert big_shard <= _objects(s3_store) and roots[0] not in _objects(s3_store)
    back = {"big": torch.zeros_like(big), "small": torch.zeros(3)}
    alpha_ckpt.restore(back, store=s3_store, root=again)
    assert torch.equal(back["big"], big)
    alpha_ckpt.verify(s3_store, again)


def test_a_renewal_that_meets_a_doomed_marker_waits_for_gc_and_says_whether_the_object_stayed(s3_store):
    root = _save(s3_store, _state(0), 1)
    with Store(s3_store) as store:
        backend = store.backend
        name = next(iter(store.iter_objects()))
        marker = backend.key(s3_backend.DOOMED, name)
        backend.client.put_object(Bucket=backend.bucket, Key=marker, Body=b"")
        answer = []
        renewing = threading.Thread(target=lambda: answer.append(backend.renew_object(name)))
        renewing.start()
        time.sleep(0.5)
        assert renewing.is_alive() and not answer  # it waits while the marker stands
        backend.client.delete_object(Bucket=backend.bucket, Key=backend._object_key(name))
        backend.client.delete_object(Bucket=backend.bucket, Key=marker)
        renewing.join(10)
        assert answer == [False]  # gone: the caller puts its own copy
    assert root


def test_a_doomed_marker_older_than_the_bound_is_a_killed_gcs_and_is_passed(s3_store, monkeypatch):
    _save(s3_store, _state(0), 1)
    monkeypatch.setattr(s3_backend, "DOOM_BOUND_S", 1.0)
    with Store(s3_store) as store:
        backend = store.backend
        name = next(iter(store.iter_objects()))
        backend.client.put_object(Bucket=backend.bucket, Key=backend.key(s3_backend.DOOMED, name), Body=b"")
        time.sleep(2.0)
        started = time.monotonic()
        assert backend.renew_object(name) and time.monotonic() - started < 1.0


@pytest.mark.slow
def test_gc_aborts_an_abandoned_multipart_upload_older_than_the_grace_and_keeps_a_young_one(s3_store):
    _save(s3_store, _state(0), 1)
    with Store(s3_store) as store:
        b = store.backend
        old = b.client.create_multipart_upload(Bucket=b.bucket, Key=b.key("objects", "ab", "ab" + "0" * 62))
        probe = b.client.create_multipart_upload(Bucket=b.bucket, Key=b.key("probe", "123-killed"))  # a killed probe's
        time.sleep(CLOCK_SLACK_S + 1.5)  # server times are whole seconds
        young = b.client.create_multipart_upload(Bucket=b.bucket, Key=b.key("objects", "cd", "cd" + "0" * 62))
        plan = plan_gc(store, grace=CLOCK_SLACK_S + 0.2)
        assert sorted(t.rsplit("=", 1)[1] for t in plan.tmp) == sorted([old["UploadId"], probe["UploadId"]])
        apply_gc(store, plan)
        left = b.client.list_multipart_uploads(Bucket=b.bucket, Prefix=b.key("") + "/").get("Uploads", [])
        assert [u["UploadId"] for u in left] == [young["UploadId"]]


def test_a_pinned_generation_on_s3_outlives_retention_until_unpinned(s3_store):
    states = [_state(i) for i in range(4)]
    roots = [_save(s3_store, s, i + 1) for i, s in enumerate(states)]
    with Store(s3_store) as store:
        pin, new = pin_generation(store, roots[0], "the baseline")
        assert new and pin.generation == 1
        assert pin_generation(store, roots[0])[1] is False
        retain_newest(store, "r", "s", 2)
        assert [r.root for r in store.list_refs("r", "s")] == [roots[0], *roots[2:]]
        assert [p.root for p in list_pins(store)] == [roots[0]]
    assert _restores(s3_store, roots[0], states[0])
    with Store(s3_store) as store:
        assert unpin_generation(store, roots[0]) and list_pins(store) == []
        retain_newest(store, "r", "s", 2)
        assert [r.root for r in store.list_refs("r", "s")] == roots[2:]
