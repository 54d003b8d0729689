"""Every usage error is found before anything runs: exit 2, one line on stderr, no traceback.

alpha-run's own flags are checked in its one process, before any rank starts: those cases call
``launcher.main`` in-process with torch's launcher stubbed out (an owner started is a failure). The
built-in job is launched as any script is, so its own flags and config are checked by the job, before
its process group starts: those cases call the job's ``main`` in-process, as every owner runs it.
The same errors met by the alpha-run process and by the job it launches:
tests/e2e/test_usage_errors_under_alpha_run.py.
"""
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "forecast.toml")

# (id, flags before the config, config path or None for the real one); each flag set must be refused.
BAD_CONFIG_VALUES = [
    "bogus=1", "lr=abc", "batch=0", "batch=-3", "stores=0", "items=0", "history_days=0", "horizon_days=0",
    "hidden=0", "embedding_rows=-1", "lr=0", "lr=-0.1", "lr=nan", "lr=inf", "momentum=1", "momentum=-0.5",
    "beta1=1", "beta2=1.5", "eps=0", "eps=nan", "seed=-1", "optimizer=rmsprop", "parameters=sharded",
    "bind_placement=maybe", "run=a/b", "run=..", "step=a/b", "step=", "to_json=1", "samples=4", "noequals",
]
# alpha-run's flags: refused by alpha-run before any rank starts, and by the job under plain torchrun.
FLAG_CASES = [
    pytest.param(["--timeout", "-5"], None, id="timeout-negative"),
    pytest.param(["--timeout", "0"], None, id="timeout-zero"),
    pytest.param(["--timeout", "inf"], None, id="timeout-inf"),
    pytest.param(["--timeout", "nan"], None, id="timeout-nan"),
    pytest.param(["--timeout", "1e300"], None, id="timeout-beyond-timedelta"),
    pytest.param(["--commit-timeout", "nan"], None, id="commit-timeout-nan"),
    pytest.param(["--commit-timeout", "inf"], None, id="commit-timeout-inf"),
    pytest.param(["--commit-timeout", "0"], None, id="commit-timeout-zero"),
    pytest.param(["--commit-timeout", "-1"], None, id="commit-timeout-negative"),
    pytest.param(["--fanout", "0"], None, id="fanout-zero"),
    pytest.param(["--checkpoint-every", "-1"], None, id="checkpoint-every-negative"),
    pytest.param(["--checkpoint-every", "\u00b2"], None, id="checkpoint-every-superscript-digit"),
    pytest.param(["--checkpoint-every", "auto"], None, id="checkpoint-every-auto-without-mtbf"),
    pytest.param(["--checkpoint-every", "auto", "--mtbf", "0"], None, id="mtbf-zero"),
    pytest.param(["--resume-from", "abc"], None, id="resume-from-not-a-digest"),
    pytest.param(["--publisher", "ring"], None, id="publisher-unknown"),
]
# The job's own flags and config: refused by the job before its process group starts.
JOB_CASES = [pytest.param(["--set", item], None, id=f"set-{item}") for item in BAD_CONFIG_VALUES] + [
    pytest.param(["--set", "run=a/b"], None, id="run-name-with-slash"),
    pytest.param(["--set", "run=.hidden"], None, id="run-name-with-leading-dot"),
    pytest.param(["--updates", "0"], None, id="updates-zero"),
    pytest.param(["--updates", "-2"], None, id="updates-negative"),
    pytest.param(["--backend", "mpi"], None, id="backend-unknown"),
    pytest.param(["--branch-from", "a" * 64], None, id="branch-from-without-run"),
    pytest.param([], "missing.toml", id="config-missing"),
    pytest.param([], "not-toml", id="config-not-toml"),
    pytest.param([], "binary", id="config-binary"),
    pytest.param([], "directory", id="config-is-a-directory"),
    pytest.param([], "wrong-type", id="config-value-of-the-wrong-type"),
    pytest.param([], "table", id="config-unknown-table"),
]
CASES = FLAG_CASES + JOB_CASES
LAUNCHER_ONLY_CASES = [
    pytest.param(["--nproc", "0"], id="nproc-zero"),
    pytest.param(["--nproc", "-1"], id="nproc-negative"),
    pytest.param(["--nnodes", "0"], id="nnodes-zero"),
    pytest.param(["--nnodes", "3:2"], id="nnodes-min-above-max"),
    pytest.param(["--nnodes", "x"], id="nnodes-not-a-number"),
    pytest.param(["--node-rank", "-1"], id="node-rank-negative"),
    pytest.param(["--node-rank", "1"], id="node-rank-beyond-nnodes"),
    pytest.param(["--max-restarts", "-1"], id="max-restarts-negative"),
    pytest.param(["--max-restarts", "2", "--master-port", "29533"], id="max-restarts-with-static-rendezvous"),
    pytest.param(["--max-restarts", "2", "--nnodes", "2", "--master-addr", "10.0.0.1"],
                 id="max-restarts-with-static-rendezvous-on-two-nodes"),
    pytest.param(["--master-port", "70000"], id="master-port-out-of-range"),
    pytest.param(["--rdzv-endpoint", "host:port"], id="rdzv-endpoint-bad-port"),
    pytest.param(["--rdzv-backend", "carrier-pigeon"], id="rdzv-backend-unknown"),
    pytest.param(["--rdzv-conf", "is_host"], id="rdzv-conf-key-without-value"),
    pytest.param(["--rdzv-conf", "is_host=maybe"], id="rdzv-conf-is-host-not-a-boolean"),
    pytest.param(["--rdzv-conf", "join_timeout=soon"], id="rdzv-conf-join-timeout-not-a-number"),
    pytest.param(["--rdzv-conf", "last_call_timeout=0"], id="rdzv-conf-last-call-timeout-zero"),
    pytest.param(["--rdzv-conf", "read_timeout=-5"], id="rdzv-conf-read-timeout-negative"),
    pytest.param(["--nproc", "2", "--local-ranks-filter", "2"], id="local-ranks-filter-beyond-nproc"),
    pytest.param(["--local-ranks-filter", "zero"], id="local-ranks-filter-not-a-number"),
    pytest.param(["--nproc", "many"], id="nproc-not-a-number-nor-auto"),
    pytest.param(["--in-place", "--max-restarts", "1", "--rdzv-conf", "is_host=1"], id="in-place-with-rdzv-conf"),
    pytest.param(["--max-restarts", "1", "--spares", "1"], id="spares-without-in-place"),
    pytest.param(["--in-place", "--max-restarts", "1", "--spares", "-1"], id="spares-negative"),
    pytest.param(["--in-place", "--max-restarts", "1", "--spares", "two"], id="spares-not-a-number"),
    pytest.param(["--run", "a/b"], id="run-name-with-slash"),
    pytest.param(["--run", ".hidden"], id="run-name-with-leading-dot"),
    pytest.param(["--heartbeat-limit", "120"], id="heartbeat-limit-not-below-timeout"),
    pytest.param(["--heartbeat-limit", "nan"], id="heartbeat-limit-nan"),
    pytest.param(["--heartbeat-period", "0"], id="heartbeat-period-zero"),
    pytest.param(["--heartbeat-limit", "4", "--heartbeat-period", "3"], id="heartbeat-period-above-half-the-limit"),
]


