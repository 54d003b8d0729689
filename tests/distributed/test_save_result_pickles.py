"""What ``Checkpointer.save`` returns can be kept: pickled, copied, returned from a worker or stored in the
script's own ``torch.save`` checkpoint, it is the root digest as a plain ``str``, which
``torch.load(weights_only=True)`` reads back and a restore takes."""
import copy
import json
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from alpha_ckpt import Checkpointer
from gpt_training import Trainer, assert_identical
from ranks import run_ranks

MASKS = ("*.causal_mask",)  # the model's -inf attention masks


def keep_the_save_result_then_restore_from_it(rank, world, store, save, kept_file):
    trainer = Trainer(seed=0)
    ckpt = Checkpointer(store, run="r", save=save, allow_nonfinite=MASKS)
    trainer.train(2)
    result = ckpt.save({"model": trainer.model, "optim": trainer.optim, "data": trainer.data}, update=2, cursor=8)
    root = result.root  # async: once durable
    # The script's own checkpoint beside alpha_ckpt's, holding the root it resumes from.
    torch.save({"model": trainer.model.state_dict(), "alpha_root": result}, f"{kept_file}-{rank}.pt")
    kept = torch.load(f"{kept_file}-{rank}.pt", weights_only=True)["alpha_root"]
    copies = {"torch.load": kept, "pickle": pickle.loads(pickle.dumps(result)), "deepcopy": copy.deepcopy(result),
              "copy": copy.copy(result), "worker return": ForkingPickler.loads(ForkingPickler.dumps(result))}
    try:  # a result is not a str: JSON refuses it rather than writing something else
        json.dumps({"root": result})
        copies["json"] = "written"
    except TypeError:
        pass
    resumed = Trainer(seed=7)  # another seed: every bit must come from the generation
    restore = Checkpointer(store, run="r", allow_nonfinite=MASKS)
    counters = restore.restore({"model": resumed.model, "optim": resumed.optim, "data": resumed.data}, root=kept)
    assert_identical(resumed.model.state_dict(), trainer.model.state_dict(), "model")
    ckpt.close()
    restore.close()
    return {"root": root, "stats_root": result.stats.get("root"),
            "copies": {how: [type(c).__name__, c] for how, c in copies.items()},
            "restored_update": counters.update, "returned": root}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_save_result_kept_in_a_torch_checkpoint_loads_with_weights_only_and_restores(tmp_path, save):
    results = run_ranks(2, keep_the_save_result_then_restore_from_it, str(tmp_path / "s"), save,
                        str(tmp_path / "kept"), tmp=tmp_path)
    assert all("root" in r for r in results), results
    root = results[0]["root"]
    assert len(root) == 64 and all(r["root"] == root for r in results)
    for r in results:
        assert r["stats_root"] == root  # the original keeps its stats
        assert r["copies"] == {how: ["str", root] for how in r["copies"]}, r["copies"]
        assert r["restored_update"] == 2
        assert r["returned"] == root  # returned from the rank's process (as JSON)
