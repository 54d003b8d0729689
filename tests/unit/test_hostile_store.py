"""A hostile or damaged store: every case ends in a Refusal (or is ignored), never a crash or an escape."""
import json
import os

import blake3
import pytest
import torch
import zstandard

import alpha_ckpt
from alpha_ckpt import Refusal, RefusalCode, durable
from alpha_ckpt.format import CapturePrefix, RegionDecl, ShardRef, encode_head
from alpha_ckpt.planner import WantedSlice
from alpha_ckpt.restore import open_generation, restore_slices, validate_object_bytes
from alpha_ckpt.writer import write_manifest
from alpha_ckpt.store import Store
from conftest import save_forged


def test_manifest_record_naming_an_undeclared_region_is_coverage(saved):
    store_dir, root, _ = saved
    with Store(store_dir) as s:
        with open_generation(s, root) as g:
            m = g.manifest
        record = m.shards[0]
        bad = ShardRef(record.digest, record.size, ((len(m.regions) + 4, 0, 1),))
        root2, _ = write_manifest(s, m.prefix, m.regions, [bad], 1, None)
        with pytest.raises(Refusal) as info:
            open_generation(s, root2)
        assert info.value.code == RefusalCode.COVERAGE


def _zstd_shard(frame: bytes, raw: int) -> tuple[bytes, str]:
    header = {"kind": "shard", "payload_bytes": len(frame), "schema_digest": "0" * 64,
              "prefix": {"run": "r", "step": "s", "update": 0, "cursor": 0, "epoch": 0},
              "slices": [{"ordinal": 0, "dtype": "uint8", "shape": [raw], "lo": 0, "hi": raw, "offset": 0,
                          "stored": len(frame), "codec": "zstd", "raw": raw, "blake3": "0" * 64,
                          "stored_blake3": blake3.blake3(frame).hexdigest()}]}
    head = encode_head(header)
    return head + frame, blake3.blake3(head).hexdigest()


def test_zstd_frame_with_trailing_bytes_is_refused():
    frame = zstandard.ZstdCompressor().compress(bytes(1000)) + b"\x00\x00"
    data, digest = _zstd_shard(frame, 1000)
    with pytest.raises(Refusal) as info:
        validate_object_bytes(data, digest)
    assert info.value.code == RefusalCode.FORMAT and "the slice stores" in info.value.message


@pytest.mark.timeout(60)
def test_verifying_a_huge_declared_zstd_slice_allocates_only_a_chunk():
    # The frame honestly claims 2 GiB of zeros in a few hundred bytes; verify must
    # stream it through a bounded buffer (and refuse it: the raw digest is wrong).
    raw = 2 << 30
    chunks = zstandard.ZstdCompressor(level=1).compressobj(size=raw)
    zeros = bytes(16 << 20)
    frame = b"".join(chunks.compress(zeros) for _ in range(raw // len(zeros))) + chunks.flush()
    data, digest = _zstd_shard(frame, raw)
    import tracemalloc
    tracemalloc.start()
    with pytest.raises(Refusal) as info:
        validate_object_bytes(data, digest)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert info.value.code == RefusalCode.FORMAT and "BLAKE3" in info.value.message
    assert peak < len(data) + (64 << 20)


def test_ref_names_with_unicode_digits_are_ignored(saved):
    store_dir, root, _ = saved
    (store_dir / "refs" / "nightly" / "fit" / ("\u00b2" * 10)).write_text("x")
    (store_dir / "refs" / "nightly" / "fit" / ("\u0660" * 10)).write_text("x")
    with Store(store_dir) as s:
        assert [r.generation for r in s.list_refs("nightly", "fit")] == [1]
    assert alpha_ckpt.latest(store_dir, "nightly", "fit") == root


def test_a_symlinked_run_directory_is_not_followed(saved, tmp_path):
    store_dir, root, _ = saved
    outside = tmp_path / "outside"
    os.rename(store_dir / "refs" / "nightly", outside)
    os.symlink(outside, store_dir / "refs" / "nightly")
    with Store(store_dir) as s:
        assert s.runs() == []
        with pytest.raises(Refusal) as info:
            s.list_refs("nightly", "fit")
        assert info.value.code == RefusalCode.FORMAT


def test_a_store_reached_through_a_symlink_works(saved, tmp_path):
    store_dir, root, _ = saved
    link = tmp_path / "link"
    os.symlink(store_dir, link)
    alpha_ckpt.verify(link, root)


def test_an_object_truncated_while_mapped_is_refused_not_a_crash(store_dir):
    state = {"a": torch.randn(1 << 20)}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=0, cursor=0, epoch=0)
    with Store(store_dir) as s:
        with open_generation(s, root) as g:
            (digest, (obj, head)), = g.shards.items()
            os.chmod(s.object_path(digest), 0o644)
            os.truncate(s.object_path(digest), head.head_len + 100)
            target = torch.zeros(4 << 20, dtype=torch.uint8)
            with pytest.raises(Refusal) as info:
                restore_slices(g, [WantedSlice(0, 0, 1 << 20, 0)], [target])
            assert info.value.code == RefusalCode.CORRUPT_SHARD and "shrank" in info.value.message
            assert not target.any()


def test_published_objects_and_refs_are_read_only(saved):
    store_dir, root, _ = saved
    with Store(store_dir) as s:
        assert os.stat(s.object_path(root)).st_mode & 0o777 == 0o444
    assert os.stat(store_dir / "refs" / "nightly" / "fit" / "0000000001").st_mode & 0o777 == 0o444


def test_an_existing_directory_is_fsynced_again(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    os.close(durable.make_dir_durable(parent, "d"))
    os.close(parent)
    assert synced == [parent]


def test_a_refusal_in_the_first_slice_of_many_ends_the_restore(store_dir):
    state = {f"t{i}": torch.randn(1 << 18) for i in range(24)}
    state["t0"][5] = float("nan")
    root = save_forged(state, store_dir, update=0)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.load({k: torch.zeros_like(v) for k, v in state.items()}, store=store_dir, digest=root)
    assert info.value.code == RefusalCode.NON_FINITE and "word 5 " in info.value.message
