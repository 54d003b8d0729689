"""alpha-ckpt gc: stale temp files, retention, unreachable objects; never what a kept or in-flight publish needs."""
import io
import json
import os
import time

import pytest
import torch

import alpha_ckpt
from alpha_ckpt import cli
from alpha_ckpt.errors import StoreUsageError
from alpha_ckpt.gc import apply_gc, plan_gc
from alpha_ckpt.publish import simulate
from alpha_ckpt.restore import verify_generation
from alpha_ckpt.store import Store


def _save(store, update):
    return alpha_ckpt.save({"w": torch.full((100,), float(update))}, store=store, run="r", step="s", update=update,
                           cursor=update, epoch=0)


def _age_everything(root, seconds=7200):
    old = time.time() - seconds
    for d, _, files in os.walk(root):
        for f in files:
            os.utime(os.path.join(d, f), (old, old), follow_symlinks=False)


def _stray(store_dir, name="1234-abcd.tmp"):
    path = store_dir / "tmp" / name
    path.write_bytes(b"half a shard")
    return path


def test_retention_keeps_the_newest_generations_and_removes_what_only_older_ones_reached(tmp_path):
    store = Store(tmp_path / "s")
    roots = [_save(store, u) for u in range(1, 5)]
    stray = _stray(tmp_path / "s")
    _age_everything(tmp_path / "s")
    plan = plan_gc(store, keep=2, grace=60)
    apply_gc(store, plan)
    assert [r.root for r in store.list_refs("r", "s")] == roots[2:]
    for root in roots[2:]:
        verify_generation(store, root)
    assert not stray.exists() and len(plan.refs) == 2 and len(plan.objects) == 4  # two shards, two manifests
    assert set(store.iter_objects()) == {d for root in roots[2:] for d in _objects_of(store, root)}


def _objects_of(store, root):
    from alpha_ckpt.restore import open_generation
    with open_generation(store, root, wanted=[]) as g:
        return {m.digest for m in g.manifests} | {s.digest for m in g.manifests for s in m.shards}


def test_young_objects_and_temp_files_survive_the_grace_period(tmp_path):
    store = Store(tmp_path / "s")
    _save(store, 1)
    stray = _stray(tmp_path / "s")
    orphan, _ = store.put_object(lambda fd: (os.write(fd, b"x"), "ab" * 32)[1])  # as an in-flight publish would
    apply_gc(store, plan_gc(store, grace=3600))
    assert stray.exists() and store.has_object(orphan)
    apply_gc(store, plan_gc(store, grace=0))
    assert not stray.exists() and not store.has_object(orphan)


def test_an_object_reused_by_a_new_publish_is_young_again(tmp_path):
    store = Store(tmp_path / "s")
    _save(store, 1)
    _age_everything(tmp_path / "s")
    apply_gc(store, plan_gc(store, keep=2))  # nothing to drop yet
    before = set(store.iter_objects())
    _save(store, 1)  # a second generation with the same bytes reuses every object
    assert all(time.time() - os.stat(store.object_path(d)).st_mtime < 60 for d in before)


def test_tree_generations_keep_every_group_manifest_and_shard(tmp_path):
    store = Store(tmp_path / "s")
    report, _ = simulate.publish(store, 13, 3)
    _age_everything(tmp_path / "s")
    plan = plan_gc(store, grace=0)
    assert plan.objects == [] and plan.reachable == 13 * 2
    apply_gc(store, plan)
    verify_generation(store, report.root)


def test_a_damaged_kept_generation_stops_object_removal_but_not_the_temp_sweep(tmp_path):
    store = Store(tmp_path / "s")
    root = _save(store, 1)
    orphan, _ = store.put_object(lambda fd: (os.write(fd, b"y"), "cd" * 32)[1])
    stray = _stray(tmp_path / "s")
    path = store.object_path(root)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(30)
        f.write(b"#")
    plan = plan_gc(store, grace=0)
    apply_gc(store, plan)
    assert plan.unreadable == [root] and store.has_object(orphan) and not stray.exists()


def test_keeping_fewer_than_two_generations_is_a_usage_error(tmp_path):
    store = Store(tmp_path / "s")
    with pytest.raises(StoreUsageError):
        plan_gc(store, keep=1)
    out = io.StringIO()
    assert cli.main(["gc", "--store", str(tmp_path / "s"), "--keep", "1"], out=out) == 2


def test_the_command_line_reports_what_it_removed(tmp_path):
    store = Store(tmp_path / "s")
    _save(store, 1)
    _stray(tmp_path / "s")
    out = io.StringIO()
    assert cli.main(["gc", "--store", str(tmp_path / "s"), "--grace", "0", "--json"], out=out) == 0
    report = json.loads(out.getvalue())
    assert report["tmp"] == 1 and report["kept_generations"] == 1 and report["dry_run"] is False
