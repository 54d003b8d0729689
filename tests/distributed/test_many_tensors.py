"""Save and restore cost grows linearly with the tensor count (MoE layers and per-parameter optimizer state).

Timing is not asserted (it is noisy on a shared machine): each rank counts the Python lines
its main thread executes during a Checkpointer save and restore (every loop iteration, in
comprehensions and generators too), a deterministic measure of the work. Four times the
tensors must cost about four times the lines; a loop over every piece per replica (or any
other O(n^2) step in Python) makes it sixteen.
"""
import sys

import torch

from alpha_ckpt import Checkpointer, PerRank
from ranks import run_ranks

SMALL, LARGE = 400, 1600  # 4x the tensors
BOUND = 5.0  # linear: about 4 (less, with the fixed costs); quadratic: towards 16


def state_of(n: int, per_rank: bool = False, rank: int = 0) -> dict:
    g = torch.Generator().manual_seed(n)
    # mostly tiny tensors of a few shapes, as an MoE model's experts and their optimizer state have
    model = {f"expert{i // 4}.w{i % 4}": torch.randn(3 + i % 5, generator=g) for i in range(n)}
    if per_rank:  # half of them each rank's own (as sharded optimizer state is): every rank its own shard
        g = torch.Generator().manual_seed(n + rank)
        own = {f"expert{i // 4}.m{i % 4}": torch.randn(3 + i % 5, generator=g) for i in range(n // 2)}
        model = {k: model[k] for k in list(model)[:n // 2]}
        return {"model": model, "optim": PerRank(own), "step": torch.tensor(7)}
    return {"model": model, "step": torch.tensor(7)}


def zeros_of(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, PerRank):
            out[k] = PerRank(zeros_of(v.value))
        elif isinstance(v, dict):
            out[k] = zeros_of(v)
        else:
            out[k] = torch.zeros_like(v)
    return out


def equal(a, b) -> bool:
    if isinstance(a, PerRank):
        return equal(a.value, b.value)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


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


def _save_and_restore_lines(rank: int, world: int, store: str, n: int, per_rank: bool = False) -> dict:
    state = state_of(n, per_rank, rank)
    ckpt = Checkpointer(store, run=f"n{n}", step="s")
    ckpt.restore(state, None)
    ckpt.save(state, update=0)  # the first save of a process also probes the store's write modes
    save = lines_during(lambda: ckpt.save(state, update=1))
    dest = zeros_of(state)
    restore = lines_during(lambda: ckpt.restore(dest, "latest"))
    ckpt.close()
    return {"save": save, "restore": restore, "restored": equal(state, dest)}


def assert_linear(small: list, large: list) -> None:
    assert all(r["restored"] for r in small + large)
    for rank, (s, l) in enumerate(zip(small, large)):
        for phase in ("save", "restore"):
            assert l[phase] / s[phase] < BOUND, (rank, phase, s[phase], l[phase])


def test_save_and_restore_work_grows_linearly_with_the_tensor_count_on_two_ranks(tmp_path):
    small = run_ranks(2, _save_and_restore_lines, str(tmp_path / "store"), SMALL, tmp=tmp_path, timeout=240)
    large = run_ranks(2, _save_and_restore_lines, str(tmp_path / "store"), LARGE, tmp=tmp_path, timeout=240)
    assert_linear(small, large)


def test_a_restore_passes_over_another_ranks_shard_of_many_tensors_in_linear_work(tmp_path):
    # each rank's per-rank tensors are in its own shard, which the other rank's restore must not scan
    # once per tensor it wants
    small = run_ranks(2, _save_and_restore_lines, str(tmp_path / "store"), SMALL, True, tmp=tmp_path, timeout=240)
    large = run_ranks(2, _save_and_restore_lines, str(tmp_path / "store"), LARGE, True, tmp=tmp_path, timeout=240)
    assert_linear(small, large)
