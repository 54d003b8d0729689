"""How tests and gates start what they check: one harness, each launch the cheapest one that still proves the point.

A process that imports torch costs seconds of CPU; on a machine of two cores, starting them was most of the
suite's time. So, from cheapest to dearest:

- :func:`alpha_run_checks`, :func:`alpha_ckpt_cli`: alpha-run's checks before it starts any owner, and the
  ``alpha-ckpt`` command, in the calling process (the console scripts' ``main`` and exit codes, without an
  interpreter start). :func:`alpha_run_checks` fails if alpha-run would have started an owner.
- :func:`run_ranks`: a function on N gloo ranks; :func:`in_fresh_process`, :func:`oracle_digest`: a function in
  a process of its own (global torch settings stay there). Each forked from a server that imported torch once.
- :func:`alpha_run`, :func:`python_m`, :func:`python_c`, :func:`python_script`, :func:`torchrun`: ``python -m
  MODULE``, ``python -c CODE`` or ``python SCRIPT`` forked from the same server and run as ``__main__``, as the
  interpreter runs them; what they start (alpha-run's and torchrun's ranks) are new interpreters, as always.
- ``new_interpreter=True``, ``console=True``, :func:`alpha_ckpt`: a new interpreter, or the console script
  installed on PATH (as the gates run them), with this checkout first on PYTHONPATH: for what is about the
  process itself.

:func:`wait_until` waits for a state by checking for it, never by sleeping a guessed time.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

# The folder holding this package: first on a child's path, so the child runs the code under test.
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])

# What the fork server imports once, before it forks anything. DTensor's first from_local imports
# torch._dynamo (most of a second): once there, not in every child.
# torch's launcher too, for the alpha-run processes forked from it (not alpha_ckpt.launch.launcher: python -m runs it
# as __main__, and a copy imported before would be a second module).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "alpha_ckpt",
           "alpha_ckpt.collective", "torch.distributed.run"]


def child_env(env: dict | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default: this process's environment) with this package's folder first on PYTHONPATH."""
    out = dict(os.environ if env is None else env)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != PACKAGE_PARENT]
    out["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT, *paths])
    out.update(extra)
    return out


def last_json(text: str) -> Any:
    """The last line of ``text`` that is a JSON value (a job's or script's result line)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith(("{", "[")):
            return json.loads(line)
    raise ValueError(f"no JSON line in {text[-500:]!r}")


# --- in this process ---

def alpha_ckpt_cli(*args) -> subprocess.CompletedProcess:
    """``alpha-ckpt ARGS...`` run in this process: the console script's entry point and exit codes, without an
    interpreter start and a torch import per call. The console script itself is run by :func:`alpha_ckpt`."""
    from alpha_ckpt.launch import cli
    out, err = io.StringIO(), io.StringIO()
    code = cli.main([str(a) for a in args], out=out, err=err)
    return subprocess.CompletedProcess(["alpha-ckpt", *map(str, args)], code, out.getvalue(), err.getvalue())


class OwnerStarted(AssertionError):
    """alpha-run handed the launch to torch: its checks let the arguments through."""


@contextlib.contextmanager
def no_owner_may_start():
    """torch's launcher and process-group start raise :class:`OwnerStarted` inside the block."""
    import torch.distributed
    import torch.distributed.run

    def started(*args, **kwargs):
        raise OwnerStarted("an owner was started (or alpha-run handed the job to torch)")

    saved = torch.distributed.run.run, torch.distributed.init_process_group
    torch.distributed.run.run = torch.distributed.init_process_group = started
    try:
        yield
    finally:
        torch.distributed.run.run, torch.distributed.init_process_group = saved


# The built-in job's own arguments (alpha_ckpt.job): after its config, where a script's arguments go.
_JOB_VALUED = ("--updates", "--set", "--branch-from", "--backend")
_JOB_SWITCHES = ("--discard-checkpoints",)


def job_argv(args) -> list[str]:
    """The job's command as alpha-run takes it, from its arguments in any order: alpha-run's flags, then
    ``-m alpha_ckpt.job CONFIG``, then the job's own (``--updates``, ``--set``, ``--branch-from``,
    ``--backend``, ``--discard-checkpoints``; ``--run NAME`` becomes ``--set run=NAME``, the job's run being
    its config's). Arguments with no ``.toml`` config among them are returned as they are (a script's)."""
    args = [str(a) for a in args]
    configs = [i for i, a in enumerate(args) if a.endswith(".toml") and (i == 0 or args[i - 1] not in _JOB_VALUED)]
    if not configs or "-m" in args or any(a.endswith(".py") for a in args):
        return args
    launcher, job, i = [], [], 0
    while i < len(args):
        a = args[i]
        if i == configs[0]:
            i += 1
            continue
        if a in _JOB_VALUED and i + 1 < len(args):
            job += [a, args[i + 1]]
            i += 2
        elif a == "--run" and i + 1 < len(args):
            job += ["--set", f"run={args[i + 1]}"]
            i += 2
        elif a in _JOB_SWITCHES:
            job.append(a)
            i += 1
        else:
            launcher.append(a)
            i += 1
    return [*launcher, "-m", "alpha_ckpt.job", args[configs[0]], *job]


def ordered(cmd: list[str]) -> list[str]:
    """An alpha-run command line (``alpha-run ...`` or ``python -m alpha_ckpt.launch.launcher ...``) with the
    job's arguments put where alpha-run takes them (:func:`job_argv`); any other command as it is."""
    cmd = [str(a) for a in cmd]
    for head in (["alpha-run"], [sys.executable, "-m", "alpha_ckpt.launch.launcher"]):
        if cmd[:len(head)] == head:
            return head + job_argv(cmd[len(head):])
    return cmd


def alpha_run_checks(*args, cwd=None) -> subprocess.CompletedProcess:
    """alpha-run's answer to ``ARGS`` when it stops before starting any owner (a usage error): its exit code and
    what it printed, from ``launcher.main`` in this process. Raises :class:`OwnerStarted` if it would launch."""
    from alpha_ckpt.launch import launcher
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), no_owner_may_start():
            try:
                code = launcher.main(job_argv(args))
            except SystemExit as exc:  # argparse's own errors
                code = exc.code
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["alpha-run", *map(str, args)], code, out.getvalue(), err.getvalue())


