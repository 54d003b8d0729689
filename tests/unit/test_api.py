"""The one-process save/load API: bit-exact round trips, refusals that touch nothing."""
import os

import pytest
import torch

import alpha_ckpt
from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.store import Store

from conftest import assert_bit_equal, save_forged, small_state, zeros_like_state

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool]


def _example(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("compression", ["raw", "zstd"])
def test_every_dtype_round_trips_bit_exactly_including_0dim_and_empty(store_dir, dtype, compression):
    state = {"matrix": _example(dtype, (17, 3)), "scalar": _example(dtype, ()), "empty": _example(dtype, (0, 5))}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0, compression=compression)
    out = zeros_like_state(state)
    alpha_ckpt.restore(out, store=store_dir, root=root)
    assert_bit_equal(state, out)


def test_non_contiguous_sources_and_destinations_round_trip(store_dir):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {"strided": base[:, ::3], "transposed": base.t(), "offset": base[2:4, 5:]}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    dest_base = torch.zeros(6, 10)
    out = {"strided": torch.zeros(6, 8)[:, ::2], "transposed": dest_base.t(), "offset": torch.zeros(5, 6)[1:3, 1:]}
    alpha_ckpt.restore(out, store=store_dir, root=root)
    for k in state:
        assert torch.equal(state[k], out[k]), k
    assert torch.equal(dest_base, base)  # the transposed view wrote through to its base


def test_nested_state_many_shards_counters_and_metadata_come_back(saved):
    store_dir, root, state = saved
    out = zeros_like_state(state)
    counters = alpha_ckpt.restore(out, store=store_dir, root=root)
    assert_bit_equal(state, out)
    assert (counters.run, counters.step, counters.update, counters.cursor, counters.epoch) == ("nightly", "fit", 3, 96, 0)
    with Store(store_dir) as s:
        assert len(list(s.iter_objects())) > 3  # max_shard_bytes=128 forced several shards


def test_nan_in_saved_state_is_refused_and_destination_untouched(store_dir):
    state = {"a": torch.ones(4), "b": torch.tensor([1.0, float("nan"), 2.0])}
    root = save_forged(state, store_dir)
    out = {"a": torch.full((4,), 7.0), "b": torch.full((3,), 7.0)}
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore(out, store=store_dir, root=root)
    assert info.value.code == RefusalCode.NON_FINITE and "word 1" in info.value.message
    assert torch.equal(out["a"], torch.full((4,), 7.0)) and torch.equal(out["b"], torch.full((3,), 7.0))


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_infinite_values_are_refused(store_dir, value):
    root = save_forged({"a": torch.tensor([0.0, value], dtype=torch.bfloat16)}, store_dir)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.verify(store_dir, root)
    assert info.value.code == RefusalCode.NON_FINITE


def test_corrupt_shard_refusal_leaves_destination_and_store_unmodified(saved):
    store_dir, root, state = saved
    with Store(store_dir) as s:
        shard = next(d for d in s.iter_objects() if d != root)
        path = s.object_path(shard)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)
    before = {p: open(p, "rb").read() for p in _files(store_dir)}
    out = zeros_like_state(state)
    sentinel = zeros_like_state(state)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore(out, store=store_dir, root=root)
    assert info.value.code == RefusalCode.CORRUPT_SHARD
    assert_bit_equal(out, sentinel)
    assert {p: open(p, "rb").read() for p in _files(store_dir)} == before


def _files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def test_destination_with_other_regions_is_refused_as_coverage(saved):
    store_dir, root, state = saved
    out = zeros_like_state(state)
    out["extra"] = torch.zeros(2)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore(out, store=store_dir, root=root)
    assert info.value.code == RefusalCode.COVERAGE and "extra" in info.value.message


def test_destination_with_another_dtype_is_a_contract_mismatch(saved):
    store_dir, root, state = saved
    out = zeros_like_state(state)
    out["model"]["w"] = out["model"]["w"].double()
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore(out, store=store_dir, root=root)
    assert info.value.code == RefusalCode.CONTRACT_MISMATCH


