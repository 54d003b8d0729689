"""Pieces between ranks: which travel together (pure), and that every byte arrives where it was declared."""
import hashlib

import pytest
from hypothesis import given, settings, strategies as st

from alpha_ckpt.publish.wire import BATCH_BYTES, batches, recv_pieces, send_pieces
from ranks import run_ranks

SIZES = [0, 3, 2 * BATCH_BYTES, 5, BATCH_BYTES - 1, BATCH_BYTES, 0, 7, BATCH_BYTES // 2, BATCH_BYTES // 2 + 1, 1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3 * BATCH_BYTES), max_size=40))
def test_batches_cover_every_piece_once_in_order_and_a_large_piece_travels_alone(sizes):
    out = batches(sizes)
    assert [i for batch in out for i in batch] == list(range(len(sizes)))
    for batch in out:
        if len(batch) > 1:
            assert all(sizes[i] < BATCH_BYTES for i in batch)
            # a run closes as soon as it reaches the batch size: all but its last piece stay below it
            assert sum(sizes[i] for i in batch[:-1]) < BATCH_BYTES


def _piece(i: int, size: int) -> bytes:
    return (hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1))[:size]


def exchange(rank, world):
    if rank == 1:
        views = [memoryview(_piece(i, n)) for i, n in enumerate(SIZES)]
        send_pieces(views, 0)
        return None
    got = recv_pieces(SIZES, 1)
    return [bytes(v) == _piece(i, n) and len(v) == n for i, (v, n) in enumerate(zip(got, SIZES))]


@pytest.mark.timeout(120)
def test_pieces_sent_large_alone_and_small_together_arrive_whole_and_in_place(tmp_path):
    assert run_ranks(2, exchange, tmp=tmp_path)[0] == [True] * len(SIZES)