# --- forked from a server that imported torch once ---

def fork_context():
    """The fork server every rank and fresh process of this process comes from.

    Not fork: a test process has live threads (torch's intra-op pool, thread pools of earlier tests), and a
    forked child can inherit one of their locks held, and hang. The fork server is a clean process that
    imported torch once; its children start in milliseconds.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start the fork server now, without waiting for it: it imports torch while the caller goes on (a test
    session collecting its tests), so the first process forked from it does not wait for that."""
    from multiprocessing import forkserver
    fork_context()
    forkserver.ensure_running()


def _as_a_new_interpreter() -> None:
    """A process forked from the server starts what it starts as a new interpreter would: multiprocessing's
    default start method is the platform's again (the server's children inherit "forkserver"; a DataLoader's
    workers would each come from another fork server, a new interpreter, instead of a fork)."""
    multiprocessing.set_start_method(None, force=True)


def _rank_main(fn, args, rank: int, world: int, rendezvous: str, out: str, pg_timeout: float = 60.0) -> None:
    import torch.distributed as dist
    from alpha_ckpt.errors import Refusal
    _as_a_new_interpreter()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        # A file rendezvous: no port to race for with tests running beside this one.
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        try:
            result = fn(rank, world, *args)
        except Refusal as refusal:
            result = {"refusal": refusal.code.value, "message": refusal.message}
        dist.barrier()
        dist.destroy_process_group()
        Path(out).write_text(json.dumps(result))
        os._exit(0)
    except BaseException:  # noqa: BLE001 - reported to the parent
        Path(out).write_text(json.dumps({"crash": traceback.format_exc()}))
        os._exit(1)


