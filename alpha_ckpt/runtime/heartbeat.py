"""A rank that stops making progress is found by its silence, not only by its exit.

Every rank alpha-run starts (a script's, through :mod:`alpha_ckpt.launch.script_runner`; the
built-in job's owner; a warm spare of ``--in-place`` once it takes a rank) beats: a
daemon thread (:class:`Heartbeat`) adds one to the counter ``beat/PID`` in a store its
launcher hosts (a ``torch.distributed.TCPStore``: alpha-run's own, or ``--in-place``'s
control store) every ``--heartbeat-period`` seconds. A process that is stopped
(SIGSTOP) stops every thread, this one included; a rank busy in C++ (a forward or
backward pass, a collective) still beats, since torch releases the GIL there and the
store's calls wait without it.

The launcher reads the counters (:class:`Watcher`) while it watches its ranks' exits. A
process whose counter has not moved for ``--heartbeat-limit`` seconds is hung (before
its first beat, while Python and torch start, it has ``--timeout``): the launcher
SIGKILLs it and what it started (:func:`kill`), waits for it to be gone, and then
treats it as a rank that died, the rank named in its messages and in the restart's
context. The limit is below ``--timeout``, so the hung rank is killed before a healthy
peer's collective times out and is blamed for it. A rank that is slow but beats within
the limit is left alone.

Each node's launcher hosts the store its own ranks beat to and watches them, so on
several nodes the node of a hung rank kills it and torch's rendezvous restarts the
others. Importing this module starts nothing; only the standard library is imported
at module level (torch when a beat starts).
"""
from __future__ import annotations

import atexit
import dataclasses
import math
import os
import signal
import threading
import time
from typing import Any, Mapping

from alpha_ckpt.runtime import launch_env
from alpha_ckpt.errors import UsageError

DEFAULT_PERIOD_S = 1.0  # at most; a quarter of the limit when the limit is shorter
CHECK_EVERY_S = 0.1  # how often a launcher reads its ranks' counters


def check_heartbeat_args(args) -> None:
    """``--heartbeat-limit`` (default: half of ``--timeout``) and ``--heartbeat-period`` (default: 1 s, or a
    quarter of the limit), filled in on ``args``; :class:`UsageError` for values that cannot be."""
    timeout = float(args.timeout)
    limit = timeout / 2 if args.heartbeat_limit is None else float(args.heartbeat_limit)
    if not (math.isfinite(limit) and 0 < limit < timeout):
        raise UsageError(f"--heartbeat-limit must be a positive number of seconds below --timeout ({timeout:g}), "
                         f"not {limit:g}: a hung rank must be killed before its peers' collectives time out")
    period = min(DEFAULT_PERIOD_S, limit / 4) if args.heartbeat_period is None else float(args.heartbeat_period)
    if not (math.isfinite(period) and 0 < period <= limit / 2):
        raise UsageError(f"--heartbeat-period must be a positive number of seconds, at most half of "
                         f"--heartbeat-limit ({limit:g}), not {period:g}")
    args.heartbeat_limit, args.heartbeat_period = limit, period


# --- the rank's side ---------------------------------------------------------------------------