def test_republishing_identical_state_writes_no_new_shard_bytes(store_dir):
    state = small_state()
    kwargs = dict(store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    first = alpha_ckpt.save(state, **kwargs)
    with Store(store_dir) as s:
        objects = set(s.iter_objects())
    second = alpha_ckpt.save(state, **kwargs)
    assert first == second
    with Store(store_dir) as s:
        assert set(s.iter_objects()) == objects
        assert [r.generation for r in s.list_refs("r", "s")] == [1]  # the newest already is this state


def test_bad_run_names_are_refused_before_writing(store_dir):
    for bad in ["..", "a/b", "", ".hidden", "x\x00y"]:
        with pytest.raises(Refusal) as info:
            alpha_ckpt.save({"a": torch.ones(1)}, store=store_dir, run=bad, step="s", update=0, cursor=0, epoch=0)
        assert info.value.code == RefusalCode.FORMAT
    with Store(store_dir) as s:
        assert list(s.iter_objects()) == []


def test_loading_from_a_relocated_store_works(saved, tmp_path):
    store_dir, root, state = saved
    moved = tmp_path / "moved"
    os.rename(store_dir, moved)
    out = zeros_like_state(state)
    alpha_ckpt.restore(out, store=moved, root=root)
    assert_bit_equal(state, out)


def test_loading_a_shard_digest_as_a_root_is_a_format_refusal(saved):
    store_dir, root, _ = saved
    with Store(store_dir) as s:
        shard = next(d for d in s.iter_objects() if d != root)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.verify(store_dir, shard)
    assert info.value.code == RefusalCode.FORMAT


def test_unknown_digest_is_missing(saved):
    store_dir, _, _ = saved
    with pytest.raises(Refusal) as info:
        alpha_ckpt.verify(store_dir, "ab" * 32)
    assert info.value.code == RefusalCode.MISSING_SHARD


@pytest.mark.parametrize("compression", ["lz4", {"model.w": "gzip"}, {"no.such.region": "zstd"}])
def test_a_bad_compression_request_is_refused_before_anything_is_written(store_dir, compression):
    with pytest.raises(ValueError):
        alpha_ckpt.save(small_state(), store=store_dir, run="r", step="s", update=0, cursor=0, epoch=0,
                        compression=compression)
    with Store(store_dir) as s:
        assert list(s.iter_objects()) == [] and s.list_refs("r", "s") == []


def test_auto_compression_picks_zstd_only_where_it_pays(store_dir):
    state = {"zeros": torch.zeros(1 << 16), "noise": torch.randn(1 << 16)}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=0, cursor=0, epoch=0, compression="auto")
    import io, json
    from alpha_ckpt.launch import cli
    out = io.StringIO()
    cli.main(["inspect", "--store", str(store_dir), root, "--json"], out=out)
    codecs = {s["region"]: s["codec"] for shard in json.loads(out.getvalue())["shards"] for s in shard["slices"]}
    assert codecs == {"zeros": "zstd", "noise": "raw"}
    back = zeros_like_state(state)
    alpha_ckpt.restore(back, store=store_dir, root=root)
    assert_bit_equal(state, back)


@pytest.mark.parametrize("compression", ["raw", "zstd"])
def test_non_finite_word_is_located_across_read_chunks(store_dir, compression):
    # 20 MiB: more than one 16 MiB read-ahead chunk, read by two streams.
    big = torch.zeros(5 << 20)
    big[4_500_000] = float("inf")
    root = save_forged({"big": big}, store_dir, update=0, compression=compression)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.verify(store_dir, root)
    assert info.value.code == RefusalCode.NON_FINITE and "word 4500000 is inf" in info.value.message


def test_a_multi_chunk_slice_round_trips_when_chunks_arrive_out_of_order(store_dir):
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(11 << 20, generator=g), "small": torch.randn(10, generator=g)}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=0, cursor=0, epoch=0)
    back = zeros_like_state(state)
    alpha_ckpt.restore(back, store=store_dir, root=root)
    assert_bit_equal(state, back)


