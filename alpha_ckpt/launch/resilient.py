"""run_resilient(main): a training script's ranks that survive a peer's death without a new process.

    def main():
        model, optim = ...                                  # built again on every call
        ckpt = alpha_ckpt.Checkpointer.from_launcher_env()
        counters = ckpt.restore(state)                      # the newest generation, on every rank
        for step in ...: ...

    if __name__ == "__main__":
        alpha_ckpt.run_resilient(main)

Under ``alpha-run --in-place`` (:mod:`alpha_ckpt.launch.inplace`) this joins the
default process group of the launcher's current rendezvous round and calls
``main()``. When ``main()`` raises because a peer died (:class:`PeerFailed`,
raised in it as soon as the launcher begins a newer round, or gloo's own
``RuntimeError`` "Connection closed by peer" in torch 2.13, or
``torch.distributed.DistError`` and its subclasses), the connections to the
old round's ranks are shut, every process group is destroyed, the newest round is
joined with the same rank and world size, and ``main()`` is called again in
this process; it restores the newest generation like the replacement does.

``run_resilient(main, prepare=build)``: ``build()`` runs once per process before the group is
joined (what needs no rank: the model and optimizer of a DDP script, on the CPU), and every call is
``main(build())``'s result, ``main(prepared)``. A survivor keeps what it built (the restore overwrites
it); under ``alpha-run --in-place --spares K`` a waiting spare runs the script up to ``build()``'s
return before any rank fails, then waits there for the rank it takes.

What is not a peer's death propagates as before: a :class:`~alpha_ckpt.Refusal`
or :class:`~alpha_ckpt.UsageError` at once, any other exception when the
launcher names no failure within :data:`PEER_FAILURE_GRACE_S` (the launcher
sees a death within milliseconds; a bug of this rank's own is raised after
that wait). Under plain torchrun, or alpha-run without ``--in-place``, it
joins the default group as ``dist.init_process_group(backend)`` does (under
alpha-run with ``--timeout`` as the group's timeout) and calls ``main()``
once: the same script runs everywhere.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable

from alpha_ckpt.errors import Refusal, UsageError
from alpha_ckpt.runtime import launch_env
from alpha_ckpt.runtime.launch_env import ROUND_KEY, joined_key, round_key

logger = logging.getLogger("alpha_ckpt")

# Every default group this process joined, kept until it exits (alpha-run's ranks leave by os._exit, without
# destructors). Otherwise the group dies with the last object holding it, DDP's Reducer freed as main()
# returns: ~ProcessGroupGloo joins its worker thread while this thread holds the GIL, and a worker still
# freeing a finished work's tensors waits for the GIL: both wait forever (seen with torch 2.13).
_JOINED_GROUPS: list = []
# Set by a spare that runs the script before it has a rank (alpha_ckpt.launch.inplace.spare_main): what
# run_resilient calls, once the script is prepared, to wait for the rank the spare takes.
_SPARE_HANDOFF: list[Callable[[], None]] = []
PEER_FAILURE_GRACE_S = 10.0  # how long a failed rank waits for the launcher to name a peer's failure
DEFAULT_TIMEOUT_S = 120.0  # alpha-run's --timeout default


def run_resilient(main: Callable[..., Any], *, backend: str | None = None,
                  prepare: Callable[[], Any] | None = None) -> Any:
    """Call ``main()`` in the default process group; under ``alpha-run --in-place`` again after a peer's
    death, in a new group of the launcher's next round (the module docstring). ``main()``'s result.

    ``prepare``: what the script can build before it has a rank (its model and optimizer where they do
    not depend on the rank, as in DDP; tensors on the CPU, since the device is bound by the rank). It is
    called once per process, before the process group is joined, and every call is then
    ``main(prepare())``'s result: ``main(prepared)``. Under ``alpha-run --in-place --spares K`` a waiting
    spare runs the script up to here, and ``prepare`` too, before any rank fails; a rank that fails is
    then taken by a process whose model is built. Without ``prepare`` a spare has imported torch only.
    """
    import torch.distributed as dist
    call: Callable[[], Any] = main
    if prepare is not None:
        launch_env.note_prepare()
        prepared = prepare()
        call = lambda: main(prepared)  # noqa: E731
    if _SPARE_HANDOFF:  # a spare: wait here, prepared, for the rank it takes (alpha_ckpt.launch.inplace)
        _SPARE_HANDOFF.pop()()
        launch_env.note_prepare()  # with its rank now
    control, timeout = launch_env.in_place_settings()
    if control is None:
        if not dist.is_initialized():
            seconds = launch_env.process_group_timeout()  # alpha-run's --timeout; torch's default elsewhere
            dist.init_process_group(backend, timeout=None if seconds is None else timedelta(seconds=seconds))
        _JOINED_GROUPS.append(dist.group.WORLD)
        return call()
    timeout = timeout or DEFAULT_TIMEOUT_S
    rounds = Rounds(control, timeout)
    rank, world = launch_env.rank_and_world()
    r = rounds.newest()
    notice = FailureNotice(control, timeout, r)
    while True:
        r = rounds.join(r, rank, world, backend)
        try:
            with notice.armed(r):
                return call()
        except (Refusal, UsageError):
            raise
        except Exception as exc:  # noqa: BLE001 - a peer's death reaches a script in many wrappers
            seen = time.monotonic()
            later = rounds.wait_beyond(r, min(PEER_FAILURE_GRACE_S, timeout))
            if later is None:
                raise
            logger.warning("rank %d: a peer failed (%s: %s); leaving round %d for round %d in this process",
                           rank, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "", r, later)
            exc = None  # noqa: F841 - its traceback holds the old round's objects (groups, a saver)
            severed = sever_connections_to(rounds.peer_pids(r, world, rank))
            logger.debug("rank %d: shut down %d connections to the old round's ranks", rank, severed)
        leave_groups()
        logger.info("rank %d: left round %d in %.3f s", rank, r, time.monotonic() - seen)
        r = later


class PeerFailed(RuntimeError):
    """Raised in ``main()``'s thread when alpha-run begins a new round while it runs: a peer died."""


