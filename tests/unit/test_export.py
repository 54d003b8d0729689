"""alpha-ckpt export: the full logical state, validated first, written once as a new file."""
import io
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import alpha_ckpt
from alpha_ckpt.launch import cli
from alpha_ckpt.errors import StoreUsageError
from alpha_ckpt.upkeep.export import export_generation
from alpha_ckpt.format.records import CapturePrefix, RegionDecl
from alpha_ckpt.state.capture import flatten_state
from alpha_ckpt.generation.planner import Piece
from alpha_ckpt.testing import simulate
from alpha_ckpt.store import Store
from alpha_ckpt.runtime.faults import FaultHooks, installed
from alpha_ckpt.testing.forge import publish_forged
from conftest import small_state


def _export(store_dir, root, to, *extra):
    out = io.StringIO()
    rc = cli.main(["export", "--store", str(store_dir), root, "--to", str(to), *extra], out=out, err=io.StringIO())
    return rc, out.getvalue()


def _assert_same_tensors(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        have = got[name]
        assert (have.dtype, have.shape) == (want.dtype, want.shape), name
        assert torch.equal(have.contiguous().reshape(-1).view(torch.uint8),
                           want.contiguous().reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("compression", ["raw", "zstd"])
def test_export_round_trips_bit_for_bit_through_safetensors(store_dir, tmp_path, compression):
    state = small_state()  # float32, bfloat16, 0-dim int64, float64, bool, an empty tensor
    root = alpha_ckpt.save(state, store=store_dir, run="nightly", step="fit", update=3, cursor=96, epoch=1,
                           compression=compression, max_shard_bytes=128)  # regions split across shards
    rc, text = _export(store_dir, root, tmp_path / "state.safetensors", "--json")
    assert rc == 0, text
    result = json.loads(text)
    assert result["format"] == "safetensors" and result["bytes"] == os.path.getsize(tmp_path / "state.safetensors")
    assert [r["name"] for r in result["regions"]] == ["model.w", "model.b", "optim.step", "optim.m", "mask", "empty"]
    _assert_same_tensors(load_file(tmp_path / "state.safetensors"), dict(flatten_state(state)))
    with safe_open(tmp_path / "state.safetensors", "pt") as f:
        assert f.metadata() == {"run": "nightly", "step": "fit", "update": "3", "cursor": "96", "epoch": "1",
                                "root": root}


def test_export_round_trips_bit_for_bit_through_torch_load_weights_only(saved, tmp_path):
    store_dir, root, state = saved
    rc, text = _export(store_dir, root, tmp_path / "state.bin", "--format", "torch")
    assert rc == 0, text
    loaded = torch.load(tmp_path / "state.bin", weights_only=True)
    _assert_same_tensors(loaded, dict(flatten_state(state)))
    assert list(loaded) == [name for name, _ in flatten_state(state)]


def test_a_pt_suffix_means_torch_unless_the_format_flag_says_otherwise(saved, tmp_path):
    store_dir, root, state = saved
    assert _export(store_dir, root, tmp_path / "a.pt")[0] == 0
    assert (tmp_path / "a.pt").read_bytes()[:2] == b"PK"  # torch.save's zip container
    assert _export(store_dir, root, tmp_path / "b.pt", "--format", "safetensors")[0] == 0
    _assert_same_tensors(load_file(tmp_path / "b.pt"), dict(flatten_state(state)))


def test_a_corrupt_object_is_refused_and_no_output_file_exists(saved, tmp_path):
    store_dir, root, _ = saved
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with Store(store_dir) as s:
        paths = [s.object_path(d) for d in s.iter_objects()]
    assert len(paths) >= 4
    for path in paths:
        original = open(path, "rb").read()
        os.chmod(path, 0o644)
        flipped = bytearray(original)
        flipped[-1] ^= 0x01  # the last payload byte of a shard, the last header byte of a manifest
        open(path, "wb").write(flipped)
        rc, text = _export(store_dir, root, out_dir / "state.safetensors", "--json")
        assert (rc, json.loads(text)["code"]) == (3, "corrupt-shard"), path
        assert os.listdir(out_dir) == []  # no output and no temporary file
        open(path, "wb").write(original)
    assert _export(store_dir, root, out_dir / "state.safetensors")[0] == 0


def test_an_existing_destination_is_refused_and_left_untouched(saved, tmp_path):
    store_dir, root, _ = saved
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"keep me")
    before = os.stat(taken)
    rc, _ = _export(store_dir, root, taken)
    assert rc == 2
    assert taken.read_bytes() == b"keep me" and os.stat(taken).st_mtime_ns == before.st_mtime_ns
    dangling = tmp_path / "dangling.safetensors"
    os.symlink(tmp_path / "nowhere", dangling)
    assert _export(store_dir, root, dangling)[0] == 2
    assert not os.path.exists(tmp_path / "nowhere")  # never written through a symlink
    with pytest.raises(StoreUsageError):
        export_generation(store_dir, root, taken)
    assert _export(store_dir, root, tmp_path / "no-such-dir" / "x.safetensors")[0] == 2


@pytest.mark.parametrize("point", ["after-data-fsync", "before-rename"])
def test_a_failure_before_the_rename_leaves_no_file_in_the_destination_directory(saved, tmp_path, point):
    store_dir, root, _ = saved

    def fail(kind, at):
        if (kind, at) == ("export", point):
            raise OSError(5, "injected I/O error")
    with installed(FaultHooks(fail)):
        rc = cli.main(["export", "--store", str(store_dir), root, "--to", str(tmp_path / "x.safetensors")],
                      out=io.StringIO(), err=io.StringIO())
    assert rc == 1
    assert [p for p in os.listdir(tmp_path) if p != "store"] == []


@pytest.mark.parametrize("owners, fanout", [(4, 3), (7, 2)])
def test_a_tree_generation_exports_the_same_tensors_as_the_star_generation_of_the_same_state(tmp_path, owners, fanout):
    store = Store(tmp_path / "store")
    words = 4
    report, _ = simulate.publish(store, owners, fanout, words=words)
    assert report.root
    owned = torch.cat([simulate.owned_values(r, words) for r in range(owners)])
    star = alpha_ckpt.save({"shared": simulate.SHARED, "owned": owned}, store=store, run="star", step="fit",
                           update=1, cursor=owners, epoch=0, max_shard_bytes=64)
    tree_file, star_file = tmp_path / "tree.safetensors", tmp_path / "star.safetensors"
    tree_result = export_generation(store, report.root, tree_file)
    export_generation(store, star, star_file)
    tree_tensors, star_tensors = load_file(tree_file), load_file(star_file)
    _assert_same_tensors(tree_tensors, star_tensors)
    _assert_same_tensors(tree_tensors, {"shared": simulate.SHARED, "owned": owned})
    assert tree_result.validated_bytes == (simulate.REPLICATED_WORDS + owners * words) * 4
    store.close()


def test_two_regions_with_one_name_are_refused_rather_than_one_dropped(store_dir, tmp_path):
    regions = (RegionDecl(0, "w", "float32", (2,)), RegionDecl(1, "w", "float32", (2,)))
    a, b = torch.ones(2), torch.zeros(2)
    with Store(store_dir) as store:
        root = publish_forged(store, CapturePrefix("r", "s", 1, 1, 0), regions,
                              [[(Piece(0, 0, 2, 4), memoryview(a.numpy()).cast("B"), "raw"),
                                (Piece(1, 0, 2, 4), memoryview(b.numpy()).cast("B"), "raw")]]).root  # a publish itself refuses two regions of one name
    rc, text = _export(store_dir, root, tmp_path / "x.safetensors", "--json")
    assert (rc, json.loads(text)["code"]) == (3, "format")
    assert not (tmp_path / "x.safetensors").exists()
