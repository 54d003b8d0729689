"""A store named by a URL is never taken as a path: a file:// URL is its path, an s3:// URL an object store,
and a URL no backend serves is a usage error naming the store, before anything is created, in every door
that takes a store."""
import os

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.errors import StoreUsageError, UsageError
from alpha_ckpt.store import Store
from alpha_ckpt.store.location import canonical, local_path, scheme_of
from alpha_ckpt.testing import launch

REFUSED = ["s3://bucket/checkpoints", "S3://bucket", "gs://bucket/x", "hdfs://nn/x", "file://otherhost/x", "file://"]


@pytest.mark.parametrize("spec, path", [
    ("ckpt", "ckpt"), ("/abs/ckpt", "/abs/ckpt"), ("a:b", "a:b"), ("dir/s3:", "dir/s3:"),
    ("file:///abs/ckpt", "/abs/ckpt"), ("file://localhost/abs/ckpt", "/abs/ckpt"),
    ("file:///with%20space", "/with space"),
])
def test_a_path_or_a_file_url_names_a_directory(spec, path):
    assert local_path(spec) == path
    assert canonical(spec) == os.path.abspath(path)


def test_a_pathlike_is_a_path_whatever_its_text():
    from pathlib import Path
    assert scheme_of(Path("s3:") / "x") is None and local_path(Path("x")) == "x"


@pytest.mark.parametrize("spec", REFUSED)
def test_a_url_no_backend_serves_is_a_usage_error_naming_the_store(spec):
    with pytest.raises(StoreUsageError) as refused:
        local_path(spec)
    assert spec in str(refused.value) and isinstance(refused.value, UsageError)


@pytest.mark.parametrize("spec, normal", [("s3://ckpt/run", "s3://ckpt/run"), ("S3://ckpt//a/b/", "s3://ckpt/a/b"),
                                          ("s3://ckpt", "s3://ckpt")])
def test_an_object_store_url_is_its_own_canonical_name(spec, normal):
    assert canonical(spec) == normal


@pytest.mark.parametrize("spec", ["gs://bucket/run", "hdfs://nn/run"])
def test_no_door_turns_a_url_no_backend_serves_into_a_local_directory(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.ones(4)}
    with pytest.raises(StoreUsageError):
        Store(spec)
    with pytest.raises(StoreUsageError):
        alpha_ckpt.save(state, store=spec, run="r", step="s", update=1, cursor=0, epoch=0)
    with pytest.raises(StoreUsageError):
        alpha_ckpt.latest(spec, "r", "s")
    cli = launch.alpha_ckpt_cli("verify", "--store", spec, "0" * 64)
    assert cli.returncode == 2 and spec in cli.stderr
    (tmp_path / "train.py").write_text("print('never run')\n")
    checks = launch.alpha_run_checks("--nproc", "2", "--store", spec, "train.py", cwd=tmp_path)
    assert checks.returncode == 2 and spec in checks.stderr and checks.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == ["train.py"]  # no "s3:" or "gs:" directory, nothing else either
