"""alpha-ckpt gc: stale temp files, retention, unreachable objects; never what a kept or in-flight publish needs."""
import errno
import io
import json
import os
import time

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.launch import cli
from alpha_ckpt.errors import StoreUsageError
from alpha_ckpt.upkeep.gc import apply_gc, plan_gc
from alpha_ckpt.testing import simulate
from alpha_ckpt.generation.reader import validate_object_file, verify_generation
from alpha_ckpt.store import Store


def _save(store, update):
    return alpha_ckpt.save({"w": torch.full((100,), float(update))}, store=store, run="r", step="s", update=update,
                           cursor=update, epoch=0)


def _age_everything(root, seconds=7200):
    old = time.time() - seconds
    for d, _, files in os.walk(root):
        for f in files:
            os.utime(os.path.join(d, f), (old, old), follow_symlinks=False)


DEAD_PID = 99_999_999  # above the kernel's largest pid (2**22): no process has it


def _stray(store_dir, name=f"{DEAD_PID}-abcd.tmp"):
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
    from alpha_ckpt.generation.reader import open_generation
    with open_generation(store, root, wanted=[]) as g:
        return {m.digest for m in g.manifests} | {s.digest for m in g.manifests for s in m.shards}


def test_young_objects_and_temp_files_survive_the_grace_period(tmp_path):
    store = Store(tmp_path / "s")
    _save(store, 1)
    stray = _stray(tmp_path / "s")
    # as an in-flight publish would
    orphan, _ = store.put_object(lambda fd: (os.write(fd, b"x"), "ab" * 32)[1], validate=validate_object_file)
    apply_gc(store, plan_gc(store, grace=3600))
    assert stray.exists() and store.has_object(orphan)
    apply_gc(store, plan_gc(store, grace=0))  # even at grace 0, the last seconds are spared (clock slack)
    assert stray.exists() and store.has_object(orphan)
    apply_gc(store, plan_gc(store, grace=0, now=time.time() + 10))
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
    orphan, _ = store.put_object(lambda fd: (os.write(fd, b"y"), "cd" * 32)[1], validate=validate_object_file)
    stray = _stray(tmp_path / "s")
    path = store.object_path(root)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(30)
        f.write(b"#")
    plan = plan_gc(store, grace=0, now=time.time() + 10)
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
    _age_everything(_stray(tmp_path / "s").parent)
    out = io.StringIO()
    assert cli.main(["gc", "--store", str(tmp_path / "s"), "--grace", "0", "--json"], out=out) == 0
    report = json.loads(out.getvalue())
    assert report["tmp"] == 1 and report["kept_generations"] == 1 and report["dry_run"] is False


# ---------------------------------------------------------------- pending publishes

def _orphan(store, byte: bytes):
    """An object no ref names, as a publish in flight leaves it."""
    digest, _ = store.put_object(lambda fd: (os.write(fd, byte), blake3_of(byte))[1], validate=validate_object_file)
    return digest


def blake3_of(data: bytes) -> str:
    import blake3
    return blake3.blake3(data).hexdigest()


def _write_lease(store_dir, *, pid, host=None, started_at=None, pid_start=None, run="r", step="s"):
    import socket
    from alpha_ckpt.store.leases import Lease
    lease = Lease(f"{pid}-feedface", run, step, pid, pid_start, host or socket.gethostname(),
                  time.time() if started_at is None else started_at)
    path = store_dir / "pending" / lease.name
    path.write_bytes(lease.to_bytes())
    return path


def test_a_live_lease_spares_objects_younger_than_it_at_grace_zero_and_they_go_once_it_is_released(tmp_path):
    store = Store(tmp_path / "s")
    _save(store, 1)
    before_lease = _orphan(store, b"written before the lease")
    _age_everything(tmp_path / "s", 600)
    lease = store.pending_publish("r", "s")
    young = _orphan(store, b"written by the pending publish")
    later = time.time() + 60  # a gc a minute on, long past any clock slack
    plan = plan_gc(store, grace=0, now=later)
    apply_gc(store, plan)
    assert plan.live_leases == 1 and store.has_object(young) and not store.has_object(before_lease)
    assert len(os.listdir(tmp_path / "s" / "pending")) == 1
    lease.release()
    assert os.listdir(tmp_path / "s" / "pending") == []
    plan = plan_gc(store, grace=0, now=later)
    apply_gc(store, plan)
    assert plan.live_leases == 0 and not store.has_object(young)


