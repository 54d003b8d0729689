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
