"""Run a user's training script as one rank, with alpha_ckpt's exit codes (what alpha-run starts per rank).

    python -m alpha_ckpt.launch.script_runner train.py --its --own --args
    python -m alpha_ckpt.launch.script_runner -m package.module --args

The script runs as ``__main__`` with its own argv, exactly as ``python
train.py`` would run it under torchrun. A :class:`~alpha_ckpt.Refusal` that
escapes it (or ``torch.distributed.checkpoint``'s ``CheckpointException``
carrying one) exits 3 with one line naming the code (a checkpoint refused:
an orchestrator must not retry, and alpha-run's ``--max-restarts`` does not); a :class:`~alpha_ckpt.UsageError` (a
``Checkpointer`` argument that cannot be) and a module or script that does not
exist exit 2 with one line; ``SystemExit`` keeps its code (argparse's usage
errors are 2); any other exception exits 1 with its traceback. alpha-run
answers that with exit 1 and no restart when the rank had not reached a
checkpoint call yet (the script's own error: a restart would meet it again),
else as retryable (75); an error that says a peer failed (a broken
connection, a collective timed out) counts as retryable wherever it comes
(:func:`peer_failed`). Under alpha-run the refusal and usage lines are left
for the launcher, which prints each once naming the ranks
(:func:`alpha_ckpt.runtime.launch_env.record_verdict`). A script that ends (or exits) leaves
through :func:`exit_now`: its other threads are joined, atexit handlers run and
stdio is flushed, but the interpreter's own teardown is skipped, so a file
object the script left open and unflushed loses its buffer; close files
(``with open(...)``) as usual.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading

from alpha_ckpt.runtime import launch_env

EXIT_USAGE, EXIT_REFUSED = 2, 3


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("alpha_ckpt.launch.script_runner: usage: SCRIPT [ARGS...] | -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    from alpha_ckpt.errors import UsageError, refusal_in
    module = argv[0] == "-m"
    target = argv[1] if module else argv[0]
    problem = module_problem(target) if module else (None if os.path.isfile(target) else f"script {target}: no such file")
    if problem:
        print(f"alpha-run: {problem}", file=sys.stderr)
        return EXIT_USAGE
    sys.argv = [target] + argv[(2 if module else 1):]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python train.py` does
            runpy.run_path(target, run_name="__main__")
    except UsageError as exc:
        _say("usage", "usage error", str(exc))
        _leave_group()
        return EXIT_USAGE
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; others re-raised
        refusal = refusal_in(exc)  # a Refusal, or DCP's CheckpointException carrying one
        if refusal is None:
            if isinstance(exc, Exception) and peer_failed(exc):
                launch_env.note_peer_failure()  # retryable, checkpoint call or not
            raise
        _say("refused", "checkpoint refused", f"[{refusal.code.value}] {refusal.message}")
        _leave_group()
        return EXIT_REFUSED
    _leave_group()
    return 0


def _say(kind: str, what: str, text: str) -> None:
    """A verdict this rank ends with: under alpha-run left for the launcher, which prints it once naming every
    rank that met it (not once per rank); elsewhere printed here."""
    if not launch_env.record_verdict(kind, text):
        print(f"alpha-run: {what}: {text}", file=sys.stderr)


# What torch.distributed's transports say when a peer is gone or silent (gloo, torch 2.13), in messages of
# plain RuntimeErrors; torch's DistError types, resilient's PeerFailed and ConnectionError say it by their type.
_PEER_TYPES = ("DistError", "PeerFailed")  # torch.distributed's (and its subclasses), alpha_ckpt.launch.resilient's
_PEER_WORDS = ("third_party/gloo/", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
               "Timed out waiting", "Socket Timeout", "NCCL communicator was aborted")


def peer_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says that a peer of this rank failed, not this rank's script:
    a connection to a peer broke or a collective with it timed out, or alpha-run --in-place began a new round."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionError) or any(base.__name__ in _PEER_TYPES for base in type(exc).__mro__):
            return True
        if any(words in str(exc) for words in _PEER_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def module_problem(name: str) -> str | None:
    """Why ``python -m name`` would not find a module to run (one line), or None.

    Found as ``python -m`` finds it: the current directory first on the path. A parent
    package is imported to look inside it, as ``python -m`` would import it anyway.
    """
    import importlib.util
    added = "" not in sys.path and os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        if spec is None:
            return f"module {name}: no such module"
        if spec.submodule_search_locations is not None and importlib.util.find_spec(f"{name}.__main__") is None:
            return f"module {name}: a package without __main__"
    except (ImportError, ValueError) as exc:
        return f"module {name}: {exc}"
    finally:
        if added:
            sys.path.remove(os.getcwd())
    return None


def _leave_group() -> None:
    """A process group left alive at exit aborts the process (gloo's threads): a refusal would read as a crash."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):  # a group a broken connection left half torn down: the exit goes on
            pass


def exit_now(code) -> None:
    """Exit with ``code`` as the interpreter would (the script's other threads joined, then its atexit
    handlers run, then stdio flushed), but skip the interpreter's teardown: a gloo worker thread still
    releasing a finished collective's tensors then aborts the process (std::terminate, SIGABRT; see
    alpha_ckpt.runtime.teardown), and would turn exit 0 or 3 into a crash that alpha-run reports as 75."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # sys.exit("message"), as Python itself reports it
        code = 1
    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize runs first: non-daemon threads and
    if shutdown is not None:                          # thread pools (an async save in flight) finish
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    # First, before the script imports torch (seconds): a rank started by alpha-run binds its
    # life to the launcher's, so a launcher killed meanwhile leaves no rank running.
    from alpha_ckpt.runtime.lifeline import bind_to_named_launcher
    bind_to_named_launcher()
    from alpha_ckpt.runtime.faults import install_from_environment
    install_from_environment()  # the fault and kill points a test asks of this rank, if any
    from alpha_ckpt.runtime import heartbeat
    heartbeat.start_from_environment()  # beats to alpha-run, which kills a rank whose beats stop (hung)
    heartbeat.bound_collectives_from_environment()  # --timeout: the script's own init_process_group too
    try:
        status = main()
    except SystemExit as exc:  # the script's own sys.exit, argparse's usage errors (2)
        _leave_group()
        status = exc.code
    except Exception:  # noqa: BLE001 - the script's own error: its traceback as Python prints it, exit 1
        sys.excepthook(*sys.exc_info())
        _leave_group()
        status = 1
    exit_now(status)
