"""Pieces between ranks: which travel together (pure), that every byte arrives where it was declared,
and that the star's receiver reuses a bounded set of buffers."""
import hashlib
import threading

import pytest
from hypothesis import given, settings, strategies as st

from alpha_ckpt.publish.wire import (
    BATCH_BYTES, ReceiveBuffers, batches, recv_batches, recv_pieces, send_pieces,
)
from ranks import run_ranks

SIZES = [0, 3, 2 * BATCH_BYTES, 5, BATCH_BYTES - 1, BATCH_BYTES, 0, 7, BATCH_BYTES // 2, BATCH_BYTES // 2 + 1, 1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3 * BATCH_BYTES), max_size=40), st.integers(1, 4 * BATCH_BYTES))
def test_batches_cover_every_piece_once_in_order_and_a_large_piece_travels_alone(sizes, run_bytes):
    out = batches(sizes, BATCH_BYTES, run_bytes)
    assert [i for batch in out for i in batch] == list(range(len(sizes)))
    for batch in out:
        if len(batch) > 1:
            assert all(sizes[i] < BATCH_BYTES for i in batch)
            # a run closes as soon as it reaches its size: all but its last piece stay below it
            assert sum(sizes[i] for i in batch[:-1]) < run_bytes


def _piece(i: int, size: int) -> bytes:
    return (hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1))[:size]


def exchange(rank, world, sizes, limit):
    if rank == 1:
        send_pieces([memoryview(_piece(i, n)) for i, n in enumerate(sizes)], 0)
        return None
    if limit is None:
        got = recv_pieces(sizes, 1)
        return {"equal": [bytes(v) == _piece(i, n) for i, (v, n) in enumerate(zip(got, sizes))]}
    # As the star's rank 0 does: check each message's pieces, then give its buffer back.
    buffers, equal = ReceiveBuffers(limit), [None] * len(sizes)
    for batch, views, buf in recv_batches(sizes, 1, None, buffers):
        for i, v in zip(batch, views):
            equal[i] = bytes(v) == _piece(i, sizes[i])
        if buf is not None:
            buffers.give(buf)
    return {"equal": equal, "peak": buffers.peak}


@pytest.mark.timeout(120)
def test_pieces_sent_large_alone_and_small_together_arrive_whole_and_in_place(tmp_path):
    assert run_ranks(2, exchange, SIZES, None, tmp=tmp_path)[0]["equal"] == [True] * len(SIZES)


@pytest.mark.timeout(120)
def test_a_receiver_with_reused_buffers_gets_every_byte_and_holds_no_more_than_its_largest_message(tmp_path):
    sizes = [3 * BATCH_BYTES, BATCH_BYTES, 2 * BATCH_BYTES, 3 * BATCH_BYTES] + [BATCH_BYTES // 4] * 8
    result = run_ranks(2, exchange, sizes, BATCH_BYTES, tmp=tmp_path)[0]
    assert result["equal"] == [True] * len(sizes)
    assert result["peak"] == 3 * BATCH_BYTES  # one message over the limit at a time, buffers reused


def test_take_waits_for_a_buffer_given_back_and_reuses_it():
    buffers = ReceiveBuffers(limit=100)
    first = buffers.take(80)
    got = []
    waiter = threading.Thread(target=lambda: got.append(buffers.take(60)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # 80 + 60 would pass the limit: it waits
    first[:] = 7
    buffers.give(first)
    waiter.join(5)
    assert not waiter.is_alive()
    assert got[0].numel() == 60 and got[0].data_ptr() == first.data_ptr() and buffers.held == 80


def test_take_picks_the_smallest_free_buffer_that_fits_among_several_of_other_sizes():
    buffers = ReceiveBuffers(limit=1000)
    big, small, middle = buffers.take(300), buffers.take(100), buffers.take(200)
    for buf in (big, small, middle):
        buffers.give(buf)
    got = buffers.take(150)  # fits the middle one, which is neither first nor last in the free list
    assert got.numel() == 150 and got.data_ptr() == middle.data_ptr() and buffers.held == 600
    assert buffers.take(250).data_ptr() == big.data_ptr()
    assert buffers.take(50).data_ptr() == small.data_ptr()
