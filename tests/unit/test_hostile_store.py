"""A hostile or damaged store: every case ends in a Refusal (or is ignored), never a crash or an escape."""
import json
import os
import time

import blake3
import pytest
import torch
import zstandard

import alpha_ckpt
from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.store import durable
from alpha_ckpt.format.records import ShardRef, encode_head
from alpha_ckpt.generation.planner import WantedSlice
from alpha_ckpt.generation.reader import open_generation, restore_slices, validate_object_bytes
from alpha_ckpt.generation.writer import write_manifest
from alpha_ckpt.store import Store
from conftest import save_forged


def test_manifest_record_naming_an_undeclared_region_is_coverage(saved):
    store_dir, root, _ = saved
    with Store(store_dir) as s:
        with open_generation(s, root) as g:
            m = g.manifest
        record = m.shards[0]
        bad = ShardRef(record.digest, record.size, ((len(m.regions) + 4, 0, 1),))
        root2, _ = write_manifest(s, m.prefix, m.regions, [bad], 1, None)
        with pytest.raises(Refusal) as info:
            open_generation(s, root2)
        assert info.value.code == RefusalCode.COVERAGE


def _zstd_shard(frame: bytes, raw: int) -> tuple[bytes, str]:
    header = {"kind": "shard", "payload_bytes": len(frame), "schema_digest": "0" * 64,
              "prefix": {"run": "r", "step": "s", "update": 0, "cursor": 0, "epoch": 0},
              "slices": [{"ordinal": 0, "dtype": "uint8", "shape": [raw], "lo": 0, "hi": raw, "offset": 0,
                          "stored": len(frame), "codec": "zstd", "raw": raw, "blake3": "0" * 64,
                          "stored_blake3": blake3.blake3(frame).hexdigest()}]}
    head = encode_head(header)
    return head + frame, blake3.blake3(head).hexdigest()


def test_zstd_frame_with_trailing_bytes_is_refused():
    frame = zstandard.ZstdCompressor().compress(bytes(1000)) + b"\x00\x00"
    data, digest = _zstd_shard(frame, 1000)
    with pytest.raises(Refusal) as info:
        validate_object_bytes(data, digest)
    assert info.value.code == RefusalCode.FORMAT and "the slice stores" in info.value.message


