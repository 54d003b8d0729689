"""Preparing this rank's part of the generation a restore resumes, and saying what a save or restore did.

Which generations a restore tries is each tier's ``newest`` (the store's:
:class:`alpha_ckpt.tiers.durable.choice.Choice`); this module validates one on every rank before any rank
copies a byte (:func:`plan_prepare`, :func:`prepare_planned`) and announces the result.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
import logging
import os
import sys
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.generation.planner import WantedSlice, owners_holding
from alpha_ckpt.runtime.progress import emit, format_bytes, is_tty
from alpha_ckpt.generation.opening import Opening, open_planned, plan_opening, records_holding
from alpha_ckpt.generation.reader import Counters, open_generation, prepare_fill
from alpha_ckpt.state.load import plan_load
from alpha_ckpt.state.rules import recorded_per_rank
from alpha_ckpt.store import Store
from alpha_ckpt.collective.schedule import save_event_fields

logger = logging.getLogger("alpha_ckpt")

@dataclass(frozen=True)
class Preparing:
    """What this rank restores (the load plan), and the shards it opens
    (:class:`alpha_ckpt.generation.opening.Opening`); nothing opened yet."""
    root: str
    plan: Any
    opening: Opening

    def objects(self) -> list[tuple[str, int]]:
        return self.opening.objects()


def plan_prepare(store: Store, state: Mapping[str, Any], root: str, *, rank: int, world: int, per_rank: str,
                 allow_optimizer_change: Sequence[tuple[str, str]] = ()) -> Preparing:
    """Match ``state`` to generation ``root`` and choose the shards this rank reads (reading manifests only)."""
    what = f"generation {root[:16]}..."
    with open_generation(store, root, role=0, wanted=[]) as head:  # the root manifest: the skeleton
        manifest, ref = head.manifest, head.ref
    if manifest.state is None:
        raise Refusal(RefusalCode.FORMAT, f"{what} records no state skeleton (it was not written by save)")
    plan, wanted = _plan(state, manifest, rank=rank, world=world, per_rank=per_rank,
                         allow_optimizer_change=allow_optimizer_change)
    # A tree: only the group manifests on the paths to the roles that hold this rank's words.
    opening = plan_opening(store, root, ref, role=lambda m: roles_holding(m, wanted), wanted=wanted,
                           manifest=manifest)  # the ref as found above: the history is not walked again
    return Preparing(root, plan, opening)


def prepare_planned(store: Store, preparing: Preparing, open_objects=None):
    """This rank's part, from :func:`plan_prepare`'s: open the shards (through ``open_objects``, default the
    store's) and validate what this rank reads.

    Returns (fill, counters, what was read): ``fill(go=True)`` copies (``go=False`` releases
    what was validated, copying nothing), then closes the generation."""
    root, plan, manifest = preparing.root, preparing.plan, preparing.opening.manifest
    what = f"generation {root[:16]}..."
    generation = open_planned(store, preparing.opening, open_objects)
    try:
        fill = prepare_fill(generation, plan, what)
    except BaseException:
        generation.close()
        raise
    p = manifest.prefix
    read = {"root": root, "bytes_read": fill.bytes_read, "shards": len(generation.shards),
            "manifests": len(generation.manifests), "published": generation.ref.bytes if generation.ref else None}

    def fill_and_close(go: bool = True) -> None:
        try:
            if go:
                fill()
        finally:
            generation.close()
    return fill_and_close, Counters(p.run, p.step, p.update, p.cursor, p.epoch, manifest.metadata, root), read


def _plan(state: Mapping[str, Any], manifest, *, rank: int, world: int, per_rank: str,
          allow_optimizer_change: Sequence[tuple[str, str]] = ()):
    """What this rank restores of the generation ``manifest`` heads: the load plan and the words it wants."""
    plan = plan_load(state, manifest.state, manifest.regions, rank=rank, world=world,
                     per_rank=per_rank, per_rank_entries=recorded_per_rank(manifest.metadata),
                     allow_optimizer_change=allow_optimizer_change)
    return plan, [WantedSlice(o, lo, hi, i) for i, (o, _, lo, hi) in enumerate(plan.targets)]


def shards_read(state: Mapping[str, Any], manifest, *, rank: int, world: int, per_rank: str,
                allow_optimizer_change: Sequence[tuple[str, str]] = ()) -> set[str]:
    """The shards (digests) a restore of a star generation reads on this rank: those holding a word it
    restores. Empty when the state does not match the generation (the restore then refuses as it would)."""
    if manifest.state is None:
        return set()
    try:
        _, wanted = _plan(state, manifest, rank=rank, world=world, per_rank=per_rank,
                          allow_optimizer_change=allow_optimizer_change)
    except Refusal:
        return set()
    return {r.digest for r in records_holding(manifest.shards, wanted)}


def roles_holding(manifest, wanted: Sequence[WantedSlice]) -> list[int] | None:
    """The saved roles whose shards hold the ``wanted`` words, by the root manifest's layout (None: all)."""
    meta = manifest.metadata if isinstance(manifest.metadata, dict) else {}
    layout = meta.get("layout")
    if not isinstance(layout, dict) or layout.get("rule") != "shares":
        return None
    try:
        partitioned = {int(o) for o in layout["partitioned"]}
        own = {int(o): int(r) for o, r in layout["own"]}
    except (KeyError, TypeError, ValueError):
        return None
    roles = {0}
    for w in wanted:
        if w.ordinal in partitioned and w.ordinal < len(manifest.regions):
            roles.update(owners_holding(manifest.regions[w.ordinal].words, manifest.owners, w.lo, w.hi))
        elif w.ordinal in own:
            roles.add(own[w.ordinal])
    return sorted(r for r in roles if 0 <= r < manifest.owners) if manifest.owners else None


def announce(run: str, step: str, counters: Counters | None, bytes_read: int, rank: int, group: Any, *,
             memory_skipped: list[str] | None = None) -> None:
    """Collective: one line from rank 0 saying what the script resumed from (update, root, bytes read
    by every rank) or that it starts fresh, and which memory generations it passed over and why. A
    terminal gets words, a log collector one JSON event."""
    read = torch.tensor([bytes_read if counters is not None else 0], dtype=torch.int64)
    if counters is not None:  # the same branch on every rank: they all restored, or none did
        if dist.get_backend(group) == "nccl":
            read = read.cuda()
        dist.all_reduce(read, group=group)
    if rank != 0:
        return
    fields = {"run": run, "step": step}
    if counters is not None:
        fields.update(update=counters.update, root=counters.root, bytes_read=int(read.item()))
    if memory_skipped:
        fields["memory_skipped"] = list(memory_skipped)
    if is_tty(sys.stderr):
        line = (f"alpha-run: {run}/{step} restored update {counters.update} from {counters.root} "
                f"({format_bytes(fields['bytes_read'])} read)" if counters is not None else
                f"alpha-run: {run}/{step} starts fresh (no generation to resume)")
    else:
        buffer = io.StringIO()
        emit("restored" if counters is not None else "fresh_start", buffer, **fields)
        line = buffer.getvalue().rstrip("\n")
    os.write(sys.stderr.fileno(), (line + "\n").encode("utf-8", "replace"))  # one write: ranks share stderr


def announce_save(run: str, step: str, update: int, tier: str, result: Any, cost_s: float,
                  memory_skipped: str | None = None) -> None:
    """Rank 0 of an alpha-run script, after each save: one ``checkpoint_saved`` JSON event saying which tier
    it went to (a log collector's; a terminal gets none: a line per save would bury the script's own)."""
    if is_tty(sys.stderr):
        return
    root = result.root if result.done() else None  # an asynchronous save's root is not known yet
    buffer = io.StringIO()
    fields = save_event_fields(run, step, update, root, tier, cost_s)
    if memory_skipped:
        fields["memory_skipped"] = memory_skipped  # the memory copy did not stand: why (the save is durable)
    emit("checkpoint_saved", buffer, **fields)
    os.write(sys.stderr.fileno(), buffer.getvalue().encode("utf-8", "replace"))
