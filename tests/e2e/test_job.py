"""alpha-run as a user runs it: the job, its resume, and the refusals before any owner trains."""
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch
from alpha_ckpt.testing.launch import alpha_ckpt_cli

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]


def alpha_run(store, *args, nproc=2, env=None, timeout=240):
    return launch.alpha_run("--nproc", nproc, "--store", store, *SMALL, *args, CONFIG, env=env, timeout=timeout)


def final(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def store_hash(store) -> str:
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(store)):
        for f in sorted(files):
            p = os.path.join(d, f)
            h.update(p.encode() + open(p, "rb").read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def saved(once_per_run):
    """A store the job saved 2 updates into (a checkpoint at 2), and its final line; tests copy it or only read it."""
    def make(folder):
        return [str(folder / "store"), final(alpha_run(folder / "store", "--updates", "2", "--checkpoint-every", "2"))]
    store, first = once_per_run("job-saved", make)
    return Path(store), first


@pytest.mark.timeout(300)
def test_job_and_split_resume_match_the_oracle(saved, tmp_path):
    store, first = saved
    # A continuation makes the saved generation stale: continue in a copy, so the
    # refusal tests below see the store as saved, whatever order they run in.
    subprocess.run(["cp", "-a", str(store), str(tmp_path / "copy")], check=True)
    store = tmp_path / "copy"
    resumed = final(alpha_run(store, "--updates", "3", "--resume-from", first["last_generation"]))
    assert resumed["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "3", "--placements", "2", *SMALL)
    assert (resumed["update"], resumed["epoch"], resumed["owners"]) == (3, 1, 2)
    assert os.path.exists(resumed["output"]) and resumed["output"].endswith(".safetensors")


@pytest.mark.timeout(300)
def test_a_flipped_byte_is_refused_with_exit_3_and_the_store_unchanged(saved, tmp_path):
    store, first = saved
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(store), str(copy)], check=True)
    # A shard of the very generation resumed (other tests add generations to this store).
    info = alpha_ckpt_cli("inspect", "--store", copy, "--json", first["last_generation"])
    assert info.returncode == 0, info.stderr
    digest = max(json.loads(info.stdout)["shards"], key=lambda s: s["bytes"])["digest"]
    shard = copy / "objects" / digest[:2] / digest
    os.chmod(shard, 0o644)
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(shard, "wb").write(data)
    before = store_hash(copy)
    proc = alpha_run(copy, "--updates", "3", "--resume-from", first["last_generation"])
    assert proc.returncode == 3 and "corrupt-shard" in proc.stderr
    assert store_hash(copy) == before


@pytest.mark.timeout(300)
def test_a_changed_learning_rate_is_another_learner(saved):
    store, first = saved
    before = store_hash(store)
    proc = alpha_run(store, "--updates", "3", "--resume-from", first["last_generation"], "--set", "lr=0.5")
    assert proc.returncode == 3 and "foreign-learner" in proc.stderr
    assert proc.stderr.count("foreign-learner") == 1  # both owners refused it; alpha-run tells it once
    assert store_hash(store) == before


@pytest.mark.timeout(60)
def test_usage_errors_exit_2(tmp_path):
    def checks(*args):
        return launch.alpha_run_checks("--nproc", 2, "--store", tmp_path, *SMALL, *args, CONFIG)
    assert checks("--updates", "1", "--publisher", "ring").returncode == 2
    assert checks("--updates", "1", "--publisher", "tree", "--fanout", "0").returncode == 2
    assert checks("--updates", "1", "--resume-from", "abc").returncode == 2


@pytest.mark.timeout(400)
def test_after_a_continuation_publishes_the_older_generation_is_stale_and_a_branch_is_explicit(saved, tmp_path):
    store = tmp_path / "store"
    subprocess.run(["cp", "-a", str(saved[0]), str(store)], check=True)  # 2 updates, a checkpoint at 2
    first = saved[1]
    cont = final(alpha_run(store, "--updates", "3", "--resume-from", first["last_generation"]))
    assert cont["epoch"] == 1
    branch = final(alpha_run(store, "--updates", "3", "--branch-from", first["last_generation"], "--run", "what-if"))
    assert branch["state_digest"] == cont["state_digest"] and branch["epoch"] == 0
    latest = final(alpha_run(store, "--updates", "4", "--resume", "latest"))
    assert latest["update"] == 4 and latest["epoch"] == 2
    before = store_hash(store)
    again = alpha_run(store, "--updates", "3", "--resume-from", first["last_generation"])
    assert again.returncode == 3 and "stale-epoch" in again.stderr
    assert latest["last_generation"] in again.stderr  # it names the newest continuation, the one to resume
    assert store_hash(store) == before


