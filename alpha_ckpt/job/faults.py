"""The job's test hooks, in one place: the only code that reads them from the environment.

- ``ALPHA_CKPT_KILL_OWNER=RANK:UPDATE``: that owner SIGKILLs itself right after training that update.
- ``ALPHA_CKPT_TREE_FAULT=RANK:FAULT``: that owner's tree publication misbehaves as FAULT
  (see :data:`alpha_ckpt.publish.tree.FAULTS`).

The durable commit's named fault points (``ALPHA_CKPT_FAULT``) belong to the durability
contract and live with it (:func:`alpha_ckpt.durable.fault_point`).
"""
from __future__ import annotations

import os
import signal

KILL_ENV = "ALPHA_CKPT_KILL_OWNER"
TREE_FAULT_ENV = "ALPHA_CKPT_TREE_FAULT"


def tree_fault(rank: int) -> str | None:
    where, _, fault = os.environ.get(TREE_FAULT_ENV, "").partition(":")
    return fault if fault and where == str(rank) else None


def after_update(rank: int, update: int) -> None:
    if os.environ.get(KILL_ENV) == f"{rank}:{update}":
        os.kill(os.getpid(), signal.SIGKILL)
