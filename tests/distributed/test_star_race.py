"""A star publication that loses its ref race fails cleanly on every rank (PublishFailed: exit 75)."""
import pytest
import torch

from ranks import run_ranks


def lose_the_race(rank, world, store_dir, publisher):
    from alpha_ckpt import Checkpointer
    from alpha_ckpt.errors import PublishConflict, PublishFailed
    from alpha_ckpt.store import Store
    ckpt = Checkpointer(store_dir, run="r", publisher=publisher)
    ckpt.restore({"w": torch.zeros(8)}, root=None)
    if rank == 0:
        def lost_race(self, prefix, *args, **kwargs):
            raise PublishConflict("generation 1 of r/train was published by another publisher")
        Store.publish_ref = lost_race
    try:
        ckpt.save({"w": torch.ones(8)}, update=1, cursor=1)
        return "published"
    except PublishFailed:
        return "publish-failed"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_a_lost_ref_race_is_a_clean_failure_on_every_rank(tmp_path, publisher):
    assert run_ranks(2, lose_the_race, str(tmp_path / "store"), publisher, tmp=tmp_path) == ["publish-failed"] * 2
