"""Usage errors exit 2 with one line, before any rank starts where alpha-run can see them; a script's
arguments after its path are the script's; a source tensor we cannot store is a Refusal naming it."""
import json
import socket

import pytest
import torch

import alpha_ckpt
from alpha_ckpt import RefusalCode
from alpha_ckpt.format.records import NAME_RE
from alpha_ckpt.launch import launcher
from alpha_ckpt.launch.launcher import check_script_args, parse, script_argv, script_environment
from alpha_ckpt.testing import launch

HELLO = "print('the script ran')\n"
# A script whose Checkpointer gets an argument that cannot be (argv[1] picks which).
BAD_CHECKPOINTER = """
import sys
from alpha_ckpt import Checkpointer
arguments = {"keep": {"keep": 1}, "publisher": {"publisher": "x"}, "every": {"every": 0}}[sys.argv[1]]
Checkpointer(sys.argv[2], run="r", **arguments)
"""


def alpha_run(*args, cwd, timeout=120):
    return launch.alpha_run(*args, cwd=cwd, timeout=timeout)


def _one_line(stderr: str) -> bool:
    return len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


@pytest.fixture
def hello(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    return script


@pytest.mark.timeout(60)
def test_a_run_name_that_is_a_path_exits_2_before_any_rank_starts(tmp_path, hello):
    run = launch.alpha_run_checks("--nproc", 2, "--store", tmp_path / "s", "--run", "../x", hello, cwd=tmp_path)
    assert run.returncode == 2 and _one_line(run.stderr), run.stderr
    assert "the script ran" not in run.stdout


def test_a_script_named_with_a_leading_underscore_gets_a_valid_default_run(tmp_path):
    script = tmp_path / "_x.py"
    script.write_text(HELLO)
    args = parse(["--nproc", "2", str(script)])
    check_script_args(args)  # no usage error
    assert NAME_RE.match(json.loads(script_environment(args)["ALPHA_CKPT_OPTIONS"])["run"])


@pytest.mark.timeout(60)
def test_a_module_that_does_not_exist_exits_2_with_one_line(tmp_path):
    run = launch.alpha_run_checks("--nproc", 2, "--store", tmp_path / "s", "-m", "no.such.module", cwd=tmp_path)
    assert run.returncode == 2 and _one_line(run.stderr), run.stderr
    # The same under plain torchrun, where the runner itself finds it.
    direct = launch.python_m("alpha_ckpt.launch.script_runner", "-m", "no.such.module", cwd=tmp_path, timeout=60)
    assert direct.returncode == 2 and _one_line(direct.stderr), direct.stderr


@pytest.mark.timeout(60)
def test_a_master_port_that_is_taken_exits_2_with_one_line(tmp_path, hello):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = launch.alpha_run_checks("--nproc", 1, "--store", tmp_path / "s", "--master-port", port, hello,
                                      cwd=tmp_path)
    assert run.returncode == 2 and _one_line(run.stderr), run.stderr
    assert "the script ran" not in run.stdout


@pytest.mark.timeout(60)
def test_a_store_whose_pending_directory_is_a_file_is_a_usage_error_for_alpha_run_and_a_refusal_to_the_store(
        tmp_path, hello):
    store = tmp_path / "s"
    store.mkdir()
    (store / "pending").write_bytes(b"not a directory")
    run = launch.alpha_run_checks("--nproc", 1, "--store", store, hello, cwd=tmp_path)
    assert run.returncode == 2 and _one_line(run.stderr), run.stderr
    with pytest.raises(alpha_ckpt.Refusal) as refused:
        alpha_ckpt.Store(store)
    assert refused.value.code is RefusalCode.FORMAT


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argument", ["keep", "publisher", "every"])
def test_a_checkpointer_argument_that_cannot_be_exits_2_with_one_line(tmp_path, argument):
    script = tmp_path / "bad.py"
    script.write_text(BAD_CHECKPOINTER)
    run = launch.python_m("alpha_ckpt.launch.script_runner", script, argument, tmp_path / "s", cwd=tmp_path, timeout=60)
    assert run.returncode == 2 and _one_line(run.stderr), run.stderr


@pytest.mark.timeout(120)
def test_a_checkpointer_argument_error_under_alpha_run_exits_2(tmp_path):
    script = tmp_path / "bad.py"
    # Both ranks meet the bad argument at once, after a barrier.
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n"
                      + BAD_CHECKPOINTER)
    run = alpha_run("--nproc", 2, "--store", tmp_path / "s", script, "keep", tmp_path / "s", cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    # Both ranks meet it; it is told once (naming them), not once per rank.
    assert len([line for line in run.stderr.splitlines() if "keep" in line]) == 1, run.stderr[-2000:]


@pytest.mark.parametrize("script_args", [["--run", "x"], ["--run-p", "y"], ["--st", "z", "--nproc", "3"]])
def test_a_scripts_own_options_after_its_path_are_the_scripts(tmp_path, hello, script_args):
    args = parse(["--nproc", "2", "--store", str(tmp_path / "s"), str(hello), *script_args])
    assert (args.nproc, args.run, args.store, args.script_args) == (2, None, str(tmp_path / "s"), script_args)
    launched = launcher.torchrun_args(script_argv(args))
    assert launched.training_script_args == [str(hello), *script_args]
    assert (launched.nproc_per_node, launched.run_path) == ("2", False)


@pytest.mark.parametrize("make", [
    lambda: torch.eye(3).to_sparse(),
    lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
    lambda: torch.empty(4, device="meta"),
], ids=["sparse", "nested", "meta"])
def test_a_source_tensor_that_cannot_be_stored_is_a_refusal_naming_the_entry(tmp_path, make):
    with pytest.raises(alpha_ckpt.Refusal) as refused:
        alpha_ckpt.save({"model": {"odd_weight": make()}}, store=tmp_path / "s", run="r", step="s", update=1,
                        cursor=0, epoch=0)
    assert refused.value.code is RefusalCode.FORMAT and "model.odd_weight" in refused.value.message
