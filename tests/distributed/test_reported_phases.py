"""A Checkpointer reports where its save's and its restore's time went, on every rank, as figures a
benchmark reads instead of wrapping product functions."""
import pytest
import torch

from alpha_ckpt import Checkpointer
from alpha_ckpt.testing.launch import run_ranks

SAVE_PHASES = {"capture", "agree", "durable.write", "durable.commit"}
RESTORE_PHASES = {"choose", "validate", "copy"}


def save_then_restore(rank, world, store):
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 0}
    with_saves = Checkpointer(store, run="r")
    saved = [dict(with_saves.save(state, update=u, cursor=u).phases) for u in (1, 2)]
    with_saves.close()
    back = {"w": torch.zeros(1 << 16), "step": -1}
    restoring = Checkpointer(store, run="r")
    counters = restoring.restore(back)
    read = dict(restoring.last_restore)
    restoring.close()
    return {"saved": saved, "restored": dict(read["phases"]), "update": counters.update,
            "equal": torch.equal(back["w"], state["w"])}


@pytest.mark.timeout(180)
def test_every_rank_reports_its_seconds_in_each_phase_of_a_save_and_of_a_restore(tmp_path):
    results = run_ranks(2, save_then_restore, str(tmp_path / "store"), tmp=tmp_path)
    for r in results:
        assert r["update"] == 2 and r["equal"]
        assert all(set(phases) == SAVE_PHASES and all(s >= 0 for s in phases.values()) for phases in r["saved"])
        assert all(phases["durable.write"] > 0 for phases in r["saved"])
        assert set(r["restored"]) == RESTORE_PHASES
        assert r["restored"]["validate"] > 0 and r["restored"]["copy"] > 0