def test_damage_that_reads_as_nan_is_reported_as_corrupt_not_non_finite(store_dir):
    root = alpha_ckpt.save({"a": torch.ones(64)}, store=store_dir, run="r", step="s", update=0, cursor=0, epoch=0)
    with Store(store_dir) as s:
        shard = next(d for d in s.iter_objects() if d != root)
        path = s.object_path(shard)
    data = bytearray(open(path, "rb").read())
    data[-4:] = bytes.fromhex("0000c07f")  # the last word now reads as NaN
    open(path, "wb").write(data)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.verify(store_dir, root)
    assert info.value.code == RefusalCode.CORRUPT_SHARD


def test_auto_compression_weighs_the_compression_rate_against_the_disk_rate():
    from alpha_ckpt.generation.writer import choose_codec
    bf16 = memoryview(torch.randn(1 << 20).to(torch.bfloat16).view(torch.uint8).numpy())
    floats = memoryview(torch.randn(1 << 19).view(torch.uint8).numpy())
    zeros = memoryview(bytes(1 << 20))
    assert choose_codec(floats, "auto", 1e9) == "raw"          # barely compressible: never pays
    assert choose_codec(bf16, "auto", 1e9) == "raw"            # shrinks ~20 %, but zstd is slower than the disk
    assert choose_codec(bf16, "auto", 20e6) == "zstd"          # a 20 MB/s network file system: it pays
    assert choose_codec(zeros, "auto", 1e9) == "zstd"


def test_zstd_pays_only_when_compressing_beats_writing_the_saved_bytes():
    from alpha_ckpt.generation.writer import zstd_pays
    assert zstd_pays(0.01, 5e9, 1e9)            # zeros: tiny output, fast codec
    assert not zstd_pays(0.8, 0.7e9, 1e9)       # float data on a local disk: c < d / (1 - r) = 5e9
    assert zstd_pays(0.8, 0.7e9, 20e6)          # the same data on a 20 MB/s network file system
    assert not zstd_pays(1.0, 1e12, 1e6)        # incompressible never pays, however fast
    assert not zstd_pays(1.02, 1e12, 1e6)


def test_a_nan_in_the_last_of_several_shards_refuses_the_save_and_commits_none_of_them(store_dir):
    # The shards of one save are committed together: the refusal found while hashing the last one
    # leaves no object of the earlier ones behind, and no temporary file.
    state = {"a": torch.ones(64), "b": torch.ones(64), "c": torch.tensor([1.0, 2.0, float("nan")] * 20)}
    with pytest.raises(Refusal) as info:
        alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=1, epoch=0, max_shard_bytes=256)
    assert info.value.code == RefusalCode.NON_FINITE
    with Store(store_dir) as s:
        assert list(s.iter_objects()) == [] and s.list_refs("r", "s") == []
    assert os.listdir(os.path.join(store_dir, "tmp")) == []


def test_a_generation_is_named_root_and_restored_by_restore_and_the_old_spellings_are_gone(store_dir):
    state = {"w": torch.arange(4.0)}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    out = {"w": torch.zeros(4)}
    assert alpha_ckpt.restore(out, store=store_dir, root=root).update == 1
    assert torch.equal(out["w"], state["w"])
    alpha_ckpt.verify(store_dir, root=root)
    alpha_ckpt.verify(store_dir, root)
    assert not hasattr(alpha_ckpt, "load")
    with pytest.raises(TypeError):
        alpha_ckpt.verify(store_dir, digest=root)
    with pytest.raises(TypeError):
        alpha_ckpt.restore(out, store=store_dir, digest=root)


def test_save_async_results_carry_the_root_save_returns(store_dir):
    state = {"w": torch.arange(4.0)}
    with Store(store_dir, create=True) as store:
        handle = alpha_ckpt.save_async(state, store=store, run="r", step="s", update=1, cursor=0, epoch=0)
        root = handle.result().root
        assert handle.root == root  # .root, as a Checkpointer's SaveResult has it
    assert alpha_ckpt.latest(store_dir, "r", "s") == root
