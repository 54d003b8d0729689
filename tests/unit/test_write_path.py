"""The write path's costs that grow with tensor count or file size, checked by what they do.

- small segments of a shard are written gathered (few system calls), byte for byte as laid out;
- a large save is several shard files of at most DEFAULT_MAX_SHARD_BYTES (one file is written
  by one thread at a time), and restores bit for bit;
- Python's cyclic collector is paused during a save and a restore, and runs again afterwards.
"""
import gc
import os
import random
import threading

import torch

import alpha_ckpt
from alpha_ckpt.runtime import heap
from alpha_ckpt.generation import writer
from alpha_ckpt.generation.reader import open_generation
from alpha_ckpt.store import Store


def test_gathered_segments_leave_exactly_the_laid_out_bytes_with_few_writes(tmp_path, monkeypatch):
    calls = []
    real = os.pwrite
    monkeypatch.setattr(writer.os, "pwrite", lambda fd, data, offset: calls.append(len(data)) or real(fd, data, offset))
    rng = random.Random(7)
    for trial in range(60):
        segments, at = [], rng.randint(0, 100)
        for _ in range(rng.randint(0, 300)):
            n = rng.choice([0, 1, 63, 800, 4096, (1 << 20) - 1, 1 << 20, 3 << 20]) if rng.random() < 0.2 \
                else rng.randint(0, 2000)
            segments.append((at, memoryview(os.urandom(n))))
            at += n + rng.choice([0, 0, 5, 63, 4096, 4097, 50000])
        path = tmp_path / f"shard{trial}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        calls.clear()
        writer._pwrite_segments(fd, segments)
        end = max((o + len(v) for o, v in segments), default=0)
        os.ftruncate(fd, end)
        os.close(fd)
        expected = bytearray(end)
        for offset, view in segments:
            expected[offset:offset + len(view)] = view
        assert path.read_bytes() == bytes(expected), trial


def test_a_shard_of_many_small_slices_is_written_in_about_one_write_per_mebibyte(tmp_path, monkeypatch):
    calls = []
    real = os.pwrite
    monkeypatch.setattr(writer.os, "pwrite", lambda fd, data, offset: calls.append(len(data)) or real(fd, data, offset))
    segments, at = [], 0
    for i in range(10_000):  # slices of 2 KiB and 128 bytes, each at the next multiple of 64, as a shard lays them out
        view = memoryview(os.urandom(2048 if i % 2 else 128))
        segments.append((at, view))
        at += len(view) + (-len(view) % 64)
    fd = os.open(tmp_path / "shard", os.O_RDWR | os.O_CREAT)
    try:
        writer._pwrite_segments(fd, segments)
    finally:
        os.close(fd)
    assert len(calls) <= at // writer._GATHER_BYTES + 2


def test_a_save_larger_than_one_shard_file_is_several_files_and_restores_bit_for_bit(tmp_path):
    words = writer.DEFAULT_MAX_SHARD_BYTES // 4 + 1000  # one float32 region a little over one file
    source = {"embedding": torch.randn(words, generator=torch.Generator().manual_seed(3))}
    root = alpha_ckpt.save(source, store=tmp_path, run="r", step="s", update=1, cursor=1, epoch=0)
    with Store(tmp_path, create=False) as store:
        generation = open_generation(store, root)
        try:
            sizes = [s.size for s in generation.manifest.shards]
        finally:
            generation.close()
    assert len(sizes) == 2 and max(sizes) <= writer.DEFAULT_MAX_SHARD_BYTES + (1 << 20)  # payload cut, plus heads
    dest = {"embedding": torch.zeros(words)}
    alpha_ckpt.restore(dest, store=tmp_path, root=root)
    assert torch.equal(dest["embedding"], source["embedding"])


def test_the_collector_is_paused_inside_save_and_load_and_runs_again_after(tmp_path, monkeypatch):
    seen = []
    real_hash = writer.hash_small

    def spy(*args):
        seen.append(gc.isenabled())
        return real_hash(*args)
    monkeypatch.setattr(writer, "hash_small", spy)
    assert gc.isenabled()
    root = alpha_ckpt.save({"w": torch.randn(8)}, store=tmp_path, run="r", step="s", update=1, cursor=1, epoch=0)
    assert seen == [False] and gc.isenabled()
    alpha_ckpt.restore({"w": torch.zeros(8)}, store=tmp_path, root=root)
    assert gc.isenabled()


def test_paused_sections_nest_and_overlap_across_threads_and_keep_a_disabled_collector_off():
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other():
        with heap.cyclic_gc_paused():
            inside.set()
            release.wait(10)

    with heap.cyclic_gc_paused():
        thread = threading.Thread(target=other)
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's section is still open
    release.set()
    thread.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with heap.cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # not switched on by a section that found it off
    finally:
        gc.enable()
