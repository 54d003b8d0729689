"""alpha-ckpt's streams and exit codes: stdout holds the answer only; a usage error is one line on stderr and
exit 2 (no command started, no event), a refusal one line on stderr and exit 3."""
import json

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.errors import StoreUsageError
from alpha_ckpt.upkeep.gc import plan_gc
from alpha_ckpt.store import Store
from cli_in_process import alpha_ckpt_cli

ROOT_A = "a" * 64


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "s"
    for update in (1, 2, 3):
        alpha_ckpt.save({"w": torch.full((4,), float(update))}, store=path, run="r", step="s", update=update,
                        cursor=0, epoch=0)
    return path


def _one_usage_line(result) -> bool:
    return (result.returncode == 2 and result.stdout == "" and len(result.stderr.splitlines()) == 1
            and "Traceback" not in result.stderr)


@pytest.mark.parametrize("names", [["--run", "../x", "--step", "s"], ["--run", "r", "--step", ""],
                                   ["--run", "", "--step", "s"], ["--run", "r", "--step", "a/b"]],
                         ids=["run-dotdot", "step-empty", "run-empty", "step-slash"])
def test_latest_with_a_name_that_cannot_be_a_run_or_step_is_a_usage_error_on_stderr(store, names):
    result = alpha_ckpt_cli("latest", "--store", store, *names)
    assert _one_usage_line(result), result


def test_list_with_a_name_that_cannot_be_a_run_is_a_usage_error_on_stderr(store):
    result = alpha_ckpt_cli("list", "--store", store, "--run", "../x")
    assert _one_usage_line(result), result


def test_latest_prints_the_root_alone_on_stdout_and_no_generation_is_exit_3_on_stderr(store):
    found = alpha_ckpt_cli("latest", "--store", store, "--run", "r", "--step", "s")
    assert found.returncode == 0 and found.stdout.strip() == alpha_ckpt.latest(store, "r", "s")
    none = alpha_ckpt_cli("latest", "--store", store, "--run", "r", "--step", "other")
    assert (none.returncode, none.stdout) == (3, "") and len(none.stderr.splitlines()) == 1, none


def test_unpin_of_a_root_that_is_not_pinned_exits_3_with_its_line_on_stderr(store):
    result = alpha_ckpt_cli("unpin", "--store", store, ROOT_A)
    assert (result.returncode, result.stdout) == (3, "") and ROOT_A in result.stderr, result
    as_json = alpha_ckpt_cli("unpin", "--store", store, ROOT_A, "--json")  # --json: the answer on stdout
    assert as_json.returncode == 3 and json.loads(as_json.stdout)["unpinned"] is False


def test_a_refused_pin_is_one_line_on_stderr(store):
    result = alpha_ckpt_cli("pin", "--store", store, ROOT_A)
    assert (result.returncode, result.stdout) == (3, "") and len(result.stderr.splitlines()) == 1, result


@pytest.mark.parametrize("grace", ["nan", "inf", "-inf", "-1", "x"])
def test_gc_grace_that_is_not_a_finite_non_negative_number_is_a_usage_error(store, grace):
    result = alpha_ckpt_cli("gc", "--store", store, "--grace", grace)
    assert _one_usage_line(result), result


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1.0])
def test_plan_gc_refuses_a_grace_that_is_not_a_finite_non_negative_number(store, grace):
    with Store(store) as s, pytest.raises(StoreUsageError):
        plan_gc(s, grace=grace)


@pytest.mark.parametrize("keep", ["1", "0", "-3", "two"])
def test_gc_keep_below_two_is_one_usage_line_and_no_event(store, keep):
    result = alpha_ckpt_cli("gc", "--store", store, "--keep", keep)
    assert _one_usage_line(result), result  # the command never started: no gc event either
    assert alpha_ckpt_cli("list", "--store", store, "--json").stdout.count('"root"') == 3  # nothing removed


def test_a_bad_root_is_one_usage_line(store):
    assert _one_usage_line(alpha_ckpt_cli("verify", "--store", store, "abc"))
    assert _one_usage_line(alpha_ckpt_cli("bogus", "--store", store))
