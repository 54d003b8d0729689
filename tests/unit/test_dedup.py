"""Dedup: a region whose bytes did not change since the last generation is not written again."""
import os
import pathlib
import stat
import time

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.generation.reader import open_generation, verify_generation
from alpha_ckpt.generation.writer import ShardCarry
from conftest import save_forged


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
        counters = alpha_ckpt.restore(restored, store=store, root=root)
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
    from alpha_ckpt.format.records import ShardRef
    from alpha_ckpt.state.manifest import check_shard_against_record
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


# ---------------------------------------------------------------- an existing object is checked before it is reused

def _flip_payload_byte(path) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)  # the last payload byte: the head (and so the name) stays as it was
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))


def _objects(store_dir):
    with alpha_ckpt.Store(store_dir, create=False) as s:
        return set(s.iter_objects())


def _shard_of(store_dir, root):
    with alpha_ckpt.Store(store_dir, create=False) as s, open_generation(s, root) as generation:
        (shard,) = generation.shards
        return shard, pathlib.Path(s.object_path(shard))


def _quarantine(store_dir):
    directory = store_dir / "quarantine"
    return sorted(os.listdir(directory)) if directory.exists() else []


STATE_KW = dict(run="r", step="s", update=1, cursor=0, epoch=0)


def test_a_damaged_object_is_set_aside_and_written_again_when_the_same_state_is_saved_again(tmp_path):
    store_dir, state = tmp_path / "store", {"w": torch.randn(4096)}
    root = alpha_ckpt.save(state, store=store_dir, **STATE_KW)
    shard, path = _shard_of(store_dir, root)
    _flip_payload_byte(path)
    damaged = open(path, "rb").read()
    again = alpha_ckpt.save(state, store=store_dir, **STATE_KW)  # a fresh Store handle, as a retry or double launch
    assert again == root
    alpha_ckpt.verify(store_dir, root)
    (entry,) = _quarantine(store_dir)
    assert entry.startswith(shard + "-")
    assert open(store_dir / "quarantine" / entry, "rb").read() == damaged  # kept for inspection, never deleted
    assert _objects(store_dir) == {root, shard}


def _put_fifo(path, data, outside):
    os.mkfifo(path)


def _put_directory(path, data, outside):
    os.mkdir(path)
    (path / "inside").write_bytes(data)


def _put_symlink(path, data, outside):
    outside.write_bytes(b"a file outside the store")
    os.symlink(outside, path)


def _put_truncated(path, data, outside):
    path.write_bytes(data[:-7])


HOSTILE = {"fifo": (_put_fifo, stat.S_ISFIFO), "directory": (_put_directory, stat.S_ISDIR),
           "symlink": (_put_symlink, stat.S_ISLNK), "truncated": (_put_truncated, stat.S_ISREG)}


@pytest.mark.timeout(60)  # a FIFO opened for reading in blocking mode would hang here
@pytest.mark.parametrize("which", ["shard", "manifest"])  # a manifest is reused through the digest-hint fast path
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_entry_at_an_object_path_is_set_aside_and_the_object_written_again(tmp_path, kind, which):
    store_dir, state = tmp_path / "store", {"w": torch.randn(4096)}
    root = alpha_ckpt.save(state, store=store_dir, **STATE_KW)
    shard, shard_path = _shard_of(store_dir, root)
    digest = shard if which == "shard" else root
    path = shard_path.parent.parent / digest[:2] / digest
    data = open(path, "rb").read()
    os.unlink(path)
    put, is_kind = HOSTILE[kind]
    put(path, data, tmp_path / "outside")
    assert alpha_ckpt.save(state, store=store_dir, **STATE_KW) == root
    alpha_ckpt.verify(store_dir, root)
    (entry,) = _quarantine(store_dir)
    assert entry.startswith(digest + "-") and is_kind(os.lstat(store_dir / "quarantine" / entry).st_mode)
    if kind == "symlink":
        assert (tmp_path / "outside").read_bytes() == b"a file outside the store"


def test_an_intact_object_holding_nan_is_reused_not_set_aside(tmp_path):
    # Publication refuses NaN, but an older store (or a forged generation) may hold it: its
    # objects are intact (their bytes are what their names say), so dedup reuses them.
    store_dir = tmp_path / "store"
    state = {"w": torch.tensor([1.0, float("nan"), 2.0] * 1000)}
    root = save_forged(state, store_dir)
    objects = sorted(p.name for p in (store_dir / "objects").glob("*/*"))
    assert save_forged(state, store_dir) == root  # a fresh Store handle: the existing objects are checked
    assert sorted(p.name for p in (store_dir / "objects").glob("*/*")) == objects
    assert _quarantine(store_dir) == []


def test_a_store_handle_reads_back_only_objects_it_did_not_write_or_check_itself(tmp_path, monkeypatch):
    from alpha_ckpt.generation import reader, writer
    checked = []
    real = reader.validate_object_file
    monkeypatch.setattr(writer, "validate_object_file", lambda obj, what="object": checked.append(obj.digest)
                        or real(obj, what))  # what the writer gives the store to check an existing object with
    store_dir, state = tmp_path / "store", {"w": torch.randn(4096)}
    with alpha_ckpt.Store(store_dir) as own:
        root = alpha_ckpt.save(state, store=own, **STATE_KW)
        alpha_ckpt.save(state, store=own, **STATE_KW)
    assert checked == []  # it wrote both objects: trusted by (device, inode, size)
    alpha_ckpt.save(state, store=store_dir, **STATE_KW)
    assert sorted(checked) == sorted(_objects(store_dir)) and root in checked


def test_gc_sweeps_quarantined_entries_once_older_than_its_grace_period(tmp_path):
    from alpha_ckpt.upkeep.gc import apply_gc, plan_gc
    store_dir, state = tmp_path / "store", {"w": torch.randn(4096)}
    root = alpha_ckpt.save(state, store=store_dir, **STATE_KW)
    _, path = _shard_of(store_dir, root)
    _flip_payload_byte(path)
    alpha_ckpt.save(state, store=store_dir, **STATE_KW)
    (entry,) = _quarantine(store_dir)
    os.mkdir(store_dir / "quarantine" / f"{'ab' * 32}-{int(time.time()) - 7200}-0123abcd")  # a directory set aside
    with alpha_ckpt.Store(store_dir, create=False) as s:
        plan = plan_gc(s, grace=3600)
        assert len(plan.quarantine) == 1 and plan.to_json()["quarantine"] == 1
        apply_gc(s, plan)
    assert _quarantine(store_dir) == [entry]  # the young one stays for inspection
    with alpha_ckpt.Store(store_dir, create=False) as s:
        apply_gc(s, plan_gc(s, grace=3600, now=time.time() + 7200))
    assert _quarantine(store_dir) == []
    alpha_ckpt.verify(store_dir, root)