def test_stale_leases_protect_nothing_and_are_removed(tmp_path):
    store = Store(tmp_path / "s")
    young = _orphan(store, b"left by a killed publisher")
    now = time.time()
    dead = _write_lease(tmp_path / "s", pid=DEAD_PID, started_at=now - 100)
    from alpha_ckpt.store.leases import process_start
    reused = _write_lease(tmp_path / "s", pid=os.getpid(), pid_start=process_start(os.getpid()) + 1,
                          started_at=now - 100)  # the pid now names another process
    ancient = _write_lease(tmp_path / "s", pid=1234, host="another-host", started_at=now - 7 * 3600)
    plan = plan_gc(store, grace=0, now=now + 60)
    assert plan.live_leases == 0 and sorted(plan.leases) == sorted(p.name for p in (dead, reused, ancient))
    apply_gc(store, plan)
    assert not store.has_object(young) and os.listdir(tmp_path / "s" / "pending") == []


def test_a_lease_from_another_host_is_trusted_until_it_is_six_hours_old(tmp_path):
    store = Store(tmp_path / "s")
    young = _orphan(store, b"written on another host")
    _write_lease(tmp_path / "s", pid=DEAD_PID, host="another-host", started_at=time.time() - 100)
    plan = plan_gc(store, grace=0, now=time.time() + 60)
    apply_gc(store, plan)
    assert plan.live_leases == 1 and store.has_object(young)


def test_an_object_renewed_after_planning_is_put_back_and_one_set_aside_by_a_killed_gc_returns(tmp_path):
    store = Store(tmp_path / "s")
    reused = _orphan(store, b"about to be reused")
    _age_everything(tmp_path / "s")
    plan = plan_gc(store, grace=0)
    assert plan.objects == [reused]
    assert store.renew_object(reused)  # a publish reuses it between planning and removal
    apply_gc(store, plan)
    assert store.has_object(reused) and os.listdir(tmp_path / "s" / "tmp") == []
    # A gc killed between setting an object aside and deciding leaves it in tmp/: the next one puts it back.
    os.rename(store.object_path(reused), tmp_path / "s" / "tmp" / f"aside-{reused}-{DEAD_PID}-0000")
    apply_gc(store, plan_gc(store, grace=3600))
    assert store.has_object(reused) and os.listdir(tmp_path / "s" / "tmp") == []


def test_a_temp_file_whose_writer_still_runs_is_never_swept(tmp_path):
    store = Store(tmp_path / "s")
    mine = _stray(tmp_path / "s", f"{os.getpid()}-0123456789abcdef.tmp")
    gone = _stray(tmp_path / "s")
    _age_everything(tmp_path / "s")
    apply_gc(store, plan_gc(store, grace=0))
    assert mine.exists() and not gone.exists()


# ---------------------------------------------------------------- retention, pins, completed steps

def test_a_pinned_generation_survives_keep_2_with_five_newer_generations_until_unpinned(tmp_path):
    store = Store(tmp_path / "s")
    pinned = _save(store, 1)
    out = io.StringIO()
    assert cli.main(["pin", "--store", str(tmp_path / "s"), pinned, "--note", "release candidate", "--json"],
                    out=out) == 0
    assert json.loads(out.getvalue())["new"] is True
    roots = [_save(store, u) for u in range(2, 7)]
    _age_everything(tmp_path / "s")
    assert cli.main(["gc", "--store", str(tmp_path / "s"), "--keep", "2", "--grace", "0"], out=io.StringIO()) == 0
    assert [r.root for r in store.list_refs("r", "s")] == [pinned, *roots[-2:]]  # the pin does not count toward K
    for root in (pinned, *roots[-2:]):
        verify_generation(store, root)
    out = io.StringIO()
    assert cli.main(["pins", "--store", str(tmp_path / "s"), "--json"], out=out) == 0
    (pin,) = json.loads(out.getvalue())["pins"]
    assert (pin["root"], pin["generation"], pin["note"]) == (pinned, 1, "release candidate")
    assert cli.main(["unpin", "--store", str(tmp_path / "s"), pinned], out=io.StringIO()) == 0
    assert cli.main(["unpin", "--store", str(tmp_path / "s"), pinned], out=io.StringIO()) == 3  # not pinned
    assert cli.main(["gc", "--store", str(tmp_path / "s"), "--keep", "2", "--grace", "0"], out=io.StringIO()) == 0
    assert [r.root for r in store.list_refs("r", "s")] == roots[-2:]
    assert not store.has_object(pinned)


