"""The memory tier hands over only this store's state: a generation is taken only with the store's instance id
and an ancestor the store holds; a tier that cannot hold a save never fails the durable save; a tier
directory that cannot be used is a usage error on every rank; dead jobs' tier directories are removed."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from alpha_ckpt import Checkpointer, UsageError
from alpha_ckpt.tiers.memory.tier import Job, claim_store_directory, holders_of, memory_directory
from alpha_ckpt.collective.options import CheckpointerOptions
from alpha_ckpt.store import Store
from alpha_ckpt.testing import launch
from ranks import run_ranks
from test_checkpointer import IDENTITY, MASKS, Script

pytestmark = pytest.mark.timeout(300)


def train_and_save(rank, world, store, memory, steps, durable_every, restore=False):
    """Train ``steps`` steps with a save each (after a restore of "latest" with ``restore``); the process
    then ends without close(), as a crashed one does: its memory generations stay in the tier."""
    script = Script(rank, world)
    ckpt = Checkpointer(store, run="r", identity=IDENTITY, allow_nonfinite=MASKS, memory=memory,
                        durable_every=durable_every)
    state = script.state()
    counters = ckpt.restore(state) if restore else ckpt.restore(state, root=None)
    script.step = state["progress"]["step"]
    saves = []
    for _ in range(steps):
        script.train(1)
        ckpt.save(script.state(), update=script.step, cursor=script.step * 4 * world)
        saves.append({k: ckpt.last_save.get(k) for k in ("root", "tier", "memory_ok", "memory_skipped")})
    return {"saves": saves, "digest": script.digest(), "resumed": counters.update if counters else None}


def restore_latest(rank, world, store, memory):
    """A new job's restore of "latest": what it resumed, from which tier, and the state it holds."""
    script = Script(rank, world)
    fresh = script.digest()
    ckpt = Checkpointer(store, run="r", identity=IDENTITY, allow_nonfinite=MASKS, memory=memory)
    state = script.state()
    counters = ckpt.restore(state)
    out = {"update": counters.update if counters else None, "digest": script.digest(), "fresh": fresh,
           "tier": (ckpt.last_restore or {}).get("tier"), "skipped": ckpt.memory_skipped}
    ckpt.close()
    return out


def test_a_new_experiment_at_the_same_store_path_starts_fresh_instead_of_restoring_a_crashed_jobs_memory(tmp_path):
    store = tmp_path / "store"
    # memory=True: the default tier directory, which is named by the store's path, run and step
    tier = memory_directory(CheckpointerOptions(store=str(store), run="r", memory=True), str(store))
    try:
        crashed = run_ranks(2, train_and_save, str(store), True, 4, 3, tmp=tmp_path)
        assert [s["tier"] for s in crashed[0]["saves"]] == ["durable", "memory", "memory", "durable"]
        shutil.rmtree(store)  # a new experiment: the same path, an empty store
        got = run_ranks(2, restore_latest, str(store), True, tmp=tmp_path)
        for r in got:
            assert r["update"] is None and r["digest"] == r["fresh"]  # a fresh start: nothing restored
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def test_two_jobs_with_different_stores_sharing_one_tier_directory_each_restore_their_own_state(tmp_path):
    memory = str(tmp_path / "memory")
    a = run_ranks(2, train_and_save, str(tmp_path / "a"), memory, 3, 5, tmp=tmp_path)
    b = run_ranks(2, train_and_save, str(tmp_path / "b"), memory, 2, 5, tmp=tmp_path)
    assert [s["tier"] for s in a[0]["saves"]] == ["durable", "memory", "memory"]
    got_a = run_ranks(2, restore_latest, str(tmp_path / "a"), memory, tmp=tmp_path)
    got_b = run_ranks(2, restore_latest, str(tmp_path / "b"), memory, tmp=tmp_path)
    for r in range(2):
        assert (got_a[r]["update"], got_a[r]["tier"], got_a[r]["digest"]) == (3, "memory", a[r]["digest"])
        assert (got_b[r]["update"], got_b[r]["tier"], got_b[r]["digest"]) == (2, "memory", b[r]["digest"])


