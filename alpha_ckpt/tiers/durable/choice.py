"""Choosing the generations of the durable store a restore tries, in order, and checking each one's bindings.

Rank 0 decides what to try, in order (:meth:`Choice.candidates`): ``"latest"``
is the newest complete generation that is not stale, then the older ones
(unreadable refs and older epochs passed over); a digest is exactly that
generation of this run, or a refusal; None is a fresh start, refused
``fenced`` when the run already has history. Rank 0 checks each candidate's
bindings (:meth:`Choice.bound`) before any rank reads a shard. Under
``"latest"``, a generation that any rank finds damaged (:data:`DAMAGE`) makes
every rank fall back to the next older one together; a binding refused does
not (no older generation of the history would do either).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.generation.opening import open_generation
from alpha_ckpt.generation.reader import latest_order
from alpha_ckpt.state.device import check_devices
from alpha_ckpt.state.manifest import encode_identity, identity_matches
from alpha_ckpt.store import RefRecord, Store
from alpha_ckpt.tiers.durable.messages import Candidate, short

logger = logging.getLogger("alpha_ckpt")

# Refusals of a generation's bytes: under "latest" the next older generation is tried. Any other
# refusal (a binding, a destination that does not match) would refuse the older ones too.
DAMAGE = frozenset({RefusalCode.CORRUPT_SHARD, RefusalCode.MISSING_SHARD, RefusalCode.FORMAT, RefusalCode.COVERAGE,
                    RefusalCode.MIXED_CAPTURE, RefusalCode.NON_FINITE})


class Choice:
    """Rank 0's choice for one restore of ``run``/``step``; ``follows`` is the generation a save then continues."""

    def __init__(self, store: Store, run: str, step: str):
        self.store, self.run, self.step = store, run, step
        self.follows: int | None = None  # set once known (the history's top, or 0 for a new history)

    def candidates(self, root: Any, branch: bool = False) -> list[Candidate]:
        """What to try, newest first (none: a fresh start); a Refusal that stops the restore."""
        history = self.store.history(self.run, self.step)
        refs = history.listing()
        if branch:
            if refs:
                raise Refusal(RefusalCode.HISTORY_CONFLICT, f"cannot branch into {self.run}/{self.step}: that run "
                              "already has generations")
            self.follows = 0
            return [Candidate(root=self.store.check_digest(root))]
        if root is None:
            if refs:
                raise Refusal(RefusalCode.FENCED, f"a fresh start of {self.run}/{self.step} would fork its history: it "
                              f"already has {len(refs)} generations; restore 'latest', or use another run")
            self.follows = 0
            return []
        self.follows = history.top  # 0: an empty history; an unreadable newest ref's number stays taken
        newest_epoch = max((r.prefix.epoch for r in refs if isinstance(r, RefRecord)), default=0)
        if root != "latest":
            for r in refs:  # the stale-epoch check needs the whole history ("latest" passes over damaged refs)
                if isinstance(r, Refusal):
                    raise Refusal(r.code, f"the history of {self.run}/{self.step} cannot be checked: {r.message}")
            wanted = self.store.check_digest(root)
            record = next((r for r in refs if isinstance(r, RefRecord) and r.root == wanted), None)
            if record is None:
                raise Refusal(RefusalCode.FOREIGN_LEARNER, f"generation {root[:16]}... is not one of {self.run}/{self.step}")
            if record.prefix.epoch < newest_epoch:
                later = [r for r in refs if isinstance(r, RefRecord) and r.prefix.epoch == newest_epoch][-1]
                raise Refusal(RefusalCode.STALE_EPOCH, f"generation {root[:16]}... is of epoch {record.prefix.epoch}, "
                              f"but a continuation published generation {later.generation} ({later.root}, update "
                              f"{later.prefix.update}) in epoch {newest_epoch}; restore that one ('latest')")
            return [Candidate(root=record.root)]
        order = latest_order(history)  # latest's rule: unreadable refs and older epochs are passed over
        usable = [r for r in order if isinstance(r, RefRecord)]
        for bad in history.unreadable_above:
            logger.warning("restore latest of %s/%s: ref %s cannot be read and is passed over: %s",
                           self.run, self.step, bad.name, bad.refusal)
        if refs and not usable:
            raise Refusal(RefusalCode.MISSING_SHARD, f"no readable generation of {self.run}/{self.step} to resume")
        return [Candidate(root=r.root, epoch=r.prefix.epoch, update=r.prefix.update) for r in usable]

    def bound(self, root: str, *, identity: Any, bindings: Callable[[Any], None] | None, bind_devices: bool,
              device: Any) -> Candidate:
        """The candidate ``root``, or the refusal that stops the restore (a binding: no fallback past it)."""
        try:
            with open_generation(self.store, root, role=0, wanted=[]) as generation:
                manifest = generation.manifest
        except Refusal as refusal:  # damaged: under "latest", the next older generation is tried
            return Candidate.refused(refusal, binding=False)
        try:
            meta = manifest.metadata if isinstance(manifest.metadata, dict) else {}
            if not identity_matches(meta.get("identity"), identity):
                raise Refusal(RefusalCode.FOREIGN_LEARNER, f"generation {root[:16]}... was saved with identity "
                              f"{short(meta.get('identity'))}; this script binds {short(encode_identity(identity))}")
            if bindings is not None:
                bindings(manifest)
            devices = meta.get("devices") if isinstance(meta.get("devices"), list) else [None]
            if not bind_devices:
                check_devices(devices, [device] * len(devices), False)
        except Refusal as refusal:  # a binding: no older generation of this history would do either
            return Candidate.refused(refusal, binding=True)
        return Candidate(root=root, devices=meta.get("devices") if bind_devices else None)