def test_only_a_published_fully_valid_generation_can_be_pinned(tmp_path):
    store = Store(tmp_path / "s")
    root = _save(store, 1)
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["pin", "--store", str(tmp_path / "s"), "ab" * 32], out=out, err=err) == 3
    assert "no ref names it" in err.getvalue() and out.getvalue() == ""  # a refusal is on stderr
    shard = next(d for d in _objects_of(store, root) if d != root)
    path = store.object_path(shard)
    os.chmod(path, 0o644)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01
    open(path, "wb").write(data)
    err = io.StringIO()
    assert cli.main(["pin", "--store", str(tmp_path / "s"), root], out=io.StringIO(), err=err) == 3
    assert "corrupt-shard" in err.getvalue()
    assert not os.path.exists(tmp_path / "s" / "pins" / root)


def test_a_generation_with_a_missing_object_does_not_count_toward_keep(tmp_path):
    store = Store(tmp_path / "s")
    roots = [_save(store, u) for u in range(1, 5)]
    (shard,) = _objects_of(store, roots[-1]) - {roots[-1]}
    os.unlink(store.object_path(shard))
    _age_everything(tmp_path / "s")
    apply_gc(store, plan_gc(store, keep=2, grace=0))
    assert [r.root for r in store.list_refs("r", "s")] == roots[1:]  # the broken newest, then two complete ones


def test_completed_steps_discard_the_checkpoints_of_a_step_whose_output_is_published(tmp_path):
    store = Store(tmp_path / "s")
    done = [_save(store, u) for u in (1, 2, 3)]
    pinned = done[0]
    other = [alpha_ckpt.save({"w": torch.full((100,), -float(u))}, store=store, run="r", step="other", update=u,
                             cursor=u, epoch=0) for u in (1, 2)]
    assert cli.main(["pin", "--store", str(tmp_path / "s"), pinned], out=io.StringIO()) == 0
    output = tmp_path / "s" / "outputs" / "r" / "s" / "model-0123456789abcdef.safetensors"
    output.parent.mkdir(parents=True)
    output.write_bytes(b"the step's declared output")
    scratch = set().union(*(_objects_of(store, root) for root in done[1:]))
    _age_everything(tmp_path / "s")
    os.utime(output)  # published after every checkpoint of r/s
    out = io.StringIO()
    assert cli.main(["gc", "--store", str(tmp_path / "s"), "--completed-steps", "--grace", "0", "--json"],
                    out=out) == 0
    report = json.loads(out.getvalue())
    assert report["completed_steps"] == ["r/s"] and report["refs"] == ["r/s/2", "r/s/3"]
    assert [r.root for r in store.list_refs("r", "s")] == [pinned]
    assert [r.root for r in store.list_refs("r", "other")] == other
    for root in (pinned, *other):
        verify_generation(store, root)
    assert scratch and not any(store.has_object(d) for d in scratch)
    # A continuation publishes after the output: its generation is no completed step's scratch.
    later = _save(store, 4)
    assert cli.main(["gc", "--store", str(tmp_path / "s"), "--completed-steps", "--grace", "0"],
                    out=io.StringIO()) == 0
    assert [r.root for r in store.list_refs("r", "s")] == [pinned, later]


# ---------------------------------------------------------------- a store that cannot be written

def _snapshot(store_dir):
    return {os.path.relpath(os.path.join(d, n), store_dir): os.lstat(os.path.join(d, n)).st_mtime_ns
            for d, dirs, files in os.walk(store_dir) for n in dirs + files}


def _refuse_writes(monkeypatch, error):
    """Every call that would change the store fails with ``error``, as on a read-only file system."""
    from alpha_ckpt.store import durable

    def refuse(*args, **kwargs):
        raise OSError(error, os.strerror(error))

    real_open, real_stat = os.open, os.stat

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse()
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, dir_fd=None, **kwargs):
        try:
            real_stat(path, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            refuse()
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))  # EEXIST comes first, as in the kernel

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)
    for name in ("unlink", "rmdir", "rename", "link", "utime"):
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(durable, "rename_noreplace", refuse)