class Heartbeat:
    """A daemon thread that adds one to ``key`` in the store at ``endpoint`` (``host:port``) every ``period`` s.

    A store that cannot be reached is tried again at the next beat (a launcher that is gone ends
    this process through :mod:`alpha_ckpt.runtime.lifeline`). :meth:`stop` ends the thread.
    """

    def __init__(self, endpoint: str, period: float, key: str):
        from torch.distributed import TCPStore  # here, not in the thread: no import runs beside the script's
        self._store_type = TCPStore
        self.endpoint, self.period, self.key = endpoint, period, key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="alpha-ckpt-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        from datetime import timedelta
        host, port = self.endpoint.rsplit(":", 1)
        store = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._store_type(host, int(port), is_master=False,
                                             timeout=timedelta(seconds=max(5.0, 2 * self.period)))
                store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store is unreachable for now: the next beat tries again
                store = None
            self._stop.wait(self.period)
        store = None  # the connection closes in this thread

    def stop(self) -> None:
        """End the thread (a beat in flight ends first, bounded by its store's timeout)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period + 1.0)


_started: list[Heartbeat] = []


def start_from_environment() -> Heartbeat | None:
    """Beat to the launcher named in the environment (alpha-run's ranks), or do nothing; the heartbeat started.

    The thread stops at exit, before the interpreter tears down (an atexit handler, registered
    before the script's own, so it runs after them: a rank finishing its saves there still beats).
    """
    endpoint, period = launch_env.pop_heartbeat()
    if endpoint is None or _started:
        return None
    beat = Heartbeat(endpoint, period, launch_env.heartbeat_key(os.getpid())).start()
    _started.append(beat)
    atexit.register(beat.stop)
    return beat


def bound_collectives_from_environment() -> float | None:
    """:func:`bound_collectives` with alpha-run's ``--timeout``; the seconds set, or None outside alpha-run."""
    seconds = launch_env.process_group_timeout()
    return None if seconds is None else bound_collectives(seconds)


def bound_collectives(seconds: float) -> float | None:
    """Make ``seconds`` the timeout of every process group this process creates without one
    (``dist.init_process_group()``, ``dist.new_group()``, the Checkpointer's own groups): torch's
    default otherwise, 30 minutes for gloo. The seconds set, or None where torch has no such default."""
    from datetime import timedelta

    import torch.distributed as dist
    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is None or not hasattr(c10d, "default_pg_timeout"):
        return None
    # torch reads these module names whenever a group is made with no timeout (_get_default_timeout).
    c10d.default_pg_timeout = timedelta(seconds=seconds)
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
        c10d.default_pg_nccl_timeout = timedelta(seconds=seconds)
    return seconds


# --- the launcher's side -----------------------------------------------------------------------

class Silence:
    """Which processes have been silent past their bound, from the counters read (pure).

    A process is watched from the first look that names it; its counter then is its baseline.
    Until the counter first moves it has ``startup`` seconds (Python and torch starting, or a pid
    reused from a process gone: the baseline is not its own), then ``limit`` seconds between moves.
    """

    def __init__(self, limit: float, startup: float):
        self.limit, self.startup = limit, max(limit, startup)
        self._seen: dict[int, tuple[int, float, bool]] = {}  # pid -> (count, when it last moved, moved once)

    def look(self, counts: Mapping[int, int], now: float) -> dict[int, float]:
        """pid -> seconds since its counter last moved, for the processes of ``counts`` (pid -> its counter
        now) that are silent past their bound. Processes not in ``counts`` are forgotten."""
        for pid in [pid for pid in self._seen if pid not in counts]:
            del self._seen[pid]
        silent = {}
        for pid, count in counts.items():
            seen = self._seen.get(pid)
            if seen is None:
                self._seen[pid] = (count, now, False)
                continue
            if count != seen[0]:
                self._seen[pid] = (count, now, True)
                continue
            quiet = now - seen[1]
            if quiet > (self.limit if seen[2] else self.startup):
                silent[pid] = quiet
        return silent


@dataclasses.dataclass(frozen=True)
class Hung:
    """A rank found hung: its global rank, its process and the seconds it had been silent."""
    rank: int
    pid: int
    silent_s: float

    def describe(self) -> str:
        return f"hung: no heartbeat for {self.silent_s:.1f} s, killed"


class Watcher:
    """The launcher's watch over its ranks' beats in ``store`` (a TCPStore it hosts)."""

    def __init__(self, store: Any, limit: float, startup: float, check_every: float = CHECK_EVERY_S):
        self.store, self.limit = store, limit
        self._silence = Silence(limit, startup)
        self._check_every = check_every
        self._next = 0.0

    def hung(self, ranks: Mapping[int, int]) -> list[Hung]:
        """The ranks of ``ranks`` (global rank -> pid) silent past their bound, at most every ``check_every`` s."""
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + self._check_every
        counts = {}
        for pid in ranks.values():
            try:
                counts[pid] = int(self.store.add(launch_env.heartbeat_key(pid), 0))
            except Exception:  # noqa: BLE001 - a store the launcher hosts; unreadable now, read at the next look
                return []
        silent = self._silence.look(counts, now)
        return [Hung(rank, pid, silent[pid]) for rank, pid in sorted(ranks.items()) if pid in silent]


def kill(pid: int) -> None:
    """SIGKILL the process ``pid`` and, when it leads its own process group (alpha-run's ranks each start a
    session), what it started there; a stopped process dies too."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def serve(host: str):
    """A store for the beats of this launcher's ranks (a TCPStore server on a free port); (store, host:port)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return store, f"{host}:{store.port}"
