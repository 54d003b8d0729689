"""alpha-ckpt verify/list/inspect: every flipped byte, deleted shard and truncation is caught."""
import io
import json
import os
import subprocess
import sys

import pytest

from alpha_ckpt.launch import cli
from alpha_ckpt.store import Store


def _verify(store_dir, root, *extra):
    out = io.StringIO()
    rc = cli.main(["verify", "--store", str(store_dir), root, *extra], out=out)
    return rc, out.getvalue()


def _objects(store_dir):
    with Store(store_dir) as s:
        return {d: s.object_path(d) for d in s.iter_objects()}


def test_intact_store_verifies_with_exit_0(saved):
    store_dir, root, _ = saved
    rc, text = _verify(store_dir, root)
    assert rc == 0 and text.startswith("valid ")


@pytest.mark.full  # CI flips bytes of every object kind through gates/store_integrity
def test_every_single_byte_flip_in_every_object_is_corrupt_shard(saved):
    store_dir, root, _ = saved
    objects = _objects(store_dir)
    assert len(objects) >= 4
    checked = 0
    for digest, path in objects.items():
        original = open(path, "rb").read()
        for i in range(len(original)):
            flipped = bytearray(original)
            flipped[i] ^= 0x20
            with open(path, "wb") as f:
                f.write(flipped)
            rc, text = _verify(store_dir, root, "--json")
            result = json.loads(text)
            assert (rc, result["code"]) == (3, "corrupt-shard"), (digest[:8], i, result)
            checked += 1
        with open(path, "wb") as f:
            f.write(original)
    assert _verify(store_dir, root)[0] == 0
    assert checked == sum(os.path.getsize(p) for p in objects.values())


def test_deleting_any_shard_is_missing_shard(saved):
    store_dir, root, _ = saved
    for digest, path in _objects(store_dir).items():
        if digest == root:
            continue
        data = open(path, "rb").read()
        os.unlink(path)
        rc, text = _verify(store_dir, root, "--json")
        assert (rc, json.loads(text)["code"]) == (3, "missing-shard"), digest
        with open(path, "wb") as f:
            f.write(data)