@pytest.mark.timeout(60)
def test_verifying_a_huge_declared_zstd_slice_allocates_only_a_chunk():
    # The frame honestly claims 2 GiB of zeros in a few hundred bytes; verify must
    # stream it through a bounded buffer (and refuse it: the raw digest is wrong).
    raw = 2 << 30
    chunks = zstandard.ZstdCompressor(level=1).compressobj(size=raw)
    zeros = bytes(16 << 20)
    frame = b"".join(chunks.compress(zeros) for _ in range(raw // len(zeros))) + chunks.flush()
    data, digest = _zstd_shard(frame, raw)
    import tracemalloc
    tracemalloc.start()
    with pytest.raises(Refusal) as info:
        validate_object_bytes(data, digest)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert info.value.code == RefusalCode.FORMAT and "BLAKE3" in info.value.message
    assert peak < len(data) + (64 << 20)


def test_ref_names_with_unicode_digits_are_ignored(saved):
    store_dir, root, _ = saved
    (store_dir / "refs" / "nightly" / "fit" / ("\u00b2" * 10)).write_text("x")
    (store_dir / "refs" / "nightly" / "fit" / ("\u0660" * 10)).write_text("x")
    with Store(store_dir) as s:
        assert [r.generation for r in s.list_refs("nightly", "fit")] == [1]
    assert alpha_ckpt.latest(store_dir, "nightly", "fit") == root


def test_a_symlinked_run_directory_is_not_followed(saved, tmp_path):
    store_dir, root, _ = saved
    outside = tmp_path / "outside"
    os.rename(store_dir / "refs" / "nightly", outside)
    os.symlink(outside, store_dir / "refs" / "nightly")
    with Store(store_dir) as s:
        assert s.runs() == []
        with pytest.raises(Refusal) as info:
            s.list_refs("nightly", "fit")
        assert info.value.code == RefusalCode.FORMAT


def test_a_store_reached_through_a_symlink_works(saved, tmp_path):
    store_dir, root, _ = saved
    link = tmp_path / "link"
    os.symlink(store_dir, link)
    alpha_ckpt.verify(link, root)


def test_an_object_truncated_while_mapped_is_refused_not_a_crash(store_dir):
    state = {"a": torch.randn(1 << 20)}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=0, cursor=0, epoch=0)
    with Store(store_dir) as s:
        with open_generation(s, root) as g:
            (digest, (obj, head)), = g.shards.items()
            os.chmod(s.object_path(digest), 0o644)
            os.truncate(s.object_path(digest), head.head_len + 100)
            target = torch.zeros(4 << 20, dtype=torch.uint8)
            with pytest.raises(Refusal) as info:
                restore_slices(g, [WantedSlice(0, 0, 1 << 20, 0)], [target])
            assert info.value.code == RefusalCode.CORRUPT_SHARD and "shrank" in info.value.message
            assert not target.any()


def test_published_objects_and_refs_are_read_only(saved):
    store_dir, root, _ = saved
    with Store(store_dir) as s:
        assert os.stat(s.object_path(root)).st_mode & 0o777 == 0o444
    assert os.stat(store_dir / "refs" / "nightly" / "fit" / "0000000001").st_mode & 0o777 == 0o444


def test_an_existing_directory_is_fsynced_again(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    os.close(durable.make_dir_durable(parent, "d"))
    os.close(parent)
    assert synced == [parent]


def test_a_refusal_in_the_first_slice_of_many_ends_the_restore(store_dir):
    state = {f"t{i}": torch.randn(1 << 18) for i in range(24)}
    state["t0"][5] = float("nan")
    root = save_forged(state, store_dir, update=0)
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore({k: torch.zeros_like(v) for k, v in state.items()}, store=store_dir, root=root)
    assert info.value.code == RefusalCode.NON_FINITE and "word 5 " in info.value.message


# ---------------------------------------------------------------- hostile entries meet the command line

from cli_in_process import alpha_ckpt_cli  # noqa: E402

DEAD_PID = 99_999_999  # above the kernel's largest pid: no process has it


def _run(argv):
    done = alpha_ckpt_cli(*argv)
    return done.returncode, done.stdout, done.stderr


def _stale_temp_file(store_dir):
    """What a killed publisher leaves: gc's normal work is to sweep it."""
    path = store_dir / "tmp" / f"{DEAD_PID}-0123456789abcdef.tmp"
    path.write_bytes(b"half a shard")
    old = time.time() - 7200
    os.utime(path, (old, old))
    return path


def _outside_object(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ("ee" * 32)).write_bytes(b"not this store's")
    os.utime(outside / ("ee" * 32), (1, 1))
    return outside


def _hostile(kind, store_dir, tmp_path):
    """Create one hostile entry; returns its path (relative to the store) and how gc lists it."""
    other = "ab" * 32
    if kind == "fifo-in-pending":
        os.mkfifo(store_dir / "pending" / f"{DEAD_PID}-feedface")
        return f"pending/{DEAD_PID}-feedface"
    if kind == "directory-in-pending":
        os.mkdir(store_dir / "pending" / f"{DEAD_PID}-feedface")
        return f"pending/{DEAD_PID}-feedface"
    if kind == "fifo-in-pins":
        (store_dir / "pins").mkdir(exist_ok=True)
        os.mkfifo(store_dir / "pins" / other)
        return f"pins/{other}"
    if kind == "directory-in-pins":
        (store_dir / "pins").mkdir(exist_ok=True)
        os.mkdir(store_dir / "pins" / other)
        return f"pins/{other}"
    if kind == "directory-in-tmp":
        os.mkdir(store_dir / "tmp" / f"{DEAD_PID}-0000000000000000.tmp")
        return f"tmp/{DEAD_PID}-0000000000000000.tmp"
    if kind == "symlink-in-tmp":
        os.symlink(_outside_object(tmp_path) / ("ee" * 32), store_dir / "tmp" / f"{DEAD_PID}-1111111111111111.tmp")
        return f"tmp/{DEAD_PID}-1111111111111111.tmp"
    if kind == "file-at-objects-zz":
        (store_dir / "objects" / "zz").write_bytes(b"not a fan")
        return "objects/zz"
    if kind == "symlink-fan":
        os.symlink(_outside_object(tmp_path), store_dir / "objects" / "ee")
        return "objects/ee"
    if kind in ("fifo-object", "directory-object", "symlink-object"):
        (store_dir / "objects" / "cd").mkdir(exist_ok=True)
        path = store_dir / "objects" / "cd" / ("cd" * 32)
        if kind == "fifo-object":
            os.mkfifo(path)
        elif kind == "directory-object":
            os.mkdir(path)
        else:
            os.symlink(_outside_object(tmp_path) / ("ee" * 32), path)
        os.utime(path, (1, 1), follow_symlinks=False)
        return f"objects/cd/{'cd' * 32}"
    raise AssertionError(kind)


HOSTILE_ENTRIES = ["fifo-in-pending", "directory-in-pending", "fifo-in-pins", "directory-in-pins", "directory-in-tmp",
                   "symlink-in-tmp", "file-at-objects-zz", "symlink-fan", "fifo-object", "directory-object",
                   "symlink-object"]


@pytest.mark.timeout(60)  # opening a FIFO in blocking mode would hang
@pytest.mark.parametrize("kind", HOSTILE_ENTRIES)
def test_gc_pins_pin_and_unpin_skip_a_hostile_entry_and_do_their_work(saved, tmp_path, kind):
    store_dir, root, _ = saved
    entry = _hostile(kind, store_dir, tmp_path)
    stray = _stale_temp_file(store_dir)
    code, out, err = _run(["gc", "--store", str(store_dir), "--grace", "0", "--json"])
    assert code == 0
    report = json.loads(out)
    assert report["tmp"] == 1 and not stray.exists()  # its normal work is done
    assert [s for s in report["skipped"] if s.startswith(entry + ":")] and entry in err
    assert os.path.lexists(store_dir / entry)  # never removed
    alpha_ckpt.verify(store_dir, root)
    code, out, _ = _run(["pins", "--store", str(store_dir), "--json"])
    assert code == 0
    pinned = json.loads(out)
    assert [p["root"] for p in pinned["unreadable_pins"]] == (["ab" * 32] if "in-pins" in kind else [])
    assert _run(["pin", "--store", str(store_dir), root])[0] == 0
    assert (store_dir / "pins" / root).is_file()
    assert _run(["unpin", "--store", str(store_dir), root])[0] == 0
    assert not (store_dir / "pins" / root).exists() and os.path.lexists(store_dir / entry)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "directory"])
