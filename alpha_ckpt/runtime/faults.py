"""Fault and kill points for tests: the hooks (:mod:`alpha_ckpt.runtime.hooks`) and the environment that installs them.

Three environment variables, read only here, and only in a process that called
:func:`install_from_environment` (the built-in job's owners, the script runner alpha-run starts per
rank, and the ``alpha-ckpt`` command do so as they start):

- ``ALPHA_CKPT_FAULT=KIND:POINT[:RANK]``: SIGKILL the process (with RANK, only the owner whose
  ``RANK``, as torchrun sets it, matches) at that fault point: a stage of a durable commit
  (KIND ``object``, ``ref``, ``output``, ``export``, ``lease``, ``pin`` or ``*``; POINT one of
  :data:`alpha_ckpt.store.durable.FAULT_POINTS`; on an S3 store, KIND ``object`` or ``ref`` and POINT one of
  :data:`alpha_ckpt.store.s3.S3_FAULT_POINTS`) or ``publish:before-completion`` (an owner dies holding
  the durable-completion acknowledgment).
- ``ALPHA_CKPT_KILL_OWNER=RANK:UPDATE[:ATTEMPT]``: that owner of the job SIGKILLs itself right after
  training that update (with ATTEMPT, only in that attempt: torch's restart count, 0 the first).
- ``ALPHA_CKPT_TREE_FAULT=RANK:FAULT``: that owner's tree publication misbehaves as FAULT (one of
  :data:`TREE_FAULTS`, see :func:`tree_tamper`); the tree simulation uses the same tampers.

In-process tests install :class:`FaultHooks` (a callable at every fault point, a tamper per role)
with :func:`installed`, which puts back what was there before.
"""
from __future__ import annotations

import contextlib
import copy
import os
import signal
from typing import Callable, Iterator, Mapping

from alpha_ckpt.runtime import hooks
from alpha_ckpt.runtime.hooks import Hooks
from alpha_ckpt.runtime.launch_env import restart_attempt

FAULT_ENV = "ALPHA_CKPT_FAULT"
KILL_ENV = "ALPHA_CKPT_KILL_OWNER"
TREE_FAULT_ENV = "ALPHA_CKPT_TREE_FAULT"
TREE_FAULTS = ("kill-before-commit", "withhold-commit", "wrong-prefix", "extra-role", "wrong-role")


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def tree_tamper(fault: str | None) -> Callable[[dict], dict | None] | None:
    """A role's misbehaviour: die before sending up, stay silent (None), or send a commitment its parent
    must refuse (another prefix, one role too many in the subtree, another role)."""
    if fault is None:
        return None
    if fault not in TREE_FAULTS:
        raise ValueError(f"unknown tree fault {fault!r}; known: {', '.join(TREE_FAULTS)}")

    def tamper(message: dict) -> dict | None:
        if fault == "kill-before-commit":
            _kill()
        if fault == "withhold-commit":
            return None  # alive, but silent: the parent's timeout must end the publication
        if message.get("kind") != "commit":
            return message
        altered = copy.deepcopy(message)
        if fault == "wrong-prefix":
            altered["prefix"]["update"] += 1
        elif fault == "extra-role":
            altered["record"]["size"] += 1
        else:  # wrong-role
            altered["record"]["role"] += 1
        return altered
    return tamper


class FaultHooks(Hooks):
    """``fault(kind, point)`` called at every fault point; role -> tree fault (:data:`TREE_FAULTS`)."""

    def __init__(self, fault: Callable[[str, str], None] | None = None, tree_faults: Mapping[int, str] | None = None):
        self._fault = fault
        self._tampers = {role: tree_tamper(name) for role, name in (tree_faults or {}).items()}

    def fault(self, kind: str, point: str) -> None:
        if self._fault is not None:
            self._fault(kind, point)

    def tamper(self, role: int, message: dict) -> dict | None:
        tamper = self._tampers.get(role)
        return message if tamper is None else tamper(message)


class EnvironmentFaults(Hooks):
    """The hooks the environment variables ask for, read at each point (as a test may set them late)."""

    def fault(self, kind: str, point: str) -> None:
        wanted = os.environ.get(FAULT_ENV)
        if wanted:
            want_kind, _, rest = wanted.partition(":")
            want_point, _, want_rank = rest.partition(":")
            if want_point == point and want_kind in (kind, "*") and want_rank in ("", os.environ.get("RANK", "0")):
                _kill()

    def tamper(self, role: int, message: dict) -> dict | None:
        where, _, fault = os.environ.get(TREE_FAULT_ENV, "").partition(":")
        tamper = tree_tamper(fault) if fault and where == str(role) else None
        return message if tamper is None else tamper(message)

    def after_update(self, rank: int, update: int) -> None:
        wanted = os.environ.get(KILL_ENV, "")
        if wanted in (f"{rank}:{update}", f"{rank}:{update}:{restart_attempt()}"):
            _kill()


def install_from_environment() -> bool:
    """Install :class:`EnvironmentFaults` if any of the variables is set; True if it did."""
    if any(os.environ.get(name) for name in (FAULT_ENV, KILL_ENV, TREE_FAULT_ENV)):
        hooks.install(EnvironmentFaults())
        return True
    return False


@contextlib.contextmanager
def installed(test_hooks: Hooks) -> Iterator[Hooks]:
    """``test_hooks`` installed for the block, then the previous hooks again."""
    previous = hooks.install(test_hooks)
    try:
        yield test_hooks
    finally:
        hooks.install(previous)
