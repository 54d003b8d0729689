"""One "newest": publish, latest, restore("latest") and gc agree when refs are damaged; a pin made while gc
is between planning and applying keeps its ref."""
import io
import json
import os
import shutil
import time

import pytest
import torch

import alpha_ckpt
from alpha_ckpt import Checkpointer, RefusalCode
from alpha_ckpt.launch import cli
from alpha_ckpt.errors import Refusal
from alpha_ckpt.format.records import CapturePrefix, canonical_json, digest_bytes
from alpha_ckpt.generation.reader import verify_generation
from alpha_ckpt.store import RefRecord, Store, check_fence
from alpha_ckpt.testing import launch
from ranks import run_ranks


def _state(update):
    return {"w": torch.full((64,), float(update)), "progress": {"update": update}}


def _save(store_dir, update, epoch=0):
    return alpha_ckpt.save(_state(update), store=store_dir, run="r", step="train", update=update, cursor=update,
                           epoch=epoch)


def _checkpoint_updates(rank, world, store_dir, updates):
    ckpt = Checkpointer(store_dir, run="r")
    ckpt.restore(_state(0), None)
    roots = [ckpt.save(_state(u), update=u, cursor=u).root for u in updates]
    ckpt.close()
    return roots


@pytest.fixture(scope="module")
def three_generations(tmp_path_factory):
    """A store whose run r/train has generations 1-3 (updates 1-3), published by a Checkpointer."""
    tmp = tmp_path_factory.mktemp("three")
    (roots,) = run_ranks(1, _checkpoint_updates, str(tmp / "s"), [1, 2, 3], tmp=tmp)
    return tmp / "s", roots


def _ref(store_dir, generation):
    return store_dir / "refs" / "r" / "train" / f"{generation:010d}"


def _damage(store_dir, generation, kind, tmp_path):
    path = _ref(store_dir, generation)
    data = path.read_bytes()
    os.chmod(path, 0o644)
    if kind == "flipped-byte":
        path.write_bytes(data[:10] + bytes([data[10] ^ 0x01]) + data[11:])
        return
    if kind == "empty":
        path.write_bytes(b"")
        return
    if kind == "unreadable-counters":  # what an older version wrote for save(update=2.5): checksum intact
        body = json.loads(data.split(b"\n")[0])
        body["prefix"]["update"] = 2.5
        line = canonical_json(body)
        path.write_bytes(line + b"\n" + digest_bytes(line).encode("ascii") + b"\n")
        return
    os.unlink(path)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":  # to the intact ref, moved outside: never followed
        outside = tmp_path / "outside-ref"
        outside.write_bytes(data)
        os.symlink(outside, path)


def _latest(store_dir):
    out = io.StringIO()
    code = cli.main(["latest", "--store", str(store_dir), "--run", "r", "--step", "train", "--json"], out=out)
    return code, json.loads(out.getvalue())


def _gc(store_dir):
    out = io.StringIO()
    assert cli.main(["gc", "--store", str(store_dir), "--keep", "2", "--grace", "0", "--json"], out=out,
                    err=io.StringIO()) == 0
    return json.loads(out.getvalue())


def _tree(path):
    return sorted((p.relative_to(path).as_posix(), p.lstat().st_mtime_ns) for p in path.rglob("*")
                  if "pending" not in p.parts)


def _resume_latest_and_publish(rank, world, store_dir):
    from pathlib import Path
    state = {"w": torch.zeros(64), "progress": {"update": -1}}
    ckpt = Checkpointer(store_dir, run="r")
    before = _tree(Path(store_dir))
    counters = ckpt.restore(state, "latest")
    unchanged = _tree(Path(store_dir)) == before  # a resume writes nothing, damaged refs included
    restored = [state["w"][0].item(), state["progress"]["update"]]
    update = counters.update + 1
    state["w"].fill_(float(update))
    state["progress"]["update"] = update
    root = ckpt.save(state, update=update, cursor=update).root
    generation = ckpt.last_save["generation"]
    ckpt.close()
    return {"restored": counters.update, "values": restored, "unchanged": unchanged, "root": root, "generation": generation, "epoch": counters.epoch}


