"""One ``recovered`` event per recovery: which tier and root the state came from, the bytes from peers
and from the store, and where the seconds went.

A restarted rank learns from alpha-run when the failure was detected (:func:`alpha_ckpt.runtime.launch_env.
restart_context`). The clock then has five marks: the detection, this process's start, the
Checkpointer's construction (imports, the process group and the model were built by then), the end of
the restore, and the end of the first step after it, which is when the script next calls ``save`` or
``due``. The time from the failure itself to its detection is the launcher's polling interval
and is not measured here.
"""
from __future__ import annotations

import io
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from alpha_ckpt.runtime.progress import emit, format_bytes, is_tty


class RecoveryClock:
    """Rank-local marks of one recovery; rank 0 emits the event once the first step is done."""

    def __init__(self, context: Any):
        self.context = context                      # launch_env.RestartContext, or None: not a restart
        self.created_at = time.time()
        self.fields: dict | None = None             # set by restored(), until first_step() emits
        self.last: dict | None = None               # the last recovery's event fields

    def restored(self, counters: Any, last_restore: dict | None, restore_s: float, group: Any) -> None:
        """Collective (every rank of a restart calls it at the end of its restore): sum the bytes."""
        if self.context is None:
            return
        read = last_restore or {}
        sums = torch.tensor([int(read.get("bytes_from_peers", 0)), int(read.get("bytes_from_store", 0))],
                            dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            sums = sums.cuda()
        dist.all_reduce(sums, group=group)
        c = self.context
        now = time.time()
        self.fields = {
            "attempt": c.attempt, "failed_rank": c.failed_rank,
            "tier": read.get("tier") if counters is not None else None,
            "root": counters.root if counters is not None else None,
            "update": counters.update if counters is not None else None,
            "bytes_from_peers": int(sums[0].item()), "bytes_from_store": int(sums[1].item()),
            "restart_s": round(c.process_started_at - c.detected_at, 6),
            "rendezvous_s": round(self.created_at - c.process_started_at, 6),
            "restore_s": round(restore_s, 6), "restored_at": now}
        self.context = None  # one recovery per process start

    def first_step(self, run: str, step: str, rank: int, announce: bool) -> None:
        """The script's first ``save``/``due`` after the restore: the first step is done; emit once."""
        if self.fields is None:
            return
        fields, self.fields = self.fields, None
        now = time.time()
        restored_at = fields.pop("restored_at")
        fields.update(run=run, step=step, first_step_s=round(now - restored_at, 6),
                      total_s=round(now - restored_at + fields["restore_s"] + fields["rendezvous_s"]
                                    + fields["restart_s"], 6))
        self.last = fields
        if not announce or rank != 0:
            return
        if is_tty(sys.stderr):
            line = (f"alpha-run: recovered {run}/{step} update {fields['update']} from {fields['tier']} in "
                    f"{fields['total_s']:.2f} s after the failure was seen ({format_bytes(fields['bytes_from_peers'])} "
                    f"from peers, {format_bytes(fields['bytes_from_store'])} from the store)\n")
        else:
            buffer = io.StringIO()
            emit("recovered", buffer, **fields)
            line = buffer.getvalue()
        os.write(sys.stderr.fileno(), line.encode("utf-8", "replace"))
