"""Test hooks, in one place: the only code that reads them from the environment or builds them.

- ``ALPHA_CKPT_KILL_OWNER=RANK:UPDATE``: that owner of the job SIGKILLs itself right after
  training that update (:func:`after_update`).
- ``ALPHA_CKPT_TREE_FAULT=RANK:FAULT``: that owner's tree publication misbehaves as FAULT
  (:func:`tree_tamper`, one of :data:`TREE_FAULTS`); the tree simulation uses the same tampers.

The product path holds only the call sites: a publication role may be given a ``tamper``
(called on each message it sends up the tree) and nothing else. The durable commit's named
fault points (``ALPHA_CKPT_FAULT``) belong to the durability contract and live with it
(:func:`alpha_ckpt.durable.fault_point`). Nothing in :mod:`alpha_ckpt.collective` imports this.
"""
from __future__ import annotations

import copy
import os
import signal
from typing import Callable

KILL_ENV = "ALPHA_CKPT_KILL_OWNER"
TREE_FAULT_ENV = "ALPHA_CKPT_TREE_FAULT"
TREE_FAULTS = ("kill-before-commit", "withhold-commit", "wrong-prefix", "extra-role", "wrong-role")


def tree_tamper(fault: str | None) -> Callable[[dict], dict | None] | None:
    """A role's misbehaviour: die before sending up, stay silent (None), or send a commitment its parent
    must refuse (another prefix, one role too many in the subtree, another role)."""
    if fault is None:
        return None
    if fault not in TREE_FAULTS:
        raise ValueError(f"unknown tree fault {fault!r}; known: {', '.join(TREE_FAULTS)}")

    def tamper(message: dict) -> dict | None:
        if fault == "kill-before-commit":
            os.kill(os.getpid(), signal.SIGKILL)
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


def tree_fault_of(rank: int) -> Callable[[dict], dict | None] | None:
    """The tamper ``ALPHA_CKPT_TREE_FAULT`` gives owner ``rank``, if any."""
    where, _, fault = os.environ.get(TREE_FAULT_ENV, "").partition(":")
    return tree_tamper(fault) if fault and where == str(rank) else None


def after_update(rank: int, update: int) -> None:
    if os.environ.get(KILL_ENV) == f"{rank}:{update}":
        os.kill(os.getpid(), signal.SIGKILL)
