"""Every rank observes every rank's refusal: one verdict, raised on every rank, before anyone copies a byte."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import Refusal
from ..publish.messages import Verdict
from ..publish.wire import broadcast_json, global_rank, leave_groups_at_exit, wire_device


def agree(refusal: Refusal | None, group=None) -> None:
    """Collective: if any rank refused, every rank raises the lowest-ranked refusing rank's refusal.

    Ranks are of ``group`` (default: the default group); its messages use gloo or the
    group's backend as the wire module does.
    """
    leave_groups_at_exit()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first = torch.tensor([rank if refusal is not None else world], dtype=torch.int64, device=wire_device(group))
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    src = int(first.item())
    if src == world:
        return
    mine = Verdict(refusal.code.value, f"rank {rank}: {refusal.message}").to_json() if rank == src else None
    verdict = Verdict.from_json(broadcast_json(mine, global_rank(src, group), group))
    raise Refusal(verdict.code, verdict.message)