KINDS = ["flipped-byte", "empty", "directory", "fifo", "symlink", "unreadable-counters"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_newest_ref_is_passed_over_by_latest_restore_publish_and_gc_alike_and_nothing_is_lost(
        tmp_path, three_generations, kind):
    store_dir = tmp_path / "s"
    shutil.copytree(three_generations[0], store_dir, symlinks=True)
    roots = three_generations[1]
    _damage(store_dir, 3, kind, tmp_path)

    # `alpha-ckpt latest` names generation 2 and the ref it passed over.
    code, latest = _latest(store_dir)
    assert code == 0 and latest["latest"]["root"] == roots[1]
    assert [s["code"] for s in latest["skipped"]] in (["corrupt-shard"], ["format"])

    # gc keeps every readable generation and leaves the damaged newest ref in place: its number is taken.
    before_publish = _gc(store_dir)
    assert os.path.lexists(_ref(store_dir, 3))

    # restore("latest") resumes generation 2 without touching the store; the continuation publishes generation 4.
    (resumed,) = run_ranks(1, _resume_latest_and_publish, str(store_dir), tmp=tmp_path)
    assert "refusal" not in resumed, resumed
    assert resumed["restored"] == 2 and resumed["values"] == [2.0, 2] and resumed["unchanged"]
    assert resumed["generation"] == 4
    assert before_publish["refs"] == [] and before_publish["damaged_refs"] == []
    assert len(before_publish["unreadable_refs"]) == 1 and before_publish["objects"] == 0
    assert before_publish["held_by_refs"] == ["r/train/0000000003"]  # what it reaches cannot be told
    code, latest = _latest(store_dir)
    assert code == 0 and latest["latest"]["root"] == resumed["root"] and latest["skipped"] == []

    # Now gc sets the damaged ref aside (a newer one keeps the numbering) and keeps the two newest complete.
    report = _gc(store_dir)
    assert report["refs"] == ["r/train/1"] and len(report["damaged_refs"]) == 1
    assert not os.path.lexists(_ref(store_dir, 3))
    assert [n for n in os.listdir(store_dir / "quarantine") if n.startswith("ref-0000000003-")]
    with Store(store_dir, create=False) as s:
        assert [(r.generation, r.root) for r in s.list_refs("r", "train")] == [(2, roots[1]), (4, resumed["root"])]
        for root in (roots[1], resumed["root"]):
            verify_generation(s, root)
        # A later publish still takes a number after the damaged one's.
        assert s.history("r", "train").top == 4
    assert _latest(store_dir)[1]["latest"]["root"] == resumed["root"]
    assert _save(store_dir, 5, epoch=1) and _latest(store_dir)[1]["latest"]["generation"] == 5


def test_a_plain_save_after_a_damaged_newest_ref_takes_the_next_number(tmp_path):
    store_dir = tmp_path / "s"
    roots = [_save(store_dir, u) for u in (1, 2)]
    _damage(store_dir, 2, "flipped-byte", tmp_path)
    assert alpha_ckpt.latest(store_dir, "r", "train") == roots[0]
    root = _save(store_dir, 3)
    with Store(store_dir, create=False) as s:
        assert s.newest_ref("r", "train").generation == 3 and s.newest_ref("r", "train").root == root


def _history(*entries, top=None):
    from alpha_ckpt.store import History
    return History("r", "s", tuple(entries), top if top is not None else max((e.generation for e in entries), default=0))


def _record(generation, update, epoch=0):
    return RefRecord("r", "s", generation, "ab" * 32, 1, CapturePrefix("r", "s", update, update, epoch), 0.0, 1, 1)


def _unreadable(generation):
    from alpha_ckpt.store import UnreadableRef
    return UnreadableRef("r", "s", generation, Refusal(RefusalCode.CORRUPT_SHARD, "flipped"), True)


def test_the_fence_passes_over_a_publishers_own_damaged_ref_and_fences_one_it_cannot_tell_apart():
    mine = _history(_record(1, 1), _unreadable(2))
    check_fence(mine, CapturePrefix("r", "s", 3, 3, 0), follows=2)  # it published generation 2 itself
    with pytest.raises(Refusal) as info:  # generation 2 came after what this job continues: whose is unknown
        check_fence(mine, CapturePrefix("r", "s", 3, 3, 0), follows=1)
    assert info.value.code == RefusalCode.FENCED
    check_fence(mine, CapturePrefix("r", "s", 3, 3, 1), follows=2)  # a continuation resumed generation 1
    with pytest.raises(Refusal) as info:  # a newer epoch's generation still fences an older one
        check_fence(_history(_record(1, 1, epoch=1), _unreadable(2)), CapturePrefix("r", "s", 3, 3, 0), follows=2)
    assert info.value.code == RefusalCode.STALE_EPOCH


# ---------------------------------------------------------------- gc and pins

_GC_PAUSED_BETWEEN_PLAN_AND_APPLY = r"""
import os, sys, time
from alpha_ckpt.launch import cli

real_apply = cli.apply_gc


def paused(store, plan):
    open(sys.argv[2], "w").write("planned")
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
        time.sleep(0.01)
    real_apply(store, plan)


cli.apply_gc = paused
sys.exit(cli.main(["gc", "--store", sys.argv[1], "--keep", "2", "--grace", "0", "--json"]))
"""


@pytest.mark.timeout(120)
def test_a_pin_made_while_gc_is_between_planning_and_applying_keeps_its_ref_and_objects(tmp_path):
    store_dir = tmp_path / "s"
    roots = [_save(store_dir, u) for u in (1, 2, 3, 4)]
    old = time.time() - 7200
    for d, _, files in os.walk(store_dir):
        for f in files:
            os.utime(os.path.join(d, f), (old, old), follow_symlinks=False)
    planned, go = tmp_path / "planned", tmp_path / "go"
    gc = launch.python_c_start(_GC_PAUSED_BETWEEN_PLAN_AND_APPLY, store_dir, planned, go)
    try:
        launch.wait_until(lambda: planned.exists() or gc.poll() is not None, timeout=60, what="gc planned",
                          every=0.01)
        assert planned.exists(), gc.output()[1][-2000:]
        pin = launch.python_c("import sys; from alpha_ckpt.launch import cli; sys.exit(cli.main(sys.argv[1:]))", "pin",
                              "--store", store_dir, roots[0], timeout=60)
        assert pin.returncode == 0, pin.stdout + pin.stderr
        go.write_text("go")
    finally:
        if gc.poll() is None and not go.exists():
            gc.kill()
        done = gc.result(timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["refs"] == ["r/train/1", "r/train/2"]  # what gc planned before the pin existed
    with Store(store_dir, create=False) as s:
        assert [r.root for r in s.list_refs("r", "train")] == [roots[0], *roots[2:]]
        for root in (roots[0], *roots[2:]):
            verify_generation(s, root)
    assert alpha_ckpt.latest(store_dir, "r", "train") == roots[-1]


def test_a_ref_a_killed_gc_set_aside_goes_back_and_a_pin_finding_it_aside_puts_it_back(tmp_path):
    store_dir = tmp_path / "s"
    roots = [_save(store_dir, u) for u in (1, 2)]
    aside = _ref(store_dir, 1).with_name("aside-0000000001-99999999-abcdabcd")
    os.rename(_ref(store_dir, 1), aside)
    with Store(store_dir, create=False) as s:
        from alpha_ckpt.upkeep.gc import apply_gc, plan_gc
        apply_gc(s, plan_gc(s, grace=3600))
        assert [r.root for r in s.list_refs("r", "train")] == roots and not aside.exists()
    os.rename(_ref(store_dir, 1), aside)  # as a gc does just before it reads the pins again
    from alpha_ckpt.upkeep.pins import _keep_ref
    with Store(store_dir, create=False) as s:
        _keep_ref(s, s.newest_ref("r", "train"))  # generation 2: in place
        assert aside.exists()
        record = RefRecord("r", "train", 1, roots[0], 0, CapturePrefix("r", "train", 1, 1, 0), 0.0, 0, 1)
        _keep_ref(s, record)
        assert [r.root for r in s.list_refs("r", "train")] == roots and not aside.exists()
        os.unlink(_ref(store_dir, 1))  # removed for good: the pin is refused
        with pytest.raises(Refusal) as info:
            _keep_ref(s, record)
        assert info.value.code == RefusalCode.MISSING_SHARD
