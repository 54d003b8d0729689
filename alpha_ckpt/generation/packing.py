"""What a save writes, before a byte is written: a region's words as bytes, which parts share a
shard (and how a large one is cut), which are compressed, and which are carried from this
writer's last save instead of written again.
"""
from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch
import zstandard

from alpha_ckpt.format.records import CapturePrefix, ShardRef
from alpha_ckpt.generation.planner import Piece
from alpha_ckpt.store import Store

ZSTD_LEVEL = 1
_SAMPLE_BYTES = 1 << 20
_SAMPLE_TIMINGS = 3


class ShardCarry:
    """What this writer wrote before, so that an unchanged region is not written again.

    For each single-piece shard it wrote: the piece's raw BLAKE3, the shard's
    record and the capture that wrote it. A later save of the same run/step
    hashes the piece; when the bytes are unchanged and the object is still in
    the store, the new manifest names the old shard, marked as carried. Only
    what this process wrote is trusted (nothing is read back from disk).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[str, ShardRef, CapturePrefix]] = {}
        self.bytes_carried = 0

    @staticmethod
    def key(prefix: CapturePrefix, schema: str, piece: Piece, codec: str) -> tuple:
        return (prefix.run, prefix.step, schema, piece.ordinal, piece.lo, piece.hi, codec)

    def knows(self, key: tuple) -> bool:
        return key in self._entries

    def find(self, key: tuple, prefix: CapturePrefix, raw_digest: str, store: Store) -> ShardRef | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] != raw_digest:
            return None
        _, record, written = entry
        if (written.update, written.cursor, written.epoch) == (prefix.update, prefix.cursor, prefix.epoch):
            return record if record.carried is None else None
        # Renewing the object's mtime keeps gc's grace period over it until this publish has its ref.
        if not store.has_object(record.digest) or not store.renew_object(record.digest):
            return None
        self.bytes_carried += record.size
        return ShardRef(record.digest, record.size, record.slices, (written.update, written.cursor, written.epoch))

    def remember(self, key: tuple, raw_digest: str, record: ShardRef, prefix: CapturePrefix) -> None:
        self._entries[key] = (raw_digest, record, prefix)


def group_parts(parts: Sequence[tuple], max_bytes: int) -> list[list[tuple]]:
    """Consecutive parts grouped into shards of at most ``max_bytes`` raw bytes (a larger part alone):
    few durable commits, and heads that stay small (block digests are about 1/1024 of a payload)."""
    shards: list[list[tuple]] = []
    filled = 0
    for part in parts:
        if not shards or (filled + len(part[1]) > max_bytes and shards[-1]):
            shards.append([])
            filled = 0
        shards[-1].append(part)
        filled += len(part[1])
    return shards


def cut_part(part: tuple, limit: int) -> list[tuple]:
    """(piece, raw bytes, codec) as consecutive parts of at most ``limit`` bytes (a multiple of every
    word size: the cuts fall on word and 64 KiB block boundaries)."""
    piece, raw, codec = part
    words = limit // piece.itemsize
    cuts = []
    for lo in range(piece.lo, piece.hi, words):
        hi = min(lo + words, piece.hi)
        cuts.append((Piece(piece.ordinal, lo, hi, piece.itemsize),
                     raw[(lo - piece.lo) * piece.itemsize:(hi - piece.lo) * piece.itemsize], codec))
    return cuts or [part]


def word_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The region's words as a flat uint8 CPU tensor, without copying when possible."""
    t = tensor.detach()
    if t.numel() == 0:  # NumPy's empty arrays have zero strides, which view() refuses
        return torch.empty(0, dtype=torch.uint8)
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _u8_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(b"")


def word_view(tensor: torch.Tensor) -> memoryview:
    """The region's words as flat bytes (:func:`word_bytes` as a memoryview), without a torch op where
    NumPy can see the tensor as it is: a state of many small tensors pays this once per tensor."""
    if tensor.device.type == "cpu" and not tensor.requires_grad:
        try:
            return memoryview(tensor.numpy()).cast("B") if tensor.numel() else memoryview(b"")
        except (TypeError, RuntimeError):  # bfloat16, strided, conjugate: through torch
            pass
    return _u8_view(word_bytes(tensor))


DEFAULT_DISK_BYTES_PER_S = 1e9  # until the store has measured its own writes


def choose_codec(data: memoryview, requested: str, disk_bytes_per_s: float = DEFAULT_DISK_BYTES_PER_S) -> str:
    """'raw', 'zstd', or 'auto': zstd only where it makes the write faster, judged from a 1 MiB sample.

    Compressing n bytes at rate c and writing r*n at disk rate d beats writing
    n raw when n/c + r*n/d < n/d, i.e. c > d / (1 - r). On a local disk zstd
    level 1 on float data (c ~0.7 GB/s, r ~0.8-0.9) never pays; zeros or
    repetitive data (c of several GB/s, r near 0) do, and so does most data
    on a slow network file system.
    """
    if requested in ("raw", "zstd"):
        return requested
    if requested != "auto":
        raise ValueError(f"unknown compression {requested!r} (raw, zstd or auto)")
    sample = data[:_SAMPLE_BYTES]
    if len(sample) < 4096:
        return "raw"
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    seconds = float("inf")
    for _ in range(_SAMPLE_TIMINGS):  # the fastest of a few: a preempted run says nothing about the codec
        started = time.perf_counter()
        compressed = len(compressor.compress(sample))
        seconds = min(seconds, max(time.perf_counter() - started, 1e-9))
    return "zstd" if zstd_pays(compressed / len(sample), len(sample) / seconds, disk_bytes_per_s) else "raw"


def zstd_pays(ratio: float, compress_bytes_per_s: float, disk_bytes_per_s: float) -> bool:
    """Whether compressing then writing ``ratio`` of the bytes beats writing them raw."""
    return ratio < 1.0 and compress_bytes_per_s > disk_bytes_per_s / (1.0 - ratio)


_CODEC_CHOICES = ("raw", "zstd", "auto")


def check_compression(compression: str | Mapping[str, str], names: set[str]) -> None:
    """Refuse a bad compression request before anything is written."""
    choices = [compression] if isinstance(compression, str) else list(compression.values())
    bad = [c for c in choices if c not in _CODEC_CHOICES]
    if bad:
        raise ValueError(f"unknown compression {bad[0]!r} (choose from {', '.join(_CODEC_CHOICES)})")
    if not isinstance(compression, str):
        unknown = sorted(set(compression) - names)
        if unknown:
            raise ValueError(f"compression names regions the state does not have: {unknown}")
