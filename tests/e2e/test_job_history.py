"""The job never publishes what a restore refuses and never forks its run/step's history."""
import json

import pytest

from alpha_ckpt.testing import launch
from alpha_ckpt.testing.launch import alpha_ckpt_cli
from test_job import CONFIG, SMALL, alpha_run, final

DIVERGE = ["--set", "optimizer=sgd", "--set", "lr=1e30", "--updates", "4", "--checkpoint-every", "1"]



def refs(store):
    listing = alpha_ckpt_cli("list", "--store", str(store), "--json")
    assert listing.returncode == 0, listing.stderr
    return json.loads(listing.stdout)["generations"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("publisher", [
    [],
    ["--publisher", "tree", "--fanout", "2", "--set", "parameters=partitioned"],
    ["--save", "async"],
], ids=["star", "tree", "async"])
def test_a_diverging_job_stops_with_a_refusal_and_its_last_good_generation_survives_gc(tmp_path, publisher):
    store = tmp_path / "store"
    diverged = alpha_run(store, *publisher, *DIVERGE, nproc=3)
    assert diverged.returncode == 3, diverged.stderr[-2000:]
    # Update 2 held NaN: refused, never committed; only update 1's generation is there.
    assert sorted(p.name for p in (store / "refs" / "nightly" / "fit").iterdir()) == ["0000000001"]
    if publisher:
        return  # the refusal's path differs per publisher; what follows is shared
    published = refs(store)
    assert [g["update"] for g in published] == [1]
    good = published[0]["root"]
    assert alpha_ckpt_cli("verify", "--store", str(store), good).returncode == 0
    gc = alpha_ckpt_cli("gc", "--store", str(store), "--keep", "2", "--grace", "0", "--json")
    assert gc.returncode == 0, gc.stderr
    latest = alpha_ckpt_cli("latest", "--store", str(store), "--run", "nightly", "--step", "fit", "--json")
    assert latest.returncode == 0 and json.loads(latest.stdout)["latest"]["root"] == good
    resumed = final(alpha_run(store, *DIVERGE[:4], "--updates", "1", "--resume", "latest", nproc=3))
    assert resumed["last_generation"] == good


@pytest.mark.timeout(300)
def test_resume_latest_on_an_empty_history_starts_at_update_zero(tmp_path):
    started = final(alpha_run(tmp_path / "store", "--updates", "2", "--resume", "latest"))
    assert started["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "2", "--placements", "2", *SMALL)
    assert (started["update"], started["epoch"]) == (2, 0)
