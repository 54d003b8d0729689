"""Hashing a shard's raw parts while they are written: BLAKE3 and block digests, and the first NaN/inf word.

A part of at most one block is hashed on the writing thread; small parts are hashed in batches,
one task per batch; a large part by a task of its own (BLAKE3 releases the GIL, so it overlaps the
kernel's copy of the same bytes into the file).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import blake3

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import BLOCK_BYTES, DTYPES, RegionDecl, block_digests, blocked, digest_of_blocks, hash_blocks
from alpha_ckpt.state.manifest import first_non_finite, word_value
from alpha_ckpt.generation.planner import Piece


def hash_stored(view) -> str:
    return blake3.blake3(view).hexdigest()


_FINITE_CHUNK = 8 << 20  # hashed and checked together while the chunk is in cache


def _hash_and_check(view: memoryview, dtype: str, known: tuple[str, str | None] | None,
                    ) -> tuple[str, str | None, int | None]:
    """A raw part's (digest, block digests) as :func:`block_digests` defines them (``known`` when
    already computed) and its first NaN/inf word, in one pass over the bytes."""
    if not DTYPES[dtype][1]:
        return (*(known or block_digests(view)), None)
    blocks: list[str] | None = None if known else []
    bad = None
    for start in range(0, len(view), _FINITE_CHUNK):
        chunk = view[start:start + _FINITE_CHUNK]
        if blocks is not None:
            blocks += hash_blocks(chunk)
        if bad is None:
            index = first_non_finite(chunk, dtype)
            bad = None if index is None else start // DTYPES[dtype][0] + index
            if bad is not None and blocks is None:
                break
    if known:
        return (*known, bad)
    if not blocked(len(view)):
        return block_digests(view)[0], None, bad
    listed = "".join(blocks)
    return digest_of_blocks(listed), listed, bad


def hash_part(raw: memoryview, dtype: str, known: tuple[str, str | None] | None, check: bool,
               ) -> tuple[str, str | None, int | None]:
    """One raw part's (digest, block digests, first NaN/inf word or None; None unchecked)."""
    if check:
        return _hash_and_check(raw, dtype, known)
    return (*(known or block_digests(raw)), None)


# Parts of at most one block are hashed and checked on the writing thread as they are met: their
# cost is Python's per part, which threads would only contend for (the GIL), not share.
INLINE_HASH_BYTES = BLOCK_BYTES


def hash_small(raw: memoryview, dtype: str, known: tuple[str, str | None] | None, check: bool,
                ) -> tuple[str, None, int | None]:
    """An unblocked part's (digest, None, first NaN/inf word or None), as :func:`hash_part` gives it."""
    digest = known[0] if known else blake3.blake3(raw).hexdigest()
    return digest, None, first_non_finite(raw, dtype) if check else None


class Ready:
    """A result already computed, read as a future's (without a future's lock)."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


HASH_BATCH_BYTES = 1 << 20  # parts smaller than this are hashed in batches of about this many bytes
HASH_BATCH_PARTS = 4096


class HashBatch:
    """Small parts hashed by one task; :meth:`add` gives a part's slot, whose ``result()`` is what
    a future of the part's own would give."""

    def __init__(self):
        self.jobs: list[tuple] = []
        self.bytes = 0
        self.future: Future | None = None
        self.results: list | None = None

    def add(self, job: tuple) -> "_Slot":
        self.jobs.append(job)
        self.bytes += len(job[0])
        return _Slot(self, len(self.jobs) - 1)

    def full(self) -> bool:
        return self.bytes >= HASH_BATCH_BYTES or len(self.jobs) >= HASH_BATCH_PARTS

    def submit(self, pool: ThreadPoolExecutor) -> None:
        jobs = self.jobs
        self.future = pool.submit(lambda: [hash_part(*job) for job in jobs])

    def result(self, index: int):
        if self.results is None:
            self.results = self.future.result()
        return self.results[index]


class _Slot:
    __slots__ = ("batch", "index")

    def __init__(self, batch: HashBatch, index: int):
        self.batch, self.index = batch, index

    def result(self):
        return self.batch.result(self.index)


def refuse_non_finite(region: RegionDecl, piece: Piece, raw: memoryview, index: int) -> Refusal:
    value = word_value(raw, region.dtype, index)
    return Refusal(RefusalCode.NON_FINITE, f"region {region.name!r} word {piece.lo + index} is {value}: a restore "
                   "would refuse it, so it is not published (declare regions that may hold NaN/inf with "
                   "allow_nonfinite)")
