"""Which ranks came to a collective call of a Checkpointer: when the call fails, the ranks that did not are named.

A ``save`` or ``restore`` called on some ranks only (``if rank == 0: ckpt.save(...)``) waits in its
first collective for ranks that never come, until the group's timeout, or fails at once when one of
them leaves; either way gloo says only that a receive timed out or a connection closed. So each rank,
as it enters such a call, writes how many such calls it has entered on the group into the group's own
store (torch's rendezvous store for the group; one key per rank, overwritten, so nothing grows).
Nothing is waited for: when the call fails, the ranks whose count is behind this rank's are the ones
that did not come, and :class:`~alpha_ckpt.errors.CollectiveIncomplete` names them (the transport's
error as its cause). A call that fails with every rank present raises its own error unchanged.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch.distributed as dist

from alpha_ckpt.errors import CollectiveIncomplete, Refusal, UsageError

logger = logging.getLogger("alpha_ckpt")

# The group's store (by id, kept so that no other store takes its id) -> the calls this process entered on that
# group, all its Checkpointers together: calls are collective, so the counts agree across the group's ranks,
# and a group made anew (a rank recovering in place joins a new round's group and store) starts again at 0.
_entered: dict[int, list] = {}


def _group_store(group: Any):
    """torch's store of ``group`` (the default group's when None), or None where torch does not say."""
    try:
        from torch.distributed.distributed_c10d import _get_default_group, _get_process_group_store
        return _get_process_group_store(group if group is not None else _get_default_group())
    except Exception as exc:  # noqa: BLE001 - a private helper of torch's: without it, no ranks are named
        logger.debug("no store of the process group: %s", exc)
        return None


class Arrivals:
    """A Checkpointer's record of the collective calls it enters, in the group's store (the module docstring)."""

    def __init__(self, group: Any, rank: int, world: int):
        self.rank, self.world = rank, world
        self._store = _group_store(group)
        self._prefix = "alpha-ckpt/arrived/"

    def arrive(self) -> int:
        """This rank enters its next call on the group: the call's number, recorded for the others to read."""
        if self._store is None:
            return 0
        entry = _entered.setdefault(id(self._store), [self._store, 0])
        entry[1] += 1
        try:
            self._store.set(f"{self._prefix}{self.rank}", str(entry[1]))
        except Exception as exc:  # noqa: BLE001 - the store is gone: the call's own error will say so
            logger.debug("arrival not recorded: %s", exc)
        return entry[1]

    def missing(self, number: int) -> list[int]:
        """The ranks that had not entered call ``number`` (read without waiting), or [] when unknown."""
        if self._store is None:
            return []
        out = []
        try:
            for rank in range(self.world):
                key = f"{self._prefix}{rank}"
                if rank != self.rank and (not self._store.check([key]) or int(self._store.get(key)) < number):
                    out.append(rank)
        except Exception as exc:  # noqa: BLE001 - the store cannot be read (its host died): nothing named
            logger.debug("arrivals not read: %s", exc)
            return []
        return out

    @contextlib.contextmanager
    def named(self, call: str, number: int) -> Iterator[None]:
        """The block runs call ``number`` (or part of it, on another thread): if it fails while ranks have not
        come to it, :class:`CollectiveIncomplete` naming them is raised instead (from the error)."""
        try:
            yield
        except (Refusal, UsageError, CollectiveIncomplete):
            raise
        except Exception as exc:
            missing = self.missing(number)
            if missing:
                raise CollectiveIncomplete(call, missing, self.world, exc) from exc
            raise

    @contextlib.contextmanager
    def call(self, call: str) -> Iterator[int]:
        """This rank's next collective call ``call``, arrived at and named on failure; yields its number."""
        number = self.arrive()
        with self.named(call, number):
            yield number


def group_timeout(group: Any):
    """The timeout ``group`` (the default group when None) was made with, for the groups a Checkpointer adds
    (torch's ``new_group`` otherwise gives each its own default, 30 minutes), or None where torch does not say."""
    import torch
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - no default group
        return None
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception as exc:  # noqa: BLE001 - a private attribute of torch's: new_group's default then
            logger.debug("the group's timeout on %s is not known: %s", device, exc)
    return None
