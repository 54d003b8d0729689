"""A usage error met by the alpha-run process itself, or by the built-in job it launches, is one line on stderr
and exit 2: the alpha-run process before any owner starts, the job with no restart. The same errors found
in-process, case by case: tests/unit/test_usage_errors.py."""
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "forecast.toml")


def assert_one_line_usage_error(code, err: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert "Traceback" not in err


@pytest.mark.timeout(120)
def test_the_alpha_run_process_prints_one_line_and_exits_2_without_starting_owners(tmp_path):
    for flags in (["--fanout", "0"], ["--nproc", "0"], ["--run", "a/b"], ["--checkpoint-every", "x"]):
        proc = launch.python_m("alpha_ckpt.launch.launcher", "--nproc", "2", "--store", tmp_path / "store", *flags,
                               "-m", "alpha_ckpt.job", CONFIG, "--updates", "3", timeout=60)
        assert_one_line_usage_error(proc.returncode, proc.stderr)
        assert proc.stdout == ""


@pytest.mark.timeout(180)
def test_a_job_usage_error_under_alpha_run_exits_2_with_one_line_and_no_restart(tmp_path):
    for flags in (["--set", "bogus=1"], ["--updates", "0"]):
        proc = launch.alpha_run("--nproc", "2", "--max-restarts", "2", "--store", tmp_path / "store", "-m",
                                "alpha_ckpt.job", CONFIG, "--updates", "3", *flags, timeout=150)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("alpha-run:")]
        assert len(lines) == 1 and "restart" not in lines[0], proc.stderr[-2000:]