# CI: gates/sigkill_rename and gates/tree_publication kill an owner mid-publish, require exit 75, and
# resume latest to the state of an uninterrupted run.
@pytest.mark.full
@pytest.mark.timeout(400)
def test_a_killed_owner_makes_the_job_exit_75_and_resume_latest_finishes_the_same_state(tmp_path):
    store = tmp_path / "store"
    straight = final(alpha_run(tmp_path / "straight", "--updates", "6"))
    killed = alpha_run(store, "--updates", "6", "--checkpoint-every", "2", "--timeout", "30",
                       env=launch.child_env(ALPHA_CKPT_KILL_OWNER="1:5"))
    assert killed.returncode == 75, killed.stderr[-2000:]
    resumed = final(alpha_run(store, "--updates", "6", "--resume", "latest"))
    assert resumed["state_digest"] == straight["state_digest"]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_nodes_on_one_machine_train_the_job_of_four_owners(tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    def node(rank):
        return launch.alpha_run_start("--nnodes", "2", "--node-rank", rank, "--nproc", "2", "--rdzv-backend", "c10d",
                                      "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
                                      "--store", tmp_path / "shared", *SMALL, "--updates", "2", CONFIG)
    nodes = [node(1), node(0)]
    done = [p.result(timeout=240) for p in nodes]
    assert all(p.returncode == 0 for p in done), [p.stderr[-1500:] for p in done]
    # c10d rendezvous assigns ranks by join order: owner 0 may be on either node.
    (printed,) = [p.stdout for p in done if p.stdout.strip()]
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["owners"] == 4
    assert result["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "2", "--placements", "4", *SMALL)


@pytest.mark.full  # CI: gates/tree_publication and resume_equivalence run 7 owners on this machine
@pytest.mark.timeout(300)
def test_eight_owners_run_on_a_two_core_machine_and_match_the_oracle(tmp_path):
    result = final(alpha_run(tmp_path / "store", "--updates", "2", nproc=8))
    assert result["owners"] == 8
    assert result["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "2", "--placements", "8", *SMALL)


# CI: gates/checkpoint_chunk refuses a generation forged to another device product with exit 3 and
# the store unchanged.
@pytest.mark.full
@pytest.mark.timeout(300)
def test_a_generation_saved_on_another_device_product_is_refused_before_training(saved, tmp_path):
    store, first = saved
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(store), str(copy)], check=True)
    forged = launch.python_m("alpha_ckpt.testing.forge", "--store", copy, first["last_generation"],
                             "--edit", 'devices.0.product="NVIDIA H200"', timeout=60)
    assert forged.returncode == 0, forged.stderr
    before = store_hash(copy)
    proc = alpha_run(copy, "--updates", "3", "--resume-from", forged.stdout.strip())
    assert proc.returncode == 3 and "device-mismatch" in proc.stderr, proc.stderr[-2000:]
    assert store_hash(copy) == before
    # The untouched generation in the same store still resumes: only the forged binding was refused.
    assert final(alpha_run(copy, "--updates", "3", "--resume-from", first["last_generation"]))["update"] == 3


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_owner_and_leaves_the_last_generation_whole(tmp_path):
    import signal
    store = tmp_path / "interrupted"
    # A terminal's Ctrl-C signals the whole foreground process group: launcher and owners.
    proc = launch.alpha_run_start("--nproc", "2", "--store", store, *SMALL, "--updates", "100000",
                                  "--checkpoint-every", "2", CONFIG, new_session=True)
    try:
        launch.wait_until(lambda: list((store / "refs").glob("*/*/*")), timeout=120,
                          what="a generation published")
        os.killpg(proc.pid, signal.SIGINT)
        done = proc.result(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert done.returncode == 130, done.stderr[-2000:]
    launch.wait_until(lambda: _processes_mentioning(str(store)) == [], timeout=10,
                      what="every owner gone")
    latest = alpha_ckpt_cli("latest", "--store", store, "--run", "nightly", "--step", "fit", "--json")
    assert latest.returncode == 0, latest.stdout + latest.stderr


# CI: gates/checkpoint_chunk refuses a flipped shard byte of a 4-owner tree job (exit 3, store
# unchanged), and tests/distributed/test_checkpointer.py makes every rank act on damage only rank 1 reads.
@pytest.mark.full
@pytest.mark.timeout(400)
def test_a_tree_checkpoint_with_one_damaged_leaf_shard_is_refused_by_every_owner(tmp_path):
    store = tmp_path / "store"
    tree = ["--publisher", "tree", "--fanout", "2", "--set", "parameters=partitioned"]
    first = final(alpha_run(store, *tree, "--updates", "2", "--checkpoint-every", "2", nproc=4))
    info = alpha_ckpt_cli("inspect", "--store", store, "--json", first["last_generation"])
    assert info.returncode == 0, info.stderr
    groups = {g["role"]: g for g in json.loads(info.stdout)["groups"]}
    assert sorted(groups) == [0, 1, 2, 3] and [c["role"] for c in groups[0]["children"]] == [1, 3]
    digest = groups[3]["shards"][0]["digest"]  # only owner 3 reads this shard on resume
    shard = store / "objects" / digest[:2] / digest
    os.chmod(shard, 0o644)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(data)
    before = store_hash(store)
    proc = alpha_run(store, *tree, "--updates", "3", "--resume-from", first["last_generation"], nproc=4)
    assert proc.returncode == 3 and "corrupt-shard" in proc.stderr and "rank 3:" in proc.stderr, proc.stderr[-2000:]
    published = [e for e in _events(proc.stderr) if e["event"] == "publish"]
    assert published == [] and store_hash(store) == before


def _events(stderr: str) -> list[dict]:
    """The JSON events (docs/EVENTS.md) among stderr's lines."""
    return [json.loads(line) for line in stderr.splitlines() if line.startswith('{"')]


def _bytes_read(stderr: str) -> dict[int, int]:
    import re
    return {int(m.group(1)): int(m.group(2))
            for m in re.finditer(r"owner (\d+) restored update \d+ from \w+: read (\d+) payload bytes", stderr)}


# CI covers both halves elsewhere: tests/distributed/test_checkpointer.py measures each of 4 ranks reading only
# its share (tree, fan-out 2), and gates/parameter_partitioning resumes the job saved on 4 owners on 3.
@pytest.mark.full
@pytest.mark.timeout(400)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_each_of_four_owners_reads_about_a_quarter_and_three_owners_resume_to_the_oracle(tmp_path, publisher):
    store = tmp_path / "store"
    args = ["--publisher", publisher, "--fanout", "2", "--set", "parameters=partitioned", "--set", "optimizer=momentum"]
    first = final(alpha_run(store, *args, "--updates", "2", "--checkpoint-every", "2", nproc=4))
    inspected = alpha_ckpt_cli("inspect", "--store", store, "--json", first["last_generation"])
    assert inspected.returncode == 0, inspected.stderr
    info = json.loads(inspected.stdout)
    partitioned = set(info["metadata"]["layout"]["partitioned"])
    shards = [s for g in info["groups"] for s in g["shards"]] if info["groups"] else info["shards"]
    slices = [sl for s in shards for sl in s["slices"]]
    part_bytes = sum(sl["stored"] for sl in slices if sl["ordinal"] in partitioned)
    other_bytes = sum(sl["stored"] for sl in slices if sl["ordinal"] not in partitioned)
    same = alpha_run(store, *args, "--updates", "3", "--resume-from", first["last_generation"], nproc=4)
    final(same)
    read = _bytes_read(same.stderr)
    assert sorted(read) == [0, 1, 2, 3]
    for owner, n in read.items():  # its quarter of the partitioned words, plus the few replicated ones
        assert n <= part_bytes / 4 * 1.01 + other_bytes, (owner, n, part_bytes, other_bytes)
    assert sum(read.values()) >= part_bytes  # together they read every partitioned word once
    # The same generation on 3 owners (a branch, so the continuation above does not make it stale).
    three = alpha_run(store, *args, "--updates", "3", "--branch-from", first["last_generation"], "--run", "three",
                      nproc=3)
    assert final(three)["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "3", "--placements", "4:2,3:1",
                                                                *SMALL, "--set", "optimizer=momentum")
    assert max(_bytes_read(three.stderr).values()) <= part_bytes / 3 * 1.01 + other_bytes + part_bytes / 4