def test_memory_generations_descending_from_a_generation_the_store_no_longer_holds_are_skipped_with_the_reason(
        tmp_path):
    store, memory = tmp_path / "store", str(tmp_path / "memory")
    first = run_ranks(2, train_and_save, str(store), memory, 1, 5, tmp=tmp_path)    # generation 1: update 1
    second = run_ranks(2, train_and_save, str(store), memory, 3, 5, True, tmp=tmp_path)  # 2 (durable), 3, 4 (memory)
    assert second[0]["resumed"] == 1 and [s["tier"] for s in second[0]["saves"]] == ["durable", "memory", "memory"]
    with Store(str(store), create=False) as s:
        assert [r.generation for r in s.list_refs("r", "train")] == [1, 2]
        assert s.delete_ref("r", "train", 2)  # the store is rolled back to generation 1 (a backup, an operator)
    got = run_ranks(2, restore_latest, str(store), memory, tmp=tmp_path)
    for r in range(2):
        assert (got[r]["update"], got[r]["tier"]) == (1, "durable")  # on from the store, not from memory
        assert got[r]["digest"] == first[r]["digest"]
        assert len(got[r]["skipped"]) == 2 and all("generation 2" in why for why in got[r]["skipped"])


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    """A tmpfs of 256 KiB: too small to hold a save of the test script."""
    return mount_tmpfs("256k")


def test_a_full_tier_never_fails_a_save_every_save_is_durable_and_says_why_memory_was_skipped(tmp_path, small_tmpfs):
    store = tmp_path / "store"
    saved = run_ranks(2, train_and_save, str(store), str(small_tmpfs), 4, 3, tmp=tmp_path)
    for rank in range(2):
        saves = saved[rank]["saves"]
        # the memory-only saves (2, 3) went to the store instead; every save says why memory was skipped
        assert [s["tier"] for s in saves] == ["durable"] * 4
        assert all(s["memory_ok"] is False and s["memory_skipped"] for s in saves)
    with Store(str(store), create=False) as s:
        assert [r.root for r in s.list_refs("r", "train")] == [x["root"] for x in saved[0]["saves"]]
    got = run_ranks(2, restore_latest, str(store), str(small_tmpfs), tmp=tmp_path)
    assert [(r["update"], r["tier"]) for r in got] == [(4, "durable")] * 2
    assert [r["digest"] for r in got] == [s["digest"] for s in saved]


def open_with_tier(rank, world, store, memory, good_memory):
    """A Checkpointer with an unusable tier directory, then one with a good one in the same processes."""
    try:
        Checkpointer(store, run="r", memory=memory)
        refused = None
    except UsageError as exc:
        refused = type(exc).__name__
    ckpt = Checkpointer(store, run="r", memory=good_memory)  # nothing is left waiting on the group
    ckpt.save({"w": torch.arange(6.0)}, update=1)
    ckpt.close()
    return {"refused": refused, "tier": ckpt.last_save["tier"], "memory_ok": ckpt.last_save["memory_ok"]}


