"""A script that checkpointed through alpha_ckpt and returned exits clean, whatever torch left running.

What aborts a finished script ("terminate called without an active exception", SIGABRT, after a
correct and published checkpoint): gloo runs every collective on worker threads of the process
group (``pt_gloo_runloop``), and a worker releases a finished collective's tensors on its own
thread, after the caller has seen the collective complete. A tensor whose Python object the
caller has already dropped (torch's own ``broadcast_object_list`` and DCP's plan exchange do)
is then released through the interpreter, under the GIL. If the interpreter starts finalizing
while such a worker waits for the GIL, Python ends that thread (``pthread_exit``) inside a C++
destructor, and the C++ runtime calls ``std::terminate``. A script that destroys its process
group does not escape it: a ``DeviceMesh`` (any DTensor, FSDP2) keeps its groups, and their
workers, alive past ``destroy_process_group()``. torch's own ``FileSystemWriter`` scripts abort
the same way (pytorch issue 190489).

:func:`exit_clean` (called on the first use of a Checkpointer, of alpha_ckpt's collectives and of
alpha_ckpt.dcp's writer and reader; never on import) registers one atexit handler that, while the
interpreter is still whole:

1. runs the closers registered with :func:`on_exit` (each Checkpointer's: its save thread joined,
   its own groups destroyed);
2. destroys the default process group if it is gloo and still initialized (the script is done
   with it; NCCL's teardown may need its peers, so an NCCL group is left to the script);
3. waits, with the GIL released, until every gloo worker thread of the process is idle
   (:func:`settle_gloo_workers`): a worker that still holds a finished collective's tensors gets
   the GIL and releases them now, and none is left to ask for it during finalization. Idle is read
   from Linux's ``/proc/self/task``: a worker blocked without a timeout on its queue's condition
   (a worker waiting for the GIL waits with one); elsewhere the GIL is only released a few times.
   The wait is bounded by :data:`SETTLE_LIMIT_S` (a worker stuck in a collective a dead peer never
   joins is not waited for longer).

Asynchronous saves in flight when the script returns are finished before any of this: Python
joins the thread pools' workers (alpha_ckpt's save thread, DCP's ``async_save`` executor) before
it runs atexit handlers. Under alpha-run the rank also ends with ``os._exit`` once the atexit
handlers have run (:func:`alpha_ckpt.launch.script_runner.exit_now`), so it never finalizes at all.
"""
from __future__ import annotations

import atexit
import os
import platform
import sys
import time
from typing import Callable

SETTLE_LIMIT_S = 2.0    # the most an exit waits for gloo's workers to go idle
SETTLE_POLL_S = 0.001   # the GIL is released this long between two looks at the workers
SETTLE_CLEAN_POLLS = 3  # consecutive looks that must find every worker idle

_WORKER_NAME = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())

_registered = False
_closers: list[Callable[[], object]] = []


def exit_clean() -> None:
    """Once per process: run :func:`leave_cleanly` at exit, while the interpreter is whole."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(leave_cleanly)


def on_exit(closer: Callable[[], object]) -> None:
    """Run ``closer`` (a ``weakref.finalize``: called once, then dead) at exit, before the default group
    is destroyed. Dead closers are dropped as new ones come."""
    exit_clean()
    _closers[:] = [c for c in _closers if getattr(c, "alive", True)]
    _closers.append(closer)


def leave_cleanly() -> None:
    """The atexit handler: closers, then the default gloo group, then gloo's workers settled."""
    closers, _closers[:] = list(_closers), []
    for closer in closers:
        try:
            closer()
        except Exception as exc:  # noqa: BLE001 - an exit goes on; the script's result is already out
            print(f"alpha_ckpt: at exit: {type(exc).__name__}: {exc}", file=sys.stderr)
    _leave_default_group()
    settle_gloo_workers()


def _leave_default_group() -> None:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    except (ImportError, RuntimeError, ValueError, AssertionError):  # nothing to leave
        pass


def settle_gloo_workers(limit_s: float = SETTLE_LIMIT_S) -> bool:
    """Release the GIL until every gloo worker thread of this process is idle (or ``limit_s`` passed).
    True when they all were idle (or there were none) on :data:`SETTLE_CLEAN_POLLS` consecutive looks."""
    deadline = time.monotonic() + limit_s
    clean = 0
    while clean < SETTLE_CLEAN_POLLS:
        time.sleep(SETTLE_POLL_S)  # the GIL is free: a worker waiting for it takes it now
        workers = _gloo_workers()
        if workers is None:  # no /proc/self/task: the GIL was released; that is all that can be done
            clean += 1
            continue
        clean = clean + 1 if all(_idle(tid) for tid in workers) else 0
        if clean < SETTLE_CLEAN_POLLS and time.monotonic() > deadline:
            return False
    return True


def _gloo_workers() -> list[str] | None:
    """The thread ids of this process's gloo workers; None where threads cannot be listed."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == _WORKER_NAME:
                    out.append(tid)
        except OSError:  # the thread ended meanwhile
            pass
    return out


def _idle(tid: str) -> bool:
    """Whether a worker is blocked waiting for work: asleep, in a futex wait without a timeout
    (its queue's condition; the GIL is waited for with one). A thread gone is idle."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "S":
                return False
    except (OSError, IndexError):
        return True
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:  # not readable here: asleep is the best that is known
        return True
    if len(fields) < 5 or not fields[0].isdigit():  # "running", or no arguments shown
        return False
    return (_FUTEX is None or int(fields[0]) == _FUTEX) and int(fields[4], 16) == 0
