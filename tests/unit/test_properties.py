"""Property tests: any two partitions round-trip; hostile bytes only ever raise a Refusal."""
import json
import tracemalloc

import blake3
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alpha_ckpt import Refusal
from alpha_ckpt.format.records import DTYPES, PREFIX_LEN, CapturePrefix, RegionDecl, encode_head
from alpha_ckpt.state.manifest import torch_dtype
from alpha_ckpt.generation.planner import Piece, WantedSlice
from alpha_ckpt.generation.reader import open_generation, restore_slices, validate_object_bytes
from alpha_ckpt.generation.writer import publish_slices, word_bytes
from alpha_ckpt.store import Store

PREFIX = CapturePrefix("prop", "fit", 1, 2, 0)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


def _cuts(draw, n: int) -> list[tuple[int, int]]:
    points = sorted(set(draw(st.lists(st.integers(0, n), max_size=4))) | {0, n})
    return [(a, b) for a, b in zip(points, points[1:])] or [(0, 0)]


@st.composite
def two_partitions(draw):
    regions, tensors = [], []
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        n = draw(st.integers(0, 40) | st.integers(9_000, 40_000))  # the large ones have block digests
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        t = (torch.randn(n, generator=g) * 50).to(torch_dtype(dtype)) if DTYPES[dtype][1] or dtype == "bool" \
            else torch.randint(-100, 100, (n,), generator=g).to(torch_dtype(dtype))
        regions.append(RegionDecl(i, f"region{i}", dtype, (n,)))
        tensors.append(t)
    saved = [(r.ordinal, lo, hi) for r in regions for lo, hi in _cuts(draw, r.words)]
    saved = draw(st.permutations(saved))  # physical order differs from word order
    n_shards = draw(st.integers(1, min(3, len(saved))))
    owner = [draw(st.integers(0, n_shards - 1)) for _ in saved]
    codecs = [draw(st.sampled_from(["raw", "zstd"])) for _ in saved]
    shards = [[(s, c) for s, o, c in zip(saved, owner, codecs) if o == k] for k in range(n_shards)]
    shards = [s for s in shards if s]
    wanted = [(r.ordinal, lo, hi) for r in regions for lo, hi in _cuts(draw, r.words)]
    return regions, tensors, shards, wanted


@FAST
@given(two_partitions())
def test_any_two_partitions_round_trip_bit_exactly(tmp_path_factory, case):
    regions, tensors, shards, wanted = case
    raw = [word_bytes(t) for t in tensors]
    with Store(tmp_path_factory.mktemp("store")) as store:
        parts = []
        for shard in shards:
            parts.append([(Piece(o, lo, hi, DTYPES[regions[o].dtype][0]),
                           memoryview(raw[o].numpy())[lo * DTYPES[regions[o].dtype][0]:hi * DTYPES[regions[o].dtype][0]],
                           codec) for (o, lo, hi), codec in shard])
        root = publish_slices(store, PREFIX, regions, parts).root
        targets = [torch.full(((hi - lo) * DTYPES[regions[o].dtype][0],), 0xAB, dtype=torch.uint8) for o, lo, hi in wanted]
        with open_generation(store, root) as generation:
            restore_slices(generation, [WantedSlice(o, lo, hi, i) for i, (o, lo, hi) in enumerate(wanted)], targets)
    for (o, lo, hi), target in zip(wanted, targets):
        size = DTYPES[regions[o].dtype][0]
        assert torch.equal(target, raw[o][lo * size:hi * size]), (o, lo, hi)


def _valid_shard_bytes() -> bytes:
    """A real shard with a raw, a zstd and a raw slice with block digests, built through the writer."""
    import tempfile
    regions = [RegionDecl(0, "a", "float32", (8,)), RegionDecl(1, "b", "int16", (300,)),
               RegionDecl(2, "c", "float32", (20_000,))]  # 80 KB: two block digests
    with tempfile.TemporaryDirectory() as d, Store(d) as store:
        a, b = word_bytes(torch.arange(8.0)), word_bytes(torch.zeros(300, dtype=torch.int16))
        c = word_bytes(torch.arange(20_000.0))
        # The zstd slice last: the frame tests below replace it at the payload's end.
        published = publish_slices(store, PREFIX, regions, [[(Piece(0, 0, 8, 4), memoryview(a.numpy()), "raw"),
                                                               (Piece(2, 0, 20_000, 4), memoryview(c.numpy()), "raw"),
                                                               (Piece(1, 0, 300, 2), memoryview(b.numpy()), "zstd")]])
        return open(store.object_path(published.shards[0].digest), "rb").read()


