"""A store path that is a file (or lies under one) is bad usage: a UsageError from the Store, the same one on
every rank of a Checkpointer (whose next Checkpointer then works), and exit 2 with one line from every
command."""
import argparse
import os
import time

import pytest
import torch

from alpha_ckpt import Checkpointer, UsageError
from alpha_ckpt.store import Store
from cli_in_process import alpha_ckpt_cli
from ranks import run_ranks

PG_TIMEOUT_S = 20  # a rank left waiting in a collective would fail only after this


def not_a_directory(tmp_path, kind: str) -> str:
    """A path where a store cannot be: a regular file, a FIFO, a symlink to a file, or a path under a file."""
    file = tmp_path / "a-file"
    file.write_bytes(b"not a store")
    if kind == "file":
        return str(file)
    if kind == "under-a-file":
        return str(file / "store")
    if kind == "fifo":
        os.mkfifo(tmp_path / "a-fifo")
        return str(tmp_path / "a-fifo")
    os.symlink(file, tmp_path / "a-link")
    return str(tmp_path / "a-link")


KINDS = ["file", "under-a-file", "fifo", "symlink-to-a-file"]


@pytest.mark.parametrize("create", [True, False], ids=["create", "open"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_store_path_that_is_not_a_directory_is_a_usage_error(tmp_path, kind, create):
    path = not_a_directory(tmp_path, kind)
    with pytest.raises(UsageError):
        Store(path, create=create)
    assert os.path.isfile(tmp_path / "a-file")  # left as it was


def checkpointers_on_a_file_then_on_a_store(rank, world, not_stores, store):
    refusals = []
    for path in not_stores:
        started = time.monotonic()
        try:
            Checkpointer(path, run="r")
            refusals.append(None)
        except UsageError as exc:
            refusals.append([str(exc), time.monotonic() - started < PG_TIMEOUT_S / 4])
    ckpt = Checkpointer(store, run="r")  # the next one starts in step on every rank
    root = ckpt.save({"w": torch.arange(6.0)}, update=1).root
    ckpt.close()
    return {"refusals": refusals, "root": root}


@pytest.mark.timeout(120)
def test_a_checkpointer_on_a_file_is_the_same_usage_error_on_every_rank_and_the_next_one_works(tmp_path):
    not_stores = [not_a_directory(tmp_path, "file"), str(tmp_path / "a-file" / "store")]
    results = run_ranks(2, checkpointers_on_a_file_then_on_a_store, not_stores, str(tmp_path / "s"), tmp=tmp_path,
                        pg_timeout=PG_TIMEOUT_S)
    for i in range(len(not_stores)):
        refused = [r["refusals"][i] for r in results]
        assert all(r is not None for r in refused), refused
        assert refused[0][0] == refused[1][0]  # the same error on every rank
        assert all(prompt for _, prompt in refused), refused  # at once, not after the group's timeout
    assert results[0]["root"] == results[1]["root"] and len(results[0]["root"]) == 64


ROOT = "ab" * 32
SUBCOMMAND_ARGS = {
    "list": [], "latest": ["--run", "r", "--step", "s"], "inspect": [ROOT], "verify": [ROOT],
    "export": [ROOT, "--to", "OUT"], "gc": [], "pin": [ROOT], "unpin": [ROOT], "pins": [],
}


def alpha_ckpt_subcommands() -> set:
    from alpha_ckpt.launch import cli
    return {name for action in cli._parser()._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
@pytest.mark.parametrize("command", sorted(SUBCOMMAND_ARGS))
def test_every_alpha_ckpt_subcommand_given_a_store_that_is_a_file_exits_2_with_one_line(tmp_path, command, kind):
    assert set(SUBCOMMAND_ARGS) == alpha_ckpt_subcommands()  # every subcommand is tried
    args = [str(tmp_path / "out.safetensors") if a == "OUT" else a for a in SUBCOMMAND_ARGS[command]]
    store = not_a_directory(tmp_path, kind)
    for json_flag in ([], ["--json"]):
        proc = alpha_ckpt_cli(command, "--store", store, *json_flag, *args)
        assert proc.returncode == 2, proc
        assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_alpha_run_and_an_owner_given_a_store_that_is_a_file_exit_2_with_one_line(tmp_path, kind, capfd,
                                                                                   monkeypatch):
    import torch.distributed
    import torch.distributed.run
    from alpha_ckpt.launch import launcher
    from alpha_ckpt.job import owner

    def started(*args, **kwargs):
        raise AssertionError("an owner was started (or alpha-run handed the job to torch)")

    monkeypatch.setattr(torch.distributed.run, "run", started)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "forecast.toml")
    store = not_a_directory(tmp_path, kind)
    for main, argv in ((launcher.main, ["--nproc", "2", "--store", store, "-m", "alpha_ckpt.job", config, "--updates", "3"]),
                       (owner.main, [config, "--store", store, "--updates", "3"])):
        code = main(argv)
        err = capfd.readouterr().err
        assert code == 2, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
