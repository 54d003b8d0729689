"""Save and restore cost grows linearly with the tensor count (MoE layers and per-parameter optimizer state).

Timing is not asserted (it is noisy on a shared machine): each rank counts the Python lines
its main thread executes during a Checkpointer save and restore (every loop iteration, in
comprehensions and generators too), a deterministic measure of the work. Four times the
tensors must cost about four times the lines; a loop over every piece per replica (or any
other O(n^2) step in Python) makes it sixteen.
"""
import sys

import torch

from alpha_ckpt import Checkpointer
from ranks import run_ranks

SMALL, LARGE = 400, 1600  # 4x the tensors
BOUND = 5.0  # linear: about 4 (less, with the fixed costs); quadratic: towards 16


def state_of(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    # mostly tiny tensors of a few shapes, as an MoE model's experts and their optimizer state have
    return {"model": {f"expert{i // 4}.w{i % 4}": torch.randn(3 + i % 5, generator=g) for i in range(n)},
            "step": torch.tensor(7)}


def lines_during(fn) -> int:
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        count += 1  # every call and every line run, a loop's each iteration
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _save_and_restore_lines(rank: int, world: int, store: str, n: int) -> dict:
    state = state_of(n)
    ckpt = Checkpointer(store, run=f"n{n}", step="s")
    ckpt.restore(state, None)
    ckpt.save(state, update=0)  # the first save of a process also probes the store's write modes
    save = lines_during(lambda: ckpt.save(state, update=1))
    dest = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": torch.tensor(0)}
    restore = lines_during(lambda: ckpt.restore(dest, "latest"))
    ckpt.close()
    same = all(torch.equal(dest["model"][k], v) for k, v in state["model"].items()) and int(dest["step"]) == 7
    return {"save": save, "restore": restore, "restored": same}


def test_save_and_restore_lines_grow_linearly_with_the_tensor_count_on_two_ranks(tmp_path):
    small = run_ranks(2, _save_and_restore_lines, str(tmp_path / "store"), SMALL, tmp=tmp_path, timeout=240)
    large = run_ranks(2, _save_and_restore_lines, str(tmp_path / "store"), LARGE, tmp=tmp_path, timeout=240)
    assert all(r["restored"] for r in small + large)
    for rank in range(2):
        for phase in ("save", "restore"):
            ratio = large[rank][phase] / small[rank][phase]
            assert ratio < BOUND, (rank, phase, small[rank][phase], large[rank][phase])
