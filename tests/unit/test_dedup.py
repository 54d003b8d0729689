"""Dedup: a region whose bytes did not change since the last generation is not written again."""
import pytest
import torch

import alpha_ckpt
from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.restore import open_generation, verify_generation
from alpha_ckpt.writer import ShardCarry


def _state(step: int):
    g = torch.Generator().manual_seed(7)
    return {"embedding": torch.randn(4096, 128, generator=g),          # 2 MiB, frozen
            "head": torch.full((64, 8), float(step)),                 # trained
            "step": torch.tensor(step)}


def _save(store, carry, step):
    return alpha_ckpt.save(_state(step), store=store, run="r", step="fit", update=step, cursor=step * 10, epoch=0,
                           carry=carry)


def test_a_frozen_region_costs_zero_bytes_written_in_later_generations(tmp_path):
    store, carry = alpha_ckpt.Store(tmp_path), ShardCarry()
    table = _state(0)["embedding"].numel() * 4
    written = []
    roots = []
    for step in range(1, 4):
        before = store.bytes_written
        roots.append(_save(store, carry, step))
        written.append(store.bytes_written - before)
    assert written[0] > table
    assert all(w < 64 * 1024 for w in written[1:]), written  # the head, the counters and a manifest only
    assert carry.bytes_carried >= 2 * table
    for step, root in enumerate(roots, start=1):
        restored = {"embedding": torch.empty(4096, 128), "head": torch.empty(64, 8), "step": torch.tensor(0)}
        counters = alpha_ckpt.load(restored, store=store, digest=root)
        assert counters.update == step and torch.equal(restored["embedding"], _state(0)["embedding"])
        assert torch.equal(restored["head"], _state(step)["head"])


def test_a_carried_shard_is_named_with_the_capture_that_wrote_it(tmp_path):
    store, carry = alpha_ckpt.Store(tmp_path), ShardCarry()
    _save(store, carry, 1)
    root = _save(store, carry, 2)
    with verify_generation(store, root) as generation:
        carried = [s for s in generation.manifest.shards if s.carried is not None]
    assert len(carried) == 1 and carried[0].carried == (1, 10, 0)


def test_a_changed_frozen_region_is_written_again(tmp_path):
    store, carry = alpha_ckpt.Store(tmp_path), ShardCarry()
    _save(store, carry, 1)
    state = _state(2)
    state["embedding"][7, 3] += 1.0
    before = store.bytes_written
    alpha_ckpt.save(state, store=store, run="r", step="fit", update=2, cursor=20, epoch=0, carry=carry)
    assert store.bytes_written - before > state["embedding"].numel() * 4


def test_without_a_carry_every_generation_is_written_whole(tmp_path):
    store = alpha_ckpt.Store(tmp_path)
    _save(store, None, 1)
    before = store.bytes_written
    _save(store, None, 2)
    assert store.bytes_written - before > 4096 * 128 * 4


def test_a_manifest_naming_another_captures_shard_without_declaring_it_carried_is_mixed_capture(tmp_path):
    from alpha_ckpt.format import ShardRef
    from alpha_ckpt.manifest import check_shard_against_record
    store, carry = alpha_ckpt.Store(tmp_path), ShardCarry()
    _save(store, carry, 1)
    root = _save(store, carry, 2)
    with open_generation(store, root) as generation:
        m = generation.manifest
        record = next(s for s in m.shards if s.carried is not None)
        undeclared = ShardRef(record.digest, record.size, record.slices)
        _, head = generation.shards[record.digest]
        with pytest.raises(Refusal) as caught:
            check_shard_against_record(head, undeclared, m.prefix, m.schema_digest, m.regions, "shard")
        assert caught.value.code == RefusalCode.MIXED_CAPTURE
        wrong = ShardRef(record.digest, record.size, record.slices, (0, 0, 0))
        with pytest.raises(Refusal):
            check_shard_against_record(head, wrong, m.prefix, m.schema_digest, m.regions, "shard")
