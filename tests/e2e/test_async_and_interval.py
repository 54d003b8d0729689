"""The job's asynchronous save and its checkpoint interval, as a user runs them."""
import json
import os

import pytest

from alpha_ckpt.testing import launch
from alpha_ckpt.testing.launch import alpha_ckpt_cli
from test_job import CONFIG, SMALL, alpha_run, final


def events(stderr: str, kind: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == kind:
                out.append(event)
    return out


def committed(stderr: str, owner: int = 0) -> list[str]:
    prefix = f"alpha-run: owner {owner} committed update "
    return [line[len(prefix):] for line in stderr.splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("publisher", [pytest.param("star", marks=pytest.mark.full), "tree"])
def test_async_save_publishes_the_same_generations_as_sync_save(tmp_path, publisher):
    args = ["--updates", "4", "--checkpoint-every", "2", "--publisher", publisher]
    sync = alpha_run(tmp_path / "sync", *args)
    asynchronous = alpha_run(tmp_path / "async", *args, "--save", "async")
    assert final(sync)["state_digest"] == final(asynchronous)["state_digest"]
    # Content addressing: the same captures give the same root digests, update for update.
    assert committed(sync.stderr) == committed(asynchronous.stderr) and len(committed(sync.stderr)) == 2
    published = events(asynchronous.stderr, "publish")
    assert [e["update"] for e in published] == [2, 4] and [e["generation"] for e in published] == [1, 2]
    assert all(e["mode"] == "async" and e["bytes"] > 0 and e["seconds"] > 0 and e["stall_s"] >= 0 for e in published)
    assert [e["mode"] for e in events(sync.stderr, "publish")] == ["sync", "sync"]


@pytest.mark.timeout(400)
def test_an_owner_killed_while_saving_asynchronously_resumes_latest_to_the_same_state(tmp_path):
    straight = launch.oracle_digest(CONFIG, "--updates", "6", "--placements", "2", *SMALL)  # an uninterrupted run's
    store = tmp_path / "store"
    killed = alpha_run(store, "--updates", "6", "--checkpoint-every", "1", "--save", "async", "--timeout", "30",
                       env=launch.child_env(ALPHA_CKPT_KILL_OWNER="1:5"))
    assert killed.returncode == 75, killed.stderr[-2000:]
    resumed = final(alpha_run(store, "--updates", "6", "--resume", "latest", "--save", "async"))
    assert resumed["state_digest"] == straight


@pytest.mark.timeout(300)
def test_skip_policy_keeps_every_published_generation_resumable(tmp_path):
    # Saves of a wider model against one-update intervals: some boundaries may find a
    # save in flight and skip it; whatever was skipped, what was published is whole.
    wide = ["--set", "hidden=256"]
    run = alpha_run(tmp_path / "store", *wide, "--updates", "8", "--checkpoint-every", "1", "--save", "async",
                    "--in-flight", "skip", "--publisher", "tree")
    out = final(run)
    roots = committed(run.stderr)
    skipped = events(run.stderr, "checkpoint_skipped")
    assert len(roots) + len(skipped) == 8 and roots[-1].startswith("8 as ")
    for line in roots:
        root = line.split(" as ")[1]
        check = alpha_ckpt_cli("verify", "--store", tmp_path / "store", root)
        assert check.returncode == 0, check.stdout + check.stderr
    assert out["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "8", "--placements", "2", *SMALL, *wide)


@pytest.mark.timeout(300)
def test_the_seed_example_interval_is_in_the_job_log(tmp_path):
    run = alpha_run(tmp_path / "store", "--updates", "3", "--checkpoint-every", "auto", "--mtbf", "6h",
                    "--checkpoint-cost", "60")
    final(run)
    assert ("checkpoint interval 26.8 min = sqrt(2 x 60 s x 21600 s) (Young/Daly); write overhead 3.7 %, "
            "expected redone work per failure 13.4 min") in run.stderr
    (plan,) = events(run.stderr, "checkpoint_interval")
    assert round(plan["interval_s"]) == 1610 and plan["cost_source"] == "assumed"
    # 27 minutes is far beyond a 3-update job: only the final update is published.
    assert [e["update"] for e in events(run.stderr, "publish")] == [3]


@pytest.mark.timeout(300)
def test_auto_interval_measures_the_cost_with_a_first_checkpoint_and_replans(tmp_path):
    run = alpha_run(tmp_path / "store", "--updates", "12", "--checkpoint-every", "auto", "--mtbf", "2")
    final(run)
    plans = events(run.stderr, "checkpoint_interval")
    assert plans and all(p["cost_source"] == "measured" and p["every_updates"] >= 1 for p in plans)
    updates = [e["update"] for e in events(run.stderr, "publish")]
    assert updates[0] == 1 and updates[-1] == 12


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--checkpoint-every", "auto"], "needs --mtbf"),
    (["--checkpoint-every", "auto", "--mtbf", "soon"], "not a positive duration"),
    (["--checkpoint-every", "often"], "number of updates or 'auto'"),
    (["--checkpoint-every", "2", "--mtbf", "6h"], "go with --checkpoint-every auto"),
])
def test_bad_schedule_flags_are_usage_errors_before_any_owner_starts(tmp_path, args, message):
    run = launch.alpha_run_checks("--nproc", 2, "--store", tmp_path / "store", *SMALL, "--updates", "2", *args, CONFIG)
    assert run.returncode == 2 and message in run.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("publisher, save", [pytest.param("star", "sync", marks=pytest.mark.full), ("tree", "async")])
def test_a_frozen_embedding_table_costs_zero_bytes_written_after_the_first_generation(tmp_path, publisher, save):
    table = ["--set", "embedding_rows=4096"]          # 4096 x 90 float32: 1.47 MB, never trained
    table_bytes = 4096 * 90 * 4
    run = alpha_run(tmp_path / "store", *table, "--updates", "4", "--checkpoint-every", "1",
                    "--publisher", publisher, "--save", save)
    out = final(run)
    written = [e["bytes_written"] for e in events(run.stderr, "publish")]
    assert len(written) == 4 and written[0] > table_bytes
    assert all(w < table_bytes // 20 for w in written[1:]), written   # the trained regions and manifests only
    assert out["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "4", "--placements", "2", *SMALL, *table)
    # A generation that names a carried shard resumes like any other.
    second = committed(run.stderr)[1].split(" as ")[1]
    resumed = final(alpha_run(tmp_path / "store", *table, "--updates", "4", "--resume-from", second,
                              "--publisher", publisher))
    assert resumed["state_digest"] == out["state_digest"]


@pytest.mark.timeout(300)
def test_discard_checkpoints_removes_the_steps_checkpoints_once_its_output_is_published_but_not_pins(tmp_path):
    store = tmp_path / "store"
    first = final(alpha_run(store, "--updates", "2", "--checkpoint-every", "1"))
    pin = alpha_ckpt_cli("pin", "--store", store, first["last_generation"])
    assert pin.returncode == 0, pin.stdout + pin.stderr
    run = alpha_run(store, "--updates", "4", "--checkpoint-every", "1", "--resume", "latest", "--discard-checkpoints")
    out = final(run)
    (event,) = events(run.stderr, "checkpoints_discarded")
    assert event["generations"] == 3 and event["pinned"] == 1     # generation 1, 3 and 4 go; 2 is pinned
    refs = sorted(p.name for p in (store / "refs" / "nightly" / "fit").iterdir())
    assert refs == ["0000000002"]
    check = alpha_ckpt_cli("verify", "--store", store, first["last_generation"])
    assert check.returncode == 0, check.stdout + check.stderr
    assert os.path.exists(out["output"])