def test_an_entry_under_a_pins_name_that_is_no_pin_file_is_refused_by_pin_and_unpin_and_left(saved, make):
    store_dir, root, _ = saved
    (store_dir / "pins").mkdir()
    make(store_dir / "pins" / root)
    code, out, _ = _run(["pins", "--store", str(store_dir), "--json"])
    assert code == 0 and [p["root"] for p in json.loads(out)["unreadable_pins"]] == [root]
    assert _run(["pin", "--store", str(store_dir), root])[0] == 3
    assert _run(["unpin", "--store", str(store_dir), root])[0] == 3
    assert os.path.lexists(store_dir / "pins" / root)
    with Store(store_dir) as s:  # its name still pins: gc keeps the generation
        from alpha_ckpt.upkeep.gc import plan_gc
        assert plan_gc(s, grace=0).pinned == 1


def _symlinked_refs(store_dir, tmp_path):
    os.rename(store_dir / "refs", tmp_path / "refs-elsewhere")
    os.symlink(tmp_path / "refs-elsewhere", store_dir / "refs")


def _file_at_pins(store_dir, tmp_path):
    (store_dir / "pins").write_bytes(b"not a directory")


def _fifo_at_pending(store_dir, tmp_path):
    os.rmdir(store_dir / "pending")
    os.mkfifo(store_dir / "pending")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [_symlinked_refs, _file_at_pins, _fifo_at_pending])
def test_gc_refuses_a_store_directory_that_is_a_symlink_or_a_file_and_removes_nothing(saved, tmp_path, make):
    store_dir, root, _ = saved
    stray = _stale_temp_file(store_dir)
    make(store_dir, tmp_path)
    code, out, _ = _run(["gc", "--store", str(store_dir), "--grace", "0", "--json"])
    assert code == 3 and json.loads(out)["code"] == "format"
    assert stray.exists()


@pytest.mark.parametrize("command", ["list", "inspect", "verify", "latest", "export"])
def test_read_commands_refuse_a_symlinked_refs_directory(saved, tmp_path, command):
    store_dir, root, _ = saved
    _symlinked_refs(store_dir, tmp_path)
    argv = {"list": [], "inspect": [root], "verify": [root], "latest": ["--run", "nightly", "--step", "fit"],
            "export": [root, "--to", str(tmp_path / "out.safetensors")]}[command]
    code, out, _ = _run([command, "--store", str(store_dir), *argv])
    assert code == 3 and not (tmp_path / "out.safetensors").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo-object", "directory-object", "symlink-object"])
def test_read_commands_refuse_a_generation_whose_object_is_a_hostile_entry(saved, tmp_path, kind):
    store_dir, root, _ = saved
    with Store(store_dir) as s:
        path = s.object_path(root)
    os.unlink(path)
    {"fifo-object": os.mkfifo, "directory-object": os.mkdir,
     "symlink-object": lambda p: os.symlink(_outside_object(tmp_path) / ("ee" * 32), p)}[kind](path)
    for argv in (["inspect", root], ["verify", root], ["latest", "--run", "nightly", "--step", "fit"],
                 ["export", root, "--to", str(tmp_path / "out.safetensors")]):
        assert _run([argv[0], "--store", str(store_dir), *argv[1:]])[0] == 3, argv
    code, out, _ = _run(["list", "--store", str(store_dir), "--json"])
    assert code == 0 and [g["root"] for g in json.loads(out)["generations"]] == [root]
    assert os.path.lexists(path) and not (tmp_path / "out.safetensors").exists()
