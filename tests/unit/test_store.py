"""Refs, mixed captures and names that must never escape the store."""

import pytest
import torch

import alpha_ckpt
from alpha_ckpt import PublishConflict, Refusal, RefusalCode
from alpha_ckpt.format.records import CapturePrefix, RegionDecl
from alpha_ckpt.generation.planner import Piece
from alpha_ckpt.generation.reader import open_generation
from alpha_ckpt.generation.writer import word_bytes, write_manifest
from alpha_ckpt.store import Store
from alpha_ckpt.store.posix import PosixRefDir
from alpha_ckpt.testing.forge import publish_forged


def test_generations_are_numbered_per_run_and_step(store_dir):
    for update in (1, 2):
        alpha_ckpt.save({"a": torch.full((2,), float(update))}, store=store_dir, run="r", step="fit",
                        update=update, cursor=update * 10, epoch=0)
    alpha_ckpt.save({"a": torch.zeros(2)}, store=store_dir, run="other", step="fit", update=1, cursor=0, epoch=0)
    with Store(store_dir) as s:
        refs = s.list_refs("r", "fit")
        assert [(r.generation, r.prefix.update, r.prefix.cursor) for r in refs] == [(1, 1, 10), (2, 2, 20)]
        assert [r.generation for r in s.list_refs("other", "fit")] == [1]


def test_a_racing_publisher_cannot_overwrite_a_generation(store_dir, monkeypatch):
    alpha_ckpt.save({"a": torch.ones(2)}, store=store_dir, run="r", step="fit", update=1, cursor=0, epoch=0)
    with Store(store_dir) as s:
        first = s.list_refs("r", "fit")[0]
        # Pretend this publisher did not see generation 1 (it raced the other one).
        monkeypatch.setattr(PosixRefDir, "numbers", lambda self: [])
        with pytest.raises(PublishConflict):
            s.publish_ref(CapturePrefix("r", "fit", 2, 0, 0), "cd" * 32, 10, 10, 1)
        monkeypatch.undo()
        assert s.list_refs("r", "fit") == [first]


def _regions():
    return [RegionDecl(0, "w", "float32", (4,))]


def test_shards_from_different_captures_are_mixed_capture(store_dir):
    t = word_bytes(torch.arange(4.0))
    view = memoryview(t.numpy())
    with Store(store_dir) as s:
        # Each half alone covers half the region: forged (a publish refuses an incomplete generation).
        a = publish_forged(s, CapturePrefix("r", "fit", 3, 30, 0), _regions(), [[(Piece(0, 0, 2, 4), view[:8], "raw")]])
        b = publish_forged(s, CapturePrefix("r", "fit", 4, 40, 0), _regions(), [[(Piece(0, 2, 4, 4), view[8:], "raw")]])
        prefix = CapturePrefix("r", "fit", 3, 30, 0)
        root, _ = write_manifest(s, prefix, _regions(), [a.shards[0], b.shards[0]], 1, None)
        with pytest.raises(Refusal) as info:
            open_generation(s, root)
        assert info.value.code == RefusalCode.MIXED_CAPTURE and "update=4" in info.value.message


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "ab" * 31 + "/x", "AB" * 32, "ab" * 32 + "\x00"])
def test_object_names_that_are_not_plain_digests_are_refused(store_dir, name):
    with Store(store_dir) as s:
        with pytest.raises(Refusal) as info:
            s.open_object(name, "shard")
        assert info.value.code == RefusalCode.FORMAT


def test_a_manifest_naming_itself_cannot_exist_and_a_cycle_is_refused(saved):
    # A manifest's name is the digest of its own head, so it cannot name itself;
    # a shard record naming a manifest is refused as format when read as a shard.
    store_dir, root, _ = saved
    with Store(store_dir) as s:
        m = open_generation(s, root)
        m.close()
        record = m.manifest.shards[0]
        from alpha_ckpt.format.records import ShardRef
        root2, size = write_manifest(s, m.prefix, m.manifest.regions,
                                     [ShardRef(root, s.open_object(root, "m").size, record.slices)], 1, None)
        with pytest.raises(Refusal) as info:
            open_generation(s, root2)
        assert info.value.code == RefusalCode.FORMAT
