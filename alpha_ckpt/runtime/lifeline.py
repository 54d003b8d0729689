"""An owner lives only as long as the launcher that started it.

torch's elastic agent starts every worker in a session of its own
(``SubprocessHandler._popen``: ``start_new_session=True``), so a signal to the
launcher's process group never reaches the owners, and a launcher killed with
SIGKILL cannot stop them: they would go on training and publishing. Each owner
therefore binds its own life to its launcher's:

- ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the owner when the
  *thread* that forked it exits. torch forks every worker, restarts under
  ``--max-restarts`` included, from the thread that runs the agent
  (``LocalElasticAgent._start_workers`` -> ``start_processes`` ->
  ``SubprocessContext._start`` -> ``Popen``), and alpha-run runs the agent on
  its main thread, which lives exactly as long as the launcher process.
- then the parent check: a launcher that died before the prctl has left the
  owner reparented already, and ``getppid()`` no longer names the pid the
  launcher named (:data:`alpha_ckpt.runtime.launch_env.LAUNCHER_PID`).
- a daemon watchdog thread that polls ``getppid()`` every
  :data:`WATCH_PERIOD_S`: the bound where prctl does not exist (not Linux).

alpha-run's owners bind first thing (``alpha_ckpt.launch.script_runner`` and
``alpha_ckpt.job`` call :func:`bind_to_named_launcher` before they import
torch, which takes seconds on a loaded machine), so an owner outlives a
killed launcher by at most :data:`OUTLIVE_BOUND_S`. Importing the package
binds nothing. Only the standard library is imported here.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from alpha_ckpt.runtime.launch_env import pop_launcher_pid

WATCH_PERIOD_S = 0.25
OUTLIVE_BOUND_S = 2.0  # stated in the README; gates/history_fencing holds us to it
_PR_SET_PDEATHSIG = 1

_bound_to: int | None = None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _set_parent_death_signal() -> bool:
    """PR_SET_PDEATHSIG(SIGKILL) on Linux; False where there is no such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while True:
        time.sleep(WATCH_PERIOD_S)
        if os.getppid() != parent:
            _die()


def bind_to_parent(parent: int | None = None) -> int:
    """Die with ``parent`` (default: the current parent); returns the pid bound to. Idempotent.

    Kills this process at once when ``parent`` is no longer its parent.
    """
    global _bound_to
    if _bound_to is not None:
        return _bound_to
    expected = os.getppid() if parent is None else parent
    _set_parent_death_signal()
    # After the prctl: a parent that died before it cannot signal us any more, but
    # it has left us reparented already.
    if os.getppid() != expected:
        _die()
    _bound_to = expected
    threading.Thread(target=_watch, args=(expected,), daemon=True, name="alpha-ckpt-lifeline").start()
    return expected


def bind_to_named_launcher() -> None:
    """Bind to the launcher named in the environment, if any (alpha-run names itself to its owners).

    The name is taken out of the environment: a process this owner starts is
    not the launcher's child and must not bind to it.
    """
    pid = pop_launcher_pid()
    if pid is not None:
        bind_to_parent(pid)
