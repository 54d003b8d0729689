"""Every rank observes every rank's refusal: one verdict, raised on every rank, before anyone copies a byte."""
from __future__ import annotations

import torch
import torch.distributed as dist

from alpha_ckpt.errors import Refusal, UsageError
from alpha_ckpt.tiers.durable.messages import UsageVerdict, Verdict
from alpha_ckpt.tiers.durable.wire import broadcast_json, global_rank, wire_device
from alpha_ckpt.runtime.teardown import exit_clean


def agree(refusal: Refusal | None, group=None) -> None:
    """Collective: if any rank refused, every rank raises the lowest-ranked refusing rank's refusal.

    Ranks are of ``group`` (default: the default group); its messages use gloo or the
    group's backend as the wire module does.
    """
    rank = dist.get_rank(group)
    said = _lowest_rank_says(None if refusal is None else
                             Verdict(refusal.code.value, f"rank {rank}: {refusal.message}").to_json(), group)
    if said is not None:
        verdict = Verdict.from_json(said)
        raise Refusal(verdict.code, verdict.message)


def agree_usage(error: UsageError | None, group=None) -> None:
    """Collective, as :func:`agree`: if any rank's call was bad usage, every rank raises the lowest-ranked such
    rank's :class:`UsageError` (the same message everywhere), so no rank goes on to a collective the others left."""
    rank = dist.get_rank(group)
    said = _lowest_rank_says(None if error is None else UsageVerdict(f"rank {rank}: {error}").to_json(), group)
    if said is not None:
        raise UsageError(UsageVerdict.from_json(said).message)


def _lowest_rank_says(message: dict | None, group) -> dict | None:
    """Collective: the message of the lowest-ranked rank that has one (the others pass None); None if no rank has."""
    exit_clean()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first = torch.tensor([rank if message is not None else world], dtype=torch.int64, device=wire_device(group))
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    src = int(first.item())
    if src == world:
        return None
    return broadcast_json(message if rank == src else None, global_rank(src, group), group)