def _join(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(10)
    assert not alive, f"{len(alive)} of {len(procs)} processes still running after {timeout} s"


def run_ranks(world: int, fn: Callable, *args, tmp: Path, timeout: float = 120.0, pg_timeout: float = 60.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks: every rank's result, in rank order.

    A rank's result is what the function returns (JSON), or ``{"refusal": code, "message": ...}`` when it
    raises a Refusal; any other exception fails the run with its traceback. ``pg_timeout``: how long a
    collective waits for a missing rank; ``timeout``: how long the ranks may take, all together.
    """
    ctx = fork_context()
    run = uuid.uuid4().hex[:12]
    rendezvous = str(tmp / f"rendezvous-{run}")
    outs = [str(tmp / f"rank{r}-{run}.json") for r in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(fn, args, r, world, rendezvous, outs[r], pg_timeout))
             for r in range(world)]
    for p in procs:
        p.start()
    _join(procs, timeout)
    results = [json.loads(Path(o).read_text()) for o in outs]
    crashes = [f"rank {rank}: {r['crash']}" for rank, r in enumerate(results) if isinstance(r, dict) and "crash" in r]
    assert not crashes, "\n".join(crashes)  # every rank's: the first is often only a peer's lost connection
    return results


def _fresh_main(fn, args, out: str) -> None:
    _as_a_new_interpreter()
    try:
        result = {"result": fn(*args)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"crash": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))
    os._exit(0)


def in_fresh_process(fn: Callable, *args, tmp: Path | None = None, timeout: float = 120.0) -> Any:
    """``fn(*args)`` (a module-level function returning JSON) in a process of its own, forked from the server:
    whatever it sets (torch's threads, determinism, seeds) stays there. Its exception fails the call."""
    import tempfile
    ctx = fork_context()
    with tempfile.TemporaryDirectory(dir=tmp) as folder:
        out = os.path.join(folder, "result.json")
        proc = ctx.Process(target=_fresh_main, args=(fn, args, out))
        proc.start()
        _join([proc], timeout)
        assert os.path.exists(out), f"the process exited {proc.exitcode} without a result"
        result = json.loads(Path(out).read_text())
    assert "crash" not in result, result["crash"]
    return result["result"]


def _oracle_digest(argv: list[str]) -> str:
    from alpha_ckpt.testing import oracle
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = oracle.main(argv)
    assert code in (0, None), out.getvalue()
    return last_json(out.getvalue())["state_digest"]


def oracle_digest(config, *args, timeout: float = 120.0) -> str:
    """The oracle's state digest (``python -m alpha_ckpt.testing.oracle CONFIG ARGS...``), in a fresh process."""
    return in_fresh_process(_oracle_digest, [str(config), *map(str, args)], timeout=timeout)


# --- python, forked from the server: modules, programs, scripts, alpha-run ---

@functools.lru_cache(maxsize=None)
def _interpreter_path() -> tuple[str, ...]:
    """The module search path a new interpreter starts with, less its first entry and PYTHONPATH's: the
    standard library and site-packages (a child forked from the server inherits this process's path instead,
    with whatever pytest put there for the tests). An interpreter without torch starts in milliseconds."""
    done = subprocess.run([sys.executable, "-E", "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                          capture_output=True, text=True, check=True, timeout=60)
    return tuple(json.loads(done.stdout))


def _python_main(how: str, what: str, argv: list[str], cwd: str, env: dict, path: list[str], new_session: bool,
                 out: str, err: str, code_path: str) -> None:
    """``python -m MODULE ARGV`` (``how`` "-m"), ``python -c CODE ARGV`` ("-c") or ``python SCRIPT ARGV`` ("")
    in this forked process, as the interpreter runs them: as ``__main__``, on the path of a new interpreter
    (``path``) after the folder ``cwd`` (the script's folder for a script), stdout and stderr to files (what it
    starts inherits them), the exit code written."""
    code = 1
    try:
        if new_session:
            os.setsid()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for fd, file in ((1, out), (2, err)):
            target = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        first = {"-m": cwd, "-c": ""}.get(how, os.path.dirname(os.path.abspath(what)))
        sys.path[:] = [first, *path]
        _as_a_new_interpreter()
        try:
            if how == "-m":
                import runpy
                sys.argv = [what, *argv]
                runpy.run_module(what, run_name="__main__", alter_sys=True)
            elif how == "":
                import runpy
                sys.argv = [what, *argv]
                runpy.run_path(what, run_name="__main__")
            else:
                sys.argv = ["-c", *argv]
                main = type(sys)("__main__")
                sys.modules["__main__"] = main
                exec(compile(what, "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
            traceback.print_exc()
            code = 1
        import atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        with contextlib.suppress(OSError):
            Path(code_path).write_text(str(code))
        os._exit(code)


class ForkedRun:
    """``python -m MODULE ARGV...`` or ``python -c CODE ARGV...`` forked from the server (see :func:`python_m`):
    ``pid``, ``poll()``, ``wait(timeout)``, ``kill()``, ``output()`` (stdout and stderr so far), and
    ``result(timeout)``, its :class:`subprocess.CompletedProcess` once it ended (killed at ``timeout``)."""

    def __init__(self, how: str, what: str, argv: list[str], cwd, env: dict | None, new_session: bool):
        import tempfile
        self.args = [sys.executable, *([how] if how else []), what, *argv]
        env = child_env(env)
        path = [*[p for p in env["PYTHONPATH"].split(os.pathsep) if p], *_interpreter_path()]
        self._folder = tempfile.TemporaryDirectory(prefix="forked-")
        self._paths = [os.path.join(self._folder.name, name) for name in ("out", "err", "code")]
        self._proc = fork_context().Process(target=_python_main, args=(
            how, what, argv, os.path.abspath(cwd or os.getcwd()), env, path, new_session, *self._paths))
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        return None if self._proc.is_alive() else self.returncode

    @property
    def returncode(self) -> int | None:
        if self._proc.is_alive():
            return None
        code_path = self._paths[2]
        return int(Path(code_path).read_text()) if os.path.exists(code_path) else self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        self._proc.kill()

    def output(self) -> tuple[str, str]:
        return tuple(Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in self._paths[:2])

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self._proc.join(10)
            raise
        finally:
            out, err = self.output()
        code = self.returncode
        self._folder.cleanup()
        return subprocess.CompletedProcess(self.args, code, out, err)


def python_m_start(module: str, *args, cwd=None, env: dict | None = None, new_session: bool = False) -> ForkedRun:
    """``python -m MODULE ARGS...`` started and not waited for, forked from the server (see :func:`python_m`).
    ``new_session``: a session of its own, so ``os.killpg(run.pid, ...)`` signals it as a terminal would."""
    args = job_argv(args) if module == "alpha_ckpt.launch.launcher" else [str(a) for a in args]
    return ForkedRun("-m", module, args, cwd, env, new_session)


def python_m(module: str, *args, cwd=None, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS...`` to its end, forked from the server instead of a new interpreter: the module
    runs as ``__main__`` with the folder ``cwd`` first on the path, as ``python -m`` runs it, with torch (and
    what :data:`PRELOAD` names) imported already. Its exit code, stdout and stderr (text)."""
    return python_m_start(module, *args, cwd=cwd, env=env).result(timeout)


def python_c_start(code: str, *args, cwd=None, env: dict | None = None, new_session: bool = False) -> ForkedRun:
    """``python -c CODE ARGS...`` started and not waited for, forked from the server (see :func:`python_m`)."""
    return ForkedRun("-c", code, [str(a) for a in args], cwd, env, new_session)


def python_c(code: str, *args, cwd=None, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS...`` to its end, forked from the server as :func:`python_m` runs a module."""
    return python_c_start(code, *args, cwd=cwd, env=env).result(timeout)


def python_script(script, *args, cwd=None, env: dict | None = None,
                  timeout: float = 120) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS...`` to its end, forked from the server as :func:`python_m` runs a module."""
    return ForkedRun("", str(script), [str(a) for a in args], cwd, env, False).result(timeout)


def alpha_run_start(*args, cwd=None, env: dict | None = None, new_session: bool = False) -> ForkedRun:
    """alpha-run started and not waited for, its process forked from the server (see :func:`alpha_run`)."""
    return python_m_start("alpha_ckpt.launch.launcher", *args, cwd=cwd, env=env, new_session=new_session)


def alpha_run(*args, cwd=None, env: dict | None = None, timeout: float = 240, new_interpreter: bool = False,
              console: bool = False) -> subprocess.CompletedProcess:
    """``alpha-run ARGS...`` to its end: its exit code, stdout and stderr (text); killed after ``timeout`` s.

    alpha-run's own process is forked from the server (:func:`python_m`), torch imported already: the same
    ``python -m alpha_ckpt.launch.launcher``, seconds sooner. The owners it starts are new interpreters, as always. ``new_interpreter``: a
    ``python -m alpha_ckpt.launch.launcher`` process instead; ``console``: the ``alpha-run`` installed on PATH.
    """
    if new_interpreter or console:
        return _run(alpha_run_command(*args, console=console), cwd=cwd, env=env, timeout=timeout)
    return alpha_run_start(*args, cwd=cwd, env=env).result(timeout)


# --- new interpreters ---

def alpha_run_command(*args, console: bool = False) -> list[str]:
    head = ["alpha-run"] if console else [sys.executable, "-m", "alpha_ckpt.launch.launcher"]
    return [*head, *job_argv(args)]


def alpha_ckpt_command(*args, console: bool = False) -> list[str]:
    head = ["alpha-ckpt"] if console else [sys.executable, "-m", "alpha_ckpt.launch.cli"]
    return [*head, *map(str, args)]


def _run(cmd: list[str], *, cwd, env, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=child_env(env), capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def alpha_ckpt(*args, cwd=None, env: dict | None = None, timeout: float = 120, console: bool = False,
               **kwargs) -> subprocess.CompletedProcess:
    """``alpha-ckpt ARGS...`` as a process (see :func:`alpha_ckpt_cli` for the same in this process)."""
    return _run(alpha_ckpt_command(*args, console=console), cwd=cwd, env=env, timeout=timeout, **kwargs)


def torchrun(script, nproc: int, *args, cwd=None, env: dict | None = None, timeout: float = 120,
             new_interpreter: bool = False) -> subprocess.CompletedProcess:
    """Plain ``torchrun --standalone --nproc-per-node N SCRIPT ARGS...``: no alpha-run anywhere. torchrun's own
    process is forked from the server (:func:`python_m`); ``new_interpreter``: ``python -m torch.distributed.run``
    as a process. The ranks it starts are new interpreters either way."""
    argv = ["--nproc-per-node", str(nproc), "--standalone", str(script), *map(str, args)]
    if new_interpreter:
        return _run([sys.executable, "-m", "torch.distributed.run", *argv], cwd=cwd, env=env, timeout=timeout)
    return python_m("torch.distributed.run", *argv, cwd=cwd, env=env, timeout=timeout)


# --- waiting ---

def wait_until(predicate: Callable[[], Any], *, timeout: float, what: str, every: float = 0.02) -> Any:
    """``predicate()``'s first true value, checked every ``every`` seconds; AssertionError naming ``what`` once
    ``timeout`` seconds pass without one."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(every)