SHARD = _valid_shard_bytes()
HEAD_LEN = PREFIX_LEN + int.from_bytes(SHARD[12:20], "little")
HEADER = json.loads(SHARD[PREFIX_LEN:HEAD_LEN].decode().rstrip())


def _validate_bounded(data: bytes, digest: str) -> None:
    """Validate, and require peak Python allocation <= file size + declared raw bytes (+ fixed slack)."""
    declared_raw = 0
    try:
        for s in json.loads(data[PREFIX_LEN:].split(b"\x00")[0].decode("ascii", "replace").rstrip()).get("slices", []):
            declared_raw += s["raw"] if isinstance(s.get("raw"), int) and s["raw"] > 0 else 0
    except Exception:
        pass
    tracemalloc.start()
    try:
        validate_object_bytes(data, digest)
    except Refusal:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= len(data) + declared_raw + (1 << 20), (peak, len(data), declared_raw)


def test_the_unmutated_shard_validates():
    validate_object_bytes(SHARD, blake3.blake3(SHARD[:HEAD_LEN]).hexdigest())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_random_bytes_only_raise_refusal(data):
    _validate_bounded(data, blake3.blake3(data).hexdigest())
    # With the prefix of a real object, the reader gets past the magic check.
    glued = SHARD[:PREFIX_LEN] + data
    _validate_bounded(glued, blake3.blake3(glued[:HEAD_LEN]).hexdigest())


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


ALL_PATHS = [p for p in _paths(HEADER) if p]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(ALL_PATHS), _JSON_VALUES | st.integers(0, 2**63 - 1), st.booleans())
def test_mutated_headers_with_valid_digests_only_raise_refusal_and_stay_bounded(path, value, delete):
    header = json.loads(json.dumps(HEADER))
    node = header
    for key in path[:-1]:
        node = node[key]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    try:
        head = encode_head(header)
    except (ValueError, TypeError):
        return
    data = head + SHARD[HEAD_LEN:]
    _validate_bounded(data, blake3.blake3(head).hexdigest())


def test_zstd_frame_claiming_more_than_the_declared_raw_length_is_refused_without_allocating():
    header = json.loads(json.dumps(HEADER))
    z = next(s for s in header["slices"] if s["codec"] == "zstd")
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 30))  # claims 1 GiB in its frame header
    payload = bytearray(SHARD[HEAD_LEN:])
    before = payload[:z["offset"]]
    z["stored"], z["stored_blake3"] = len(bomb), blake3.blake3(bomb).hexdigest()
    header["payload_bytes"] = z["offset"] + len(bomb)
    head = encode_head(header)
    data = head + bytes(before) + bomb
    tracemalloc.start()
    with pytest.raises(Refusal) as info:
        validate_object_bytes(data, blake3.blake3(head).hexdigest())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert info.value.code.value == "format" and "claims" in info.value.message
    assert peak < 16 << 20


def test_zstd_frame_without_content_size_is_refused():
    header = json.loads(json.dumps(HEADER))
    z = next(s for s in header["slices"] if s["codec"] == "zstd")
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(600))
    z["stored"], z["stored_blake3"] = len(frame), blake3.blake3(frame).hexdigest()
    header["payload_bytes"] = z["offset"] + len(frame)
    head = encode_head(header)
    with pytest.raises(Refusal) as info:
        validate_object_bytes(head + SHARD[HEAD_LEN:HEAD_LEN + z["offset"]] + frame, blake3.blake3(head).hexdigest())
    assert info.value.code.value == "format"
