"""Block digests: a slice larger than 64 KiB records the BLAKE3 of each 64 KiB block of its raw bytes,
so a restore that needs only some of its words reads and verifies only the blocks that hold them."""
import json
import os

import blake3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.format.records import (BLOCK_BYTES, PREFIX_LEN, CapturePrefix, RegionDecl, block_digests, encode_head,
                               joined_digest)
from alpha_ckpt.generation.planner import Piece, WantedSlice
from alpha_ckpt.generation.reader import PreparedRestore, open_generation, validate_object_bytes, verify_generation
from alpha_ckpt.store import Store
from alpha_ckpt.generation.writer import publish_slices, word_bytes

PREFIX = CapturePrefix("blocks", "fit", 1, 1, 0)
WORDS = 1 << 18  # 1 MiB of float32: 16 blocks


def _publish(store, codec="raw"):
    regions = [RegionDecl(0, "big", "float32", (WORDS,)), RegionDecl(1, "small", "float32", (100,))]
    big, small = torch.arange(WORDS, dtype=torch.float32), torch.arange(100, dtype=torch.float32)
    views = [memoryview(word_bytes(big).numpy()), memoryview(word_bytes(small).numpy())]
    published = publish_slices(store, PREFIX, regions, [[(Piece(0, 0, WORDS, 4), views[0], codec),
                                                         (Piece(1, 0, 100, 4), views[1], "raw")]])
    return published, big, small


def _slices(store, root):
    with open_generation(store, root) as generation:
        return {s.ordinal: s for _, head in generation.shards.values() for s in head.slices}


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_large_slice_records_its_block_digests_and_its_digest_is_their_blake3(tmp_path, codec):
    with Store(str(tmp_path)) as store:
        published, big, small = _publish(store, codec)
        slices = _slices(store, published.root)
    raw = bytes(word_bytes(big).numpy())
    assert slices[0].blocks == "".join(blake3.blake3(raw[i:i + BLOCK_BYTES]).hexdigest()
                                       for i in range(0, len(raw), BLOCK_BYTES))
    assert slices[0].blake3 == blake3.blake3(slices[0].blocks.encode()).hexdigest() == block_digests(raw)[0]
    # A slice of one block or less keeps the BLAKE3 of its bytes.
    assert slices[1].blocks is None and slices[1].blake3 == blake3.blake3(bytes(word_bytes(small).numpy())).hexdigest()


def test_a_parsed_head_keeps_its_objects_name(tmp_path):
    with Store(str(tmp_path)) as store:
        published, _, _ = _publish(store)
        name = published.shards[0].digest
        data = open(store.object_path(name), "rb").read()
    assert validate_object_bytes(data, name).digest == name


def _restore_words(store, root, lo, hi):
    with open_generation(store, root) as generation:
        prepared = PreparedRestore(generation, [WantedSlice(0, lo, hi, 0)])
        target = torch.zeros((hi - lo) * 4, dtype=torch.uint8)
        read = prepared.bytes_read
        prepared.copy_into([target])
    return target.view(torch.float32), read


def test_a_restore_of_some_words_reads_and_verifies_only_the_blocks_that_hold_them(tmp_path):
    with Store(str(tmp_path)) as store:
        published, big, _ = _publish(store)
        lo, hi = 5 * BLOCK_BYTES // 4 + 7, 9 * BLOCK_BYTES // 4 - 3  # inside blocks 5..8
        words, read = _restore_words(store, published.root, lo, hi)
    assert torch.equal(words, big[lo:hi])
    assert read == 4 * BLOCK_BYTES


def test_a_damaged_block_is_refused_when_read_and_found_by_verify_when_not(tmp_path):
    with Store(str(tmp_path)) as store:
        published, big, _ = _publish(store)
        shard = published.shards[0].digest
        with open_generation(store, published.root) as generation:
            _, head = generation.shards[shard]
            at = head.head_len + head.slices[0].offset + 2 * BLOCK_BYTES + 100  # a byte of block 2
        path = store.object_path(shard)
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0x40
    os.chmod(path, 0o644)
    open(path, "wb").write(bytes(data))
    with Store(str(tmp_path), create=False) as store:
        words, _ = _restore_words(store, published.root, 6 * BLOCK_BYTES // 4, 7 * BLOCK_BYTES // 4)
        assert torch.equal(words, big[6 * BLOCK_BYTES // 4:7 * BLOCK_BYTES // 4])  # block 6 only: intact
        with pytest.raises(Refusal) as refused:
            _restore_words(store, published.root, 2 * BLOCK_BYTES // 4 + 1, 2 * BLOCK_BYTES // 4 + 2)
        assert refused.value.code == RefusalCode.CORRUPT_SHARD
        with pytest.raises(Refusal) as refused:
            verify_generation(store, published.root).close()
        assert refused.value.code == RefusalCode.CORRUPT_SHARD


def _edited(data: bytes, edit) -> tuple[bytes, str]:
    head_len = PREFIX_LEN + int.from_bytes(data[12:20], "little")
    header = json.loads(data[PREFIX_LEN:head_len].decode().rstrip())
    edit(header["slices"])
    head = encode_head(header)
    return head + data[head_len:], blake3.blake3(head).hexdigest()


def _retarget(slices, blocks):
    slices[0]["blocks"] = blocks
    slices[0]["blake3"] = blake3.blake3(blocks.encode()).hexdigest()


@pytest.mark.parametrize("edit", [
    lambda s: s[1].update(blocks="0" * 64, blake3=blake3.blake3(b"0" * 64).hexdigest()),  # on a one-block slice
    lambda s: _retarget(s, s[0]["blocks"][:-64]),                                          # one block missing
    lambda s: _retarget(s, s[0]["blocks"].upper()),                                        # not lowercase hex
    lambda s: s[0].update(blake3=blake3.blake3(b"other").hexdigest()),                     # not their BLAKE3
    lambda s: _retarget(s, "0" * 64 + s[0]["blocks"][64:]),                                 # a block's digest wrong
], ids=["small-slice", "count", "hex", "list-digest", "block-digest"])
def test_a_head_whose_block_digests_do_not_hold_is_refused(tmp_path, edit):
    with Store(str(tmp_path)) as store:
        published, _, _ = _publish(store)
        data = open(store.object_path(published.shards[0].digest), "rb").read()
    damaged, name = _edited(data, edit)
    with pytest.raises(Refusal) as refused:
        validate_object_bytes(damaged, name)
    assert refused.value.code in (RefusalCode.FORMAT, RefusalCode.CORRUPT_SHARD)


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 40), tail=st.integers(0, BLOCK_BYTES - 1), cuts=st.lists(st.integers(1, 40), max_size=4))
def test_the_digest_joined_from_parts_cut_on_block_boundaries_is_the_digest_of_the_whole(blocks, tail, cuts):
    data = os.urandom(blocks * BLOCK_BYTES + tail)
    edges = sorted({c * BLOCK_BYTES for c in cuts if c * BLOCK_BYTES < len(data)} | {0}) + [len(data)]
    parts = [block_digests(data[a:b]) for a, b in zip(edges, edges[1:])]
    assert joined_digest(parts) == block_digests(data)[0]