class FailureNotice:
    """Tells ``main()`` at once that a peer died, instead of at its next collective.

    A thread follows the launcher's rounds (its own client of the control store, waiting
    without the GIL); when a round begins after the one ``main()`` runs in, it raises
    :class:`PeerFailed` in ``main()``'s thread, which Python delivers at the next bytecode (a
    rank computing alone, a forward pass or a data pipeline, stops within milliseconds, not at
    its next collective). Only while armed: never in run_resilient's own leaving and joining.
    What the exception interrupts is abandoned, as a crash would abandon it (the store's writes
    are crash-safe); C++ work (a backward pass, a collective) runs to its end or its error first.
    """

    def __init__(self, endpoint: str, timeout: float, first_round: int):
        from torch.distributed import TCPStore
        host, port = endpoint.rsplit(":", 1)
        self._control = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
        self._lock = threading.Lock()
        self._armed: tuple[int, int] | None = None  # (round, thread id) while main() runs
        self._next = first_round + 1
        threading.Thread(target=self._follow, name="alpha-ckpt-failure-notice", daemon=True).start()

    @contextmanager
    def armed(self, r: int):
        """While the block runs (``main()`` of round ``r``), a newer round raises :class:`PeerFailed` in it."""
        with self._lock:
            self._armed = (r, threading.get_ident())
        try:
            yield
        finally:
            with self._lock:
                armed, self._armed = self._armed, None
                if armed is not None:
                    _raise_in(armed[1], None)  # a notice not delivered yet is withdrawn

    def _follow(self) -> None:
        while True:
            try:
                self._control.wait([round_key(self._next)], timedelta(days=7))
            except Exception:  # noqa: BLE001 - the launcher is gone (the lifeline ends this process)
                return
            with self._lock:
                if self._armed is not None and self._armed[0] < self._next:
                    _raise_in(self._armed[1], PeerFailed)
                    self._armed = None
            self._next += 1


def _raise_in(thread_id: int, exc_type) -> None:
    """Raise ``exc_type`` in thread ``thread_id`` at its next bytecode (None: withdraw one not raised yet)."""
    import ctypes
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type is not None else None)


def leave_groups() -> None:
    """Destroy every process group of this process, then collect what held the old ones (a
    Checkpointer's finalizer joins its save thread and destroys its groups while the old ones are gone)."""
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as exc:  # a group a broken connection left half torn down
            logger.debug("process groups not destroyed cleanly: %s", exc)
    gc.collect()