@pytest.mark.parametrize("error", [errno.EROFS, errno.EACCES], ids=["EROFS", "EACCES"])
def test_gc_pin_and_unpin_on_a_store_that_cannot_be_written_exit_1_naming_it_and_change_nothing(
        tmp_path, monkeypatch, error):
    store_dir = tmp_path / "s"
    store = Store(store_dir)
    roots = [_save(store, u) for u in (1, 2, 3)]
    assert cli.main(["pin", "--store", str(store_dir), roots[0]], out=io.StringIO()) == 0
    _stray(store_dir)
    _age_everything(store_dir)
    before = _snapshot(store_dir)
    _refuse_writes(monkeypatch, error)
    for argv in (["gc", "--grace", "0", "--keep", "2"], ["pin", roots[1]], ["unpin", roots[0]]):
        out, err = io.StringIO(), io.StringIO()
        assert cli.main([argv[0], "--store", str(store_dir), *argv[1:]], out=out, err=err) == 1, argv
        assert str(store_dir) in err.getvalue()
    for argv in (["gc", "--grace", "0", "--keep", "2", "--dry-run"], ["pins"], ["verify", roots[0]], ["list"]):
        assert cli.main([argv[0], "--store", str(store_dir), *argv[1:]], out=io.StringIO(),
                        err=io.StringIO()) == 0, argv
    monkeypatch.undo()
    assert _snapshot(store_dir) == before


_READ_ONLY_SCRIPT = r"""
import io, json, os, subprocess, sys, time
import torch
import alpha_ckpt
from alpha_ckpt.launch import cli

mount, store = sys.argv[1], os.path.join(sys.argv[1], "store")
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", mount], check=True)
roots = [alpha_ckpt.save({"w": torch.full((8,), float(u))}, store=store, run="r", step="s", update=u, cursor=u,
                         epoch=0) for u in (1, 2, 3)]
cli.main(["pin", "--store", store, roots[0]], out=io.StringIO())
stray = os.path.join(store, "tmp", "99999999-abcd.tmp")
open(stray, "wb").write(b"half a shard")
old = time.time() - 7200
for d, _, files in os.walk(store):
    for f in files:
        os.utime(os.path.join(d, f), (old, old))
subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
results = {}
commands = {"gc": ["gc", "--grace", "0", "--keep", "2"], "pin": ["pin", roots[1]], "unpin": ["unpin", roots[0]],
            "gc --dry-run": ["gc", "--grace", "0", "--keep", "2", "--dry-run"], "pins": ["pins"],
            "verify": ["verify", roots[2]]}
for name, argv in commands.items():
    err = io.StringIO()
    code = cli.main([argv[0], "--store", store, *argv[1:]], out=io.StringIO(), err=err)
    results[name] = [code, store in err.getvalue()]
results["refs"] = sorted(os.listdir(os.path.join(store, "refs", "r", "s")))
results["stray"] = os.path.exists(stray)
results["pinned"] = os.path.exists(os.path.join(store, "pins", roots[0]))
print(json.dumps(results))
"""


@pytest.mark.timeout(120)
def test_gc_pin_and_unpin_on_a_really_read_only_file_system_exit_1(tmp_path):
    import shutil
    import subprocess
    import sys
    mount = tmp_path / "mnt"
    mount.mkdir()
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare, "-m", "sh", "-c", f"mount -t tmpfs tmpfs {mount} && mount -o remount,ro {mount}"],
                           capture_output=True, timeout=30) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("mounting a read-only file system is not permitted here")
    # A mount namespace of its own: the mount disappears with the process, whatever happens to it.
    proc = subprocess.run([unshare, "-m", "--propagation", "private", sys.executable, "-c", _READ_ONLY_SCRIPT,
                           str(mount)], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["gc"] == [1, True] and results["pin"] == [1, True] and results["unpin"] == [1, True]
    assert results["gc --dry-run"][0] == 0 and results["pins"][0] == 0 and results["verify"][0] == 0
    assert results["refs"] == ["0000000001", "0000000002", "0000000003"] and results["stray"] and results["pinned"]
