"""What the product reports about its own work, so that benchmarks read figures instead of wrapping
functions: the store's validation of reused objects, and the DCP backend's steps and shard size."""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import alpha_ckpt
from alpha_ckpt.dcp import StorageReader, StorageWriter
from alpha_ckpt.store import Store


def state(tensors: int = 4, words: int = 1 << 16) -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(words, generator=g) for i in range(tensors)}


def objects_in(root) -> int:
    return sum(len(files) for _, _, files in os.walk(os.path.join(root, "objects")))


def test_a_resave_reports_every_existing_object_it_validated_before_reusing_it(tmp_path):
    values = state()
    with Store(tmp_path, create=True) as first:
        alpha_ckpt.save(values, store=first, run="r", step="s", update=1, cursor=0, epoch=0)
        assert first.reuse_checks == 0 and first.reuse_check_seconds == 0.0  # everything was new
    stored = objects_in(tmp_path)
    with Store(tmp_path) as again:  # a new handle trusts nothing it finds
        alpha_ckpt.save(values, store=again, run="r", step="s", update=1, cursor=0, epoch=0)
        assert again.bytes_written == 0  # the identical generation: every object reused
        assert again.reuse_checks == stored and again.reuse_check_seconds > 0
    assert objects_in(tmp_path) == stored


def test_the_dcp_writer_reports_its_steps_and_cuts_shards_at_the_size_asked(tmp_path):
    values = state(tensors=4, words=1 << 18)  # 4 tensors of 1 MiB
    sizes = {}
    for shard_mib in (1, 32):
        store = tmp_path / f"shards-{shard_mib}"
        writer = StorageWriter(store, run="r", update=1, slice_bytes=1 << 20, shard_bytes=shard_mib << 20)
        dcp.save(values, storage_writer=writer, no_dist=True)
        assert set(writer.phases) == {"set_up", "plan", "write", "finish"}  # one process: the coordinator
        assert all(seconds > 0 for seconds in writer.phases.values())
        sizes[shard_mib] = objects_in(store)
        back = {k: torch.full_like(v, float("nan")) for k, v in values.items()}
        dcp.load(back, storage_reader=StorageReader(store, run="r"), no_dist=True)
        assert all(torch.equal(back[k], values[k]) for k in values)
    assert sizes[1] == 4 + 1 and sizes[32] == 1 + 1  # one shard per MiB, or one for all; and the manifest


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1"])
def test_a_shard_size_that_is_not_a_positive_int_is_refused_when_the_writer_is_made(tmp_path, bad):
    with pytest.raises(ValueError, match="shard_bytes"):
        StorageWriter(tmp_path, run="r", update=1, shard_bytes=bad)