def test_truncating_any_object_is_format(saved):
    store_dir, root, _ = saved
    for digest, path in _objects(store_dir).items():
        data = open(path, "rb").read()
        for length in sorted({0, 7, 19, 20, 64, len(data) // 2, len(data) - 1}):
            with open(path, "wb") as f:
                f.write(data[:length])
            rc, text = _verify(store_dir, root, "--json")
            assert (rc, json.loads(text)["code"]) == (3, "format"), (digest[:8], length)
        with open(path, "wb") as f:
            f.write(data)


def test_a_flipped_ref_makes_list_report_it_unreadable(saved):
    store_dir, root, _ = saved
    ref = store_dir / "refs" / "nightly" / "fit" / "0000000001"
    data = bytearray(ref.read_bytes())
    data[10] ^= 0x01
    ref.write_bytes(bytes(data))
    out = io.StringIO()
    assert cli.main(["list", "--store", str(store_dir), "--json"], out=out) == 0
    listing = json.loads(out.getvalue())
    assert listing["generations"] == []
    assert listing["unreadable_refs"][0]["code"] == "corrupt-shard"


def test_symlinked_object_is_refused_as_format(saved, tmp_path):
    store_dir, root, _ = saved
    objects = _objects(store_dir)
    shard, path = next((d, p) for d, p in objects.items() if d != root)
    outside = tmp_path / "outside"
    os.rename(path, outside)
    os.symlink(outside, path)
    rc, text = _verify(store_dir, root, "--json")
    assert (rc, json.loads(text)["code"]) == (3, "format")


def test_fifo_in_place_of_an_object_is_refused_without_blocking(saved):
    store_dir, root, _ = saved
    shard, path = next((d, p) for d, p in _objects(store_dir).items() if d != root)
    os.unlink(path)
    os.mkfifo(path)
    rc, text = _verify(store_dir, root, "--json")
    assert (rc, json.loads(text)["code"]) == (3, "format")


def test_list_and_inspect_json_describe_the_generation(saved):
    store_dir, root, state = saved
    out = io.StringIO()
    assert cli.main(["list", "--store", str(store_dir), "--run", "nightly", "--step", "fit", "--json"], out=out) == 0
    (gen,) = json.loads(out.getvalue())["generations"]
    assert (gen["root"], gen["update"], gen["cursor"], gen["epoch"], gen["owners"]) == (root, 3, 96, 0, 1)
    assert gen["bytes"] == sum(os.path.getsize(p) for p in _objects(store_dir).values())
    out = io.StringIO()
    assert cli.main(["inspect", "--store", str(store_dir), root, "--json"], out=out) == 0
    info = json.loads(out.getvalue())
    assert [r["name"] for r in info["regions"]] == ["model.w", "model.b", "optim.step", "optim.m", "mask", "empty"]
    words = {}
    for shard in info["shards"]:
        for s in shard["slices"]:
            words[s["region"]] = words.get(s["region"], 0) + s["hi"] - s["lo"]
    assert words == {r["name"]: r["words"] for r in info["regions"]}


def test_json_outputs_name_the_generation_root_and_nothing_else(saved, tmp_path):
    store_dir, root, _ = saved
    rc, text = _verify(store_dir, root, "--json")
    assert rc == 0 and json.loads(text) == {"root": root, "valid": True}
    out = io.StringIO()
    assert cli.main(["list", "--store", str(store_dir), "--json"], out=out) == 0
    (gen,) = json.loads(out.getvalue())["generations"]
    assert gen["root"] == root and "digest" not in gen
    out = io.StringIO()
    assert cli.main(["export", "--store", str(store_dir), root, "--to", str(tmp_path / "x.safetensors"), "--json"],
                    out=out) == 0
    exported = json.loads(out.getvalue())
    assert exported["root"] == root
    shard = next(d for d in _objects(store_dir) if d != root)
    os.unlink(_objects(store_dir)[shard])
    rc, text = _verify(store_dir, root, "--json")
    result = json.loads(text)
    assert rc == 3 and result["root"] == root and result["code"] == "missing-shard"


def test_usage_errors_exit_2(saved):
    store_dir, _, _ = saved
    assert cli.main(["verify", "--store", str(store_dir), "abc"], out=io.StringIO()) == 2
    assert cli.main(["verify", "--store", str(store_dir / "nope"), "ab" * 32], out=io.StringIO()) == 2


@pytest.mark.timeout(120)
def test_console_script_exit_codes(saved):
    store_dir, root, _ = saved
    run = lambda *a: subprocess.run([sys.executable, "-m", "alpha_ckpt.launch.cli", *a], capture_output=True, text=True, timeout=60)
    ok = run("verify", "--store", str(store_dir), root)
    assert ok.returncode == 0, ok.stderr
    shard, path = next((d, p) for d, p in _objects(store_dir).items() if d != root)
    os.unlink(path)
    bad = run("verify", "--store", str(store_dir), root)
    assert bad.returncode == 3 and "missing-shard" in bad.stderr and bad.stdout == ""


def test_latest_skips_a_damaged_newer_generation_and_names_it(store_dir):
    import torch
    import alpha_ckpt
    good = alpha_ckpt.save({"a": torch.ones(8)}, store=store_dir, run="r", step="fit", update=1, cursor=8, epoch=0)
    bad = alpha_ckpt.save({"a": torch.full((8,), 2.0)}, store=store_dir, run="r", step="fit", update=2, cursor=16, epoch=0)
    assert alpha_ckpt.latest(store_dir, "r", "fit") == bad
    with Store(store_dir) as s:
        shard = next(d for d in s.iter_objects() if d not in (good, bad) and _shard_of(s, bad, d))
        path = s.object_path(shard)
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(data)
    assert alpha_ckpt.latest(store_dir, "r", "fit") == good
    out = io.StringIO()
    assert cli.main(["latest", "--store", str(store_dir), "--run", "r", "--step", "fit", "--json"], out=out) == 0
    result = json.loads(out.getvalue())
    assert result["latest"]["root"] == good and result["latest"]["update"] == 1
    assert result["skipped"] == [{"root": bad, "code": "corrupt-shard",
                                  "message": result["skipped"][0]["message"]}]
    assert cli.main(["latest", "--store", str(store_dir), "--run", "none", "--step", "fit"], out=io.StringIO()) == 3


def _shard_of(store, root, digest):
    from alpha_ckpt.generation.reader import open_generation
    with open_generation(store, root) as g:
        return digest in g.shards