def config_path(tmp_path: Path, kind: str | None) -> str:
    if kind is None:
        return CONFIG
    path = tmp_path / kind
    if kind == "not-toml":
        path.write_text("this is = = not toml\n")
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00 batch = 1\n")
    elif kind == "directory":
        path.mkdir()
    elif kind == "wrong-type":
        path.write_text('batch = "ninety-six"\n')
    elif kind == "table":
        path.write_text("[model]\nhidden = 3\n")
    return str(path)


class OwnerStarted(Exception):
    pass


@pytest.fixture
def no_owner_may_start(monkeypatch):
    """torch's launcher and process-group start fail the test: a usage error must stop everything before."""
    import torch.distributed
    import torch.distributed.run

    def started(*args, **kwargs):
        raise OwnerStarted("an owner was started (or alpha-run handed the job to torch)")

    monkeypatch.setattr(torch.distributed.run, "run", started)
    monkeypatch.setattr(torch.distributed, "init_process_group", started)


def exit_code_of(main, argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


def assert_one_line_usage_error(code, err: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("flags, config", FLAG_CASES)
def test_alpha_run_refuses_a_usage_error_before_any_owner_starts(flags, config, tmp_path, capsys,
                                                                  no_owner_may_start):
    from alpha_ckpt.launch import launcher
    store = tmp_path / "store"
    argv = ["--nproc", "2", "--store", str(store), *flags, "-m", "alpha_ckpt.job", config_path(tmp_path, config),
            "--updates", "3"]
    code = exit_code_of(launcher.main, argv)
    assert_one_line_usage_error(code, capsys.readouterr().err)
    assert not store.exists()


@pytest.mark.parametrize("flags", LAUNCHER_ONLY_CASES)
def test_alpha_run_refuses_a_bad_torchrun_flag_before_any_owner_starts(flags, tmp_path, capsys, no_owner_may_start):
    from alpha_ckpt.launch import launcher
    argv = ["--store", str(tmp_path / "store"), *flags, "-m", "alpha_ckpt.job", CONFIG, "--updates", "3"]
    code = exit_code_of(launcher.main, argv)
    assert_one_line_usage_error(code, capsys.readouterr().err)


# PET_ variables (torchrun's, as schedulers set them) whose value their flag does not take, or that alpha-run
# cannot honour: refused like a bad flag, the variable named.
BAD_VARIABLES = [
    pytest.param({"PET_NODE_RANK": "first"}, "PET_NODE_RANK", id="node-rank-not-a-number"),
    pytest.param({"PET_NPROC_PER_NODE": "many"}, "PET_NPROC_PER_NODE", id="nproc-per-node-not-a-number"),
    pytest.param({"PET_MASTER_PORT": "http"}, "PET_MASTER_PORT", id="master-port-not-a-number"),
    pytest.param({"PET_MAX_RESTARTS": "few"}, "PET_MAX_RESTARTS", id="max-restarts-not-a-number"),
    pytest.param({"PET_STANDALONE": "yes"}, "PET_STANDALONE", id="standalone-not-0-or-1"),
    pytest.param({"PET_NNODES": "2", "PET_NODE_RANK": "2"}, "--node-rank", id="node-rank-beyond-nnodes"),
    pytest.param({"PET_RDZV_CONF": "is_host=maybe"}, "is_host", id="rdzv-conf-is-host-not-a-boolean"),
    pytest.param({"PET_NO_PYTHON": "1"}, "PET_NO_PYTHON", id="no-python"),
    pytest.param({"PET_RUN_PATH": "1"}, "PET_RUN_PATH", id="run-path"),
]


@pytest.mark.parametrize("variables, named", BAD_VARIABLES)
def test_alpha_run_refuses_a_bad_pet_variable_before_any_owner_starts_and_names_it(
        variables, named, tmp_path, capsys, monkeypatch, no_owner_may_start):
    from alpha_ckpt.launch import launcher
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    argv = ["--store", str(tmp_path / "store"), "-m", "alpha_ckpt.job", CONFIG, "--updates", "3"]
    code = exit_code_of(launcher.main, argv)
    err = capsys.readouterr().err
    assert_one_line_usage_error(code, err)
    assert named in err


@pytest.mark.parametrize("flags, config", CASES)
def test_an_owner_under_plain_torchrun_refuses_the_same_usage_errors_with_exit_2(flags, config, tmp_path, capfd,
                                                                                 monkeypatch, no_owner_may_start):
    from alpha_ckpt.job import owner as worker
    monkeypatch.delenv("ALPHA_CKPT_OPTIONS", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    argv = [config_path(tmp_path, config), "--store", str(tmp_path / "store"), "--updates", "3", *flags]
    code = exit_code_of(worker.main, argv)  # owners write their lines to fd 2 directly
    assert_one_line_usage_error(code, capfd.readouterr().err)


@pytest.mark.timeout(60)
def test_alpha_run_checks_its_flags_and_store_without_importing_torch(tmp_path):
    # A typo answers at once: torch (seconds to import) is loaded only to launch the owners.
    probe = ("import sys; from alpha_ckpt.launch import launcher; code = launcher.main(sys.argv[1:]); "
             "print(code, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe, "--nproc", "2", "--store", str(tmp_path / "store"),
                           "--fanout", "0", "-m", "alpha_ckpt.job", CONFIG, "--updates", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False"], proc.stderr[-2000:]


@pytest.mark.timeout(120)
def test_a_worker_process_started_as_torchrun_would_exits_2_with_one_line(tmp_path):
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # nothing listens there: init would fail as 75
    proc = launch.python_m("alpha_ckpt.job", CONFIG, "--store", tmp_path / "store", "--updates", "3", "--set", "lr=abc",
                           timeout=60, env=env)
    assert_one_line_usage_error(proc.returncode, proc.stderr)


def test_alpha_run_refuses_a_read_only_store_before_any_owner_starts(tmp_path, capsys, monkeypatch,
                                                                      no_owner_may_start):
    """In-process: the store's file system answers EROFS to every file created (see the e2e test for a real mount)."""
    from alpha_ckpt import Store
    from alpha_ckpt.launch import launcher
    store = tmp_path / "store"
    Store(store).close()
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    for resume in (["--resume", "latest"], ["--resume-from", "a" * 64], []):
        code = exit_code_of(launcher.main, ["--store", str(store), *resume, "-m", "alpha_ckpt.job", CONFIG,
                                            "--updates", "3"])
        err = capsys.readouterr().err
        assert_one_line_usage_error(code, err)
        assert str(store) in err


SCRIPT_WITH_ATEXIT = """
import atexit, sys
atexit.register(lambda: open(sys.argv[1], "w").write("ran"))
print("out", flush=False)
sys.exit({code})
"""


@pytest.mark.parametrize("code,expected", [("0", 0), ("5", 5), ("None", 0), ("'a message'", 1)])
def test_the_script_runner_keeps_a_scripts_exit_status_runs_its_atexit_handlers_and_flushes(tmp_path, code, expected):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT_WITH_ATEXIT.format(code=code))
    marker = tmp_path / "marker"
    done = launch.python_m("alpha_ckpt.launch.script_runner", script, marker, timeout=60)
    assert done.returncode == expected
    assert marker.read_text() == "ran"
    assert done.stdout == "out\n"


@pytest.mark.parametrize("flags, standalone", [
    pytest.param(["--max-restarts", "3"], True, id="restarts-on-one-node-use-c10d-on-a-free-port"),
    pytest.param([], False, id="no-restarts-keep-torchruns-default"),
    pytest.param(["--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400"], False,
                 id="a-named-c10d-rendezvous-is-kept"),
])
def test_restarts_on_one_node_run_a_rendezvous_whose_every_round_has_a_new_store(flags, standalone):
    from alpha_ckpt.runtime import launch_env
    from alpha_ckpt.launch import launcher
    args = launcher.parse(["--nproc", "2", *flags, CONFIG])
    assert ("--standalone" in launcher.torchrun_argv(args)) is standalone
    with launch_env.exported(1):  # every round of torch's c10d rendezvous gives the ranks a store of their own
        import os
        assert os.environ[launch_env.SEPARATE_RANK_STORE[0]] == launch_env.SEPARATE_RANK_STORE[1]