def test_a_tier_directory_that_is_a_regular_file_is_a_usage_error_on_every_rank(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    got = run_ranks(2, open_with_tier, str(tmp_path / "store"), str(tmp_path / "a-file"),
                    str(tmp_path / "memory"), tmp=tmp_path, pg_timeout=30)
    assert got == [{"refused": "UsageError", "tier": "durable", "memory_ok": True}] * 2


def test_a_read_only_tier_directory_is_a_usage_error_on_every_rank(tmp_path, small_tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True, capture_output=True, timeout=30)
    got = run_ranks(2, open_with_tier, str(tmp_path / "store"), str(small_tmpfs / "tier"),
                    str(tmp_path / "memory"), tmp=tmp_path, pg_timeout=30)
    assert got == [{"refused": "UsageError", "tier": "durable", "memory_ok": True}] * 2


def _job_dir(parent: Path, name: str, job: Job) -> Path:
    path = parent / f"store-{name}"
    (path / "rank-00000").mkdir(parents=True)
    (path / Job.FILE).write_text(__import__("json").dumps(job.to_json()))
    return path


def test_opening_a_tier_removes_the_directories_of_dead_jobs_and_keeps_live_ones_and_restarts_of_this_run(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    this = Job(os.getpid(), None, "run-2")
    _job_dir(tmp_path, "a" * 32, Job(dead.pid, None, "run-1"))            # dead launcher, another run
    _job_dir(tmp_path, "b" * 32, Job(os.getppid(), None, "run-1"))         # a live launcher: another job runs
    _job_dir(tmp_path, "c" * 32, Job(dead.pid, None, "run-2"))             # this run, restarted by a new launcher
    _job_dir(tmp_path, "d" * 32, Job(dead.pid, None, "none"))              # torchrun's unnamed run, launcher gone
    _job_dir(tmp_path, "e" * 32, Job(os.getpid(), 1, "run-1"))             # this pid, but another start: reused pid
    claim_store_directory(str(tmp_path), "f" * 32, this)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        [f"store-{'b' * 32}", f"store-{'c' * 32}", f"store-{'f' * 32}"]


def test_opening_a_tier_in_the_default_location_removes_dead_jobs_of_other_stores_there_too(tmp_path):
    import uuid
    from alpha_ckpt.tiers.memory.tier import default_root
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine, other = (Path(default_root()) / f"test-{uuid.uuid4().hex}" for _ in range(2))
    try:
        crashed = _job_dir(other, "a" * 32, Job(dead.pid, None, "run-1"))   # another store's crashed job
        living = _job_dir(other, "b" * 32, Job(os.getppid(), None, "run-1"))
        claim_store_directory(str(mine), "c" * 32, Job(os.getpid(), None, "run-2"))
        assert not crashed.exists() and living.exists()
    finally:
        shutil.rmtree(mine, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)


TORCHRUN_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from alpha_ckpt import Checkpointer
dist.init_process_group("gloo")
ckpt = Checkpointer(sys.argv[1], run="r", memory=True, durable_every=5)
state = {"w": torch.zeros(4)}
counters = ckpt.restore(state)
start = counters.update if counters else 0
for update in range(start + 1, start + 3):
    state["w"] += 1
    ckpt.save(state, update=update)
if dist.get_rank() == 0:  # one line: the ranks share stdout
    print("TIER", os.path.dirname(ckpt.memory.directory), flush=True)
os._exit(0)  # a crash: no close(), no destroy_process_group()
"""


def test_under_torchrun_the_next_job_removes_the_tier_a_crashed_job_left(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    store = tmp_path / "store"

    def torchrun():
        out = launch.torchrun(script, 2, store, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("TIER")}

    (tier,) = torchrun()
    try:
        namespace = holders_of(tier, str(store))
        first = Job.read(namespace)
        assert os.path.isdir(os.path.join(namespace, "rank-00001"))  # the crashed job's memory stayed
        assert torchrun() == {tier}
        # the second job found the first one's launcher gone: its directory was removed and made anew
        assert Job.read(namespace).launcher != first.launcher
    finally:
        shutil.rmtree(tier, ignore_errors=True)


FORMAT1_STATE = Path(__file__).resolve().parents[1] / "stores" / "format1" / "state"


def tier_of(rank, world, store, memory):
    ckpt = Checkpointer(store, run="old", step="s", memory=memory)
    return {"memory": ckpt.memory is not None, "instance": ckpt.store.instance}


def test_an_older_store_gets_its_instance_id_at_its_first_writable_open_and_then_its_memory_tier(tmp_path):
    writable = tmp_path / "old"
    shutil.copytree(FORMAT1_STATE, writable)
    with Store(str(writable), create=False) as s:
        assert s.instance is None  # older than instance ids, and a read-only open writes nothing
    got = run_ranks(2, tier_of, str(writable), str(tmp_path / "memory"), tmp=tmp_path)
    assert got[0]["memory"] and got[1]["memory"] and got[0]["instance"] == got[1]["instance"] is not None
    with Store(str(writable), create=False) as s:
        assert s.instance == got[0]["instance"]  # written once: every later open reads the same id