def sever_connections_to(pids: set[int]) -> int:
    """Shut down every TCP connection between this process and the processes ``pids``; how many.

    A gloo group cannot be aborted, and the groups a rank leaves are kept alive (see _JOINED_GROUPS),
    so without this a survivor blocked in a collective with a peer that has already left waits for
    the group's whole timeout: the peer's end stays open and never answers. ``shutdown`` (not
    ``close``: the descriptors stay gloo's) makes both ends fail at once. Only connections whose
    other end one of ``pids`` holds are touched (found through /proc, Linux only): the launcher's
    control store and the script's own connections elsewhere stay open.
    """
    import socket
    own = _socket_inodes(os.getpid())
    theirs = set().union(*(_socket_inodes(pid) for pid in pids)) if pids else set()
    endpoints, inodes = _tcp_connections()
    severed = 0
    for inode, fd in own.items():
        if inode not in endpoints:
            continue
        local, remote = endpoints[inode]
        if inodes.get((remote, local)) not in theirs:  # the other end's socket, as that process holds it
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError:  # closed meanwhile
            continue
    return severed


def _socket_inodes(pid: int) -> dict[int, int]:
    """socket inode -> a descriptor of process ``pid`` holding it ({} when it cannot be read)."""
    out = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(fd)
    return out


def _tcp_connections() -> tuple[dict[int, tuple[str, str]], dict[tuple[str, str], int]]:
    """Every established TCP connection of this network namespace, both ways: socket inode -> (local,
    remote) endpoint, and (local, remote) -> socket inode."""
    endpoints: dict[int, tuple[str, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 10 and fields[3] == "01" and int(fields[9]):  # 01: ESTABLISHED
                endpoints[int(fields[9])] = (_v4(fields[1]), _v4(fields[2]))
    return endpoints, {pair: inode for inode, pair in endpoints.items()}


_V4_MAPPED = "0000000000000000FFFF0000"  # ::ffff:a.b.c.d as /proc/net/tcp6 prints it


def _v4(endpoint: str) -> str:
    """An IPv4-mapped IPv6 endpoint of /proc/net/tcp6 as /proc/net/tcp writes the IPv4 one, so the two
    ends of a connection between an IPv4 and an IPv6 socket match."""
    return endpoint[len(_V4_MAPPED):] if endpoint.startswith(_V4_MAPPED) else endpoint


class Rounds:
    """A rank's view of the launcher's rendezvous rounds: the control store's client."""

    def __init__(self, endpoint: str, timeout: float):
        from torch.distributed import TCPStore
        host, port = endpoint.rsplit(":", 1)
        self.host, self.timeout = host, timeout
        self.control = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))

    def newest(self) -> int:
        return int(self.control.get(ROUND_KEY).decode())

    def wait_beyond(self, r: int, seconds: float) -> int | None:
        """The newest round once one after ``r`` has begun, or None if none does within ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            newest = self.newest()
            if newest > r:
                return newest
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def peer_pids(self, r: int, world: int, rank: int) -> set[int]:
        """The processes of the other ranks that joined round ``r`` (each records its pid on joining)."""
        keys = [joined_key(r, other) for other in range(world) if other != rank]
        pids = set()
        for key in keys:
            if self.control.check([key]):
                pids.add(int(self.control.get(key).decode()))
        return pids

    def join(self, r: int, rank: int, world: int, backend: str | None) -> int:
        """Join round ``r``'s default group, or a newer round's if ``r``'s rendezvous closes first; the round joined.

        The environment is set as torchrun would set it for that round (MASTER_PORT,
        TORCHELASTIC_RESTART_COUNT), so what the script reads there describes its round.
        """
        import torch.distributed as dist
        from torch.distributed import TCPStore
        deadline = time.monotonic() + self.timeout
        while True:
            info = json.loads(self.control.get(round_key(r)).decode())
            launch_env.enter_round(info["port"], r)
            if r > 0 and info.get("detected_at") is not None:  # the Checkpointer's recovery event reads it
                launch_env.export_restart(attempt=r, detected_at=info["detected_at"], failed_rank=info.get("failed_rank"),
                                          failed_exit=info.get("exit"), resume="latest", started_at=time.time())
            left = max(1.0, deadline - time.monotonic())
            try:
                store = TCPStore(self.host, info["port"], world, is_master=False, timeout=timedelta(seconds=left))
                dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                        timeout=timedelta(seconds=self.timeout))
            except (RuntimeError, dist.DistError):
                # The launcher closes a round's store when a newer one begins (a rank died while the
                # group formed): join that one; anything else is this rank's failure.
                leave_groups()
                newer = self.wait_beyond(r, 0.0)
                if newer is None or time.monotonic() >= deadline:
                    raise
                r = newer
                continue
            _JOINED_GROUPS.append(dist.group.WORLD)
            self.control.set(joined_key(r, rank), str(os.getpid()))
            return r
