"""Asynchronous save: real snapshots, one save in flight, failures never swallowed."""
from __future__ import annotations

import threading

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.generation.async_save import AsyncSaver


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(1 << 16, generator=g), "b": torch.randn(7, generator=g)},
            "step": torch.tensor(3), "half": torch.randn(5, generator=g).to(torch.bfloat16)}


def _empty_like(state):
    return {k: _empty_like(v) if isinstance(v, dict) else torch.full_like(v, 0) for k, v in state.items()}


@pytest.mark.parametrize("defer", [False, True])
def test_values_changed_after_the_snapshot_do_not_reach_the_checkpoint(tmp_path, defer):
    store = alpha_ckpt.Store(tmp_path)
    state = _state()
    expected = {"w": state["model"]["w"].clone(), "half": state["half"].clone()}
    handle = alpha_ckpt.save_async(state, store=store, run="r", step="s", update=1, cursor=1, epoch=0,
                                   defer_snapshot=defer)
    handle.wait_snapshot()
    state["model"]["w"].add_(1.0)  # training goes on before the save is durable
    state["half"].mul_(2)
    root = handle.result().root
    restored = _empty_like(state)
    alpha_ckpt.restore(restored, store=store, root=root)
    assert torch.equal(restored["model"]["w"], expected["w"])
    assert torch.equal(restored["half"], expected["half"])
    assert handle.stall_s >= 0 and handle.save_s >= handle.snapshot_s


def _blocked_publish(release: threading.Event, calls: list):
    def publish(snapshot):
        calls.append([t.clone() for t in snapshot])
        assert release.wait(30)
        return len(calls)
    return publish


def test_skip_policy_skips_a_boundary_while_a_save_is_in_flight():
    saver = AsyncSaver(in_flight="skip")
    release, calls = threading.Event(), []
    t = torch.arange(10.0)
    first = saver.submit([t], _blocked_publish(release, calls))
    assert saver.submit([t], _blocked_publish(release, calls)) is None
    assert saver.skipped == 1
    release.set()
    assert first.result(30) == 1
    second = saver.submit([t], _blocked_publish(release, calls))
    assert second.result(30) == 2
    saver.close()


def test_wait_policy_blocks_the_next_boundary_until_the_previous_save_is_durable():
    saver = AsyncSaver(in_flight="wait")
    release, calls = threading.Event(), []
    t = torch.arange(10.0)
    first = saver.submit([t], _blocked_publish(release, calls))
    threading.Timer(0.3, release.set).start()
    second = saver.submit([t], _blocked_publish(release, calls))
    assert first.done() and second.waited_s >= 0.2 and second.stall_s >= second.waited_s
    assert second.result(30) == 2
    saver.close()


def test_a_failed_save_is_raised_by_the_next_boundary_and_by_drain():
    saver = AsyncSaver()

    def failing(snapshot):
        raise OSError("disk full")

    saver.submit([torch.ones(3)], failing)
    with pytest.raises(OSError, match="disk full"):
        saver.submit([torch.ones(3)], lambda snap: None)
    saver.submit([torch.ones(3)], failing)
    with pytest.raises(OSError, match="disk full"):
        saver.drain()
    saver.close()


def test_snapshot_buffers_are_reused_between_saves():
    saver = AsyncSaver()
    seen = []
    t = torch.randn(1000)
    for _ in range(3):
        saver.submit([t], lambda snap: seen.append(snap[0].data_ptr())).result(30)
    assert len(set(seen)) == 1 and seen[0] != t.data_ptr()
    saver.close()


def test_unknown_in_flight_policy_is_refused():
    with pytest.raises(ValueError, match="in_flight"):
        AsyncSaver(in_flight="queue")
