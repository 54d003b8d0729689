"""The fitted model's published file: one name and the same bytes for the same model, an absolute path."""
import os
from types import SimpleNamespace

import torch
from safetensors.torch import load

from alpha_ckpt import Store
from alpha_ckpt.job.learner.config import JobConfig
from alpha_ckpt.job.learner.model import initial_params
from alpha_ckpt.job.owner import Owner


def fitted(store: Store, update: int = 7) -> SimpleNamespace:
    """What Owner.publish_output reads of an owner: its config, store and parameters."""
    config = JobConfig(hidden=8)
    return SimpleNamespace(config=config, store=store, state=SimpleNamespace(update=update,
                                                                             params=initial_params(config)))


def test_the_same_model_published_again_gets_the_same_name_and_bytes(tmp_path):
    with Store(tmp_path / "a") as a, Store(tmp_path / "b") as b:
        paths = {Owner.publish_output(fitted(a)) for _ in range(8)}
        other = Owner.publish_output(fitted(b))
    (path,) = paths
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    assert os.path.basename(other) == os.path.basename(path)
    data = open(path, "rb").read()
    assert open(other, "rb").read() == data
    loaded = load(data)
    expected = fitted(None).state.params
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    with Store(tmp_path / "a") as a:  # the name follows the content: the metadata names the update
        assert Owner.publish_output(fitted(a, update=8)) != path


def test_the_output_path_is_absolute_when_the_store_path_is_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with Store("relative-store") as s:
        path = Owner.publish_output(fitted(s))
    assert os.path.isabs(path)
    monkeypatch.chdir("/")
    assert os.path.isfile(path)
