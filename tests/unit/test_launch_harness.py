"""The launch harness (alpha_ckpt/testing/launch.py): a python forked from its server runs a module, program or
script as a new interpreter would, and says how it ended as subprocess does; alpha-run's checks in the test's
process fail the test if alpha-run would have launched."""
import json
import os
import signal
import sys

import pytest

from alpha_ckpt.testing import launch

ROOT = launch.PACKAGE_PARENT
CONFIG = os.path.join(ROOT, "configs", "forecast.toml")

AS_MAIN = """
import atexit, json, multiprocessing, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
                  "start": multiprocessing.get_start_method(),
                  "tests_on_path": any(p.startswith(os.path.join(os.environ["ROOT"], "tests")) for p in sys.path),
                  "env": os.environ.get("HARNESS_PROBE")}))
print("to stderr", file=sys.stderr)
"""


@pytest.mark.timeout(120)
def test_a_forked_program_runs_as_main_with_its_arguments_folder_and_environment_as_a_new_interpreter(tmp_path):
    done = launch.python_c(AS_MAIN, "a", 1, cwd=tmp_path, env=launch.child_env(HARNESS_PROBE="x", ROOT=ROOT))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[0])
    assert seen == {"name": "__main__", "argv": ["a", "1"], "cwd": str(tmp_path), "path0": "", "start": "fork",
                    "tests_on_path": False, "env": "x"}
    assert done.stdout.splitlines()[1:] == ["atexit ran"] and done.stderr == "to stderr\n"


@pytest.mark.timeout(120)
def test_a_forked_module_and_script_find_their_folder_first_on_the_path(tmp_path):
    (tmp_path / "probe_module.py").write_text(AS_MAIN)
    module = launch.python_m("probe_module", "m", cwd=tmp_path, env=launch.child_env(ROOT=ROOT))
    assert module.returncode == 0, module.stderr
    assert json.loads(module.stdout.splitlines()[0])["path0"] == str(tmp_path)
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "probe_script.py"
    script.write_text(AS_MAIN)
    ran = launch.python_script(script, "s", env=launch.child_env(ROOT=ROOT))
    seen = json.loads(ran.stdout.splitlines()[0])
    assert (seen["name"], seen["argv"], seen["path0"]) == ("__main__", ["s"], str(tmp_path / "sub"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code, returncode, stderr", [
    ("import sys; sys.exit(5)", 5, ""),
    ("import sys; sys.exit('a message')", 1, "a message\n"),
    ("raise ValueError('boom')", 1, "ValueError: boom\n"),
    ("import os; os._exit(7)", 7, ""),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
])
def test_a_forked_program_ends_with_the_exit_status_an_interpreter_gives(code, returncode, stderr):
    done = launch.python_c(code)
    assert done.returncode == returncode
    assert done.stderr.endswith(stderr) and ("Traceback" in done.stderr) == (returncode == 1 and "raise" in code)


@pytest.mark.timeout(120)
def test_a_started_process_can_be_signalled_as_a_session_and_reports_what_it_wrote_so_far(tmp_path):
    running = launch.python_c_start("import sys, time; print('up', flush=True); time.sleep(60)", new_session=True)
    launch.wait_until(lambda: running.output()[0] == "up\n", timeout=60, what="the program printed")
    assert running.poll() is None and os.getpgid(running.pid) == running.pid
    os.killpg(running.pid, signal.SIGTERM)
    assert running.result(timeout=30).returncode == -signal.SIGTERM


def test_alpha_run_checks_answer_a_usage_error_and_refuse_to_launch(tmp_path):
    bad = launch.alpha_run_checks("--nproc", 2, "--store", tmp_path / "s", "--fanout", 0, "--updates", 1, CONFIG)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and bad.stdout == ""
    with pytest.raises(launch.OwnerStarted):
        launch.alpha_run_checks("--nproc", 2, "--store", tmp_path / "s", "--updates", 1, CONFIG)


def test_wait_until_returns_the_first_true_value_or_names_what_did_not_happen():
    values = iter([0, None, "ready"])
    assert launch.wait_until(lambda: next(values), timeout=10, what="ready", every=0) == "ready"
    with pytest.raises(AssertionError, match="not within 0.05 s: never"):
        launch.wait_until(lambda: False, timeout=0.05, what="never")


def _sets_threads(n: int) -> int:
    import torch
    torch.set_num_threads(n)
    return torch.get_num_threads()


def test_a_fresh_process_keeps_what_it_sets_to_itself():
    import torch
    before = torch.get_num_threads()
    assert launch.in_fresh_process(_sets_threads, before + 1) == before + 1
    assert torch.get_num_threads() == before
    assert sys.modules["torch"] is torch
