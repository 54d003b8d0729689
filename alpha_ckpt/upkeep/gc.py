"""Garbage collection: stale temp files and leases, generations beyond retention, objects no generation reaches.

    alpha-ckpt gc --store DIR [--keep K] [--grace SECONDS] [--completed-steps] [--dry-run]

What stays:

- **Retention**: of every run/step, the ``keep`` newest *complete*
  generations and every generation newer than those. Complete is the one
  definition ``latest`` and ``--resume latest`` use too
  (:func:`alpha_ckpt.generation.reader.check_complete`: the ref reads back intact and
  every object validates fully, NaN/inf included), so gc never removes the
  newest generation that validates. gc remembers what it validated in
  ``STORE/verified/`` (:mod:`alpha_ckpt.upkeep.complete`) and re-hashes a generation
  only when one of its object files changed. At least two are kept, so the
  previous complete generation survives a failed publish. By default every
  generation is kept (and nothing is hashed).
  The generation ``latest`` names (:func:`alpha_ckpt.generation.reader.latest_order`,
  the same rule) is always kept.
- **Pins** (:mod:`alpha_ckpt.upkeep.pins`): a pinned generation stays whatever the
  retention, and does not count toward ``keep``. A pin taken after planning
  wins: each ref is renamed aside in its directory, the pins are read again,
  and the ref of a generation pinned by then goes back, and nothing it reaches
  is removed (a pin that finds its ref aside puts it back itself).
- **Unreadable refs** (:class:`alpha_ckpt.store.History`): set aside into
  ``quarantine/`` with a line naming each, once a newer ref keeps the
  numbering past it; the newest number stays in place, unreadable or not,
  and so does a ref the OS refused to read (it may pass). While one is in
  ``refs/``, what it reaches cannot be told, so no object is removed.
- **Completed steps** (``completed_steps``, off by default): once a run/step's
  declared output is published (``STORE/outputs/RUN/STEP/*.safetensors``),
  its checkpoints are internal scratch: every generation published before the
  newest output goes, pinned ones excepted. A run/step with a publish in
  flight is left alone.
- **Objects** reached by a kept or pinned generation; if one of their
  manifests cannot be read, nothing they might reach can be told apart, so no
  object is removed at all (temp files and leases still are).

Safe beside a publish, even with ``grace=0``: a publish writes its objects
before its ref, under a pending-publish lease (:mod:`alpha_ckpt.store.leases`).
gc reads the leases before the pins and refs, and spares every object and
temp file modified after ``protect_before``: the oldest live lease's start,
this gc's own start, and ``now - grace``, whichever is earliest, less a
clock slack. A publish that took its lease after gc read the leases writes
only younger objects; one that released it before had published its ref,
which gc then reads. An object reused by a publish has its time renewed, and
so has every object of a generation being pinned; to close the gap between
planning and removing, each object is first renamed aside into ``tmp/``, its
time read again there, and put back if it was renewed meanwhile (a renewal
after the rename finds it gone, and the publisher writes it again). A gc
killed between the two leaves ``tmp/aside-DIGEST-...``; the next gc puts it
back before anything else. A temp file whose writer (the pid its name starts
with) still runs on this host is never removed.

Entries that alpha_ckpt never writes where they are (a FIFO, directory or
symlink in pending/, pins/, tmp/ or under an object's name; a fan entry
under objects/ that is not a directory) are skipped, listed in
``GcPlan.skipped``, and never removed. What a save set aside in
``quarantine/`` (a damaged or hostile entry found under an object's name) is
removed once older than the grace period, by the time in its name.

Planning (:func:`plan_gc`) only reads; :func:`apply_gc` removes each file
with unlink and then fsyncs its directory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from alpha_ckpt.errors import Refusal, StoreUsageError
from alpha_ckpt.store.leases import CLOCK_SLACK_S, STALE_AFTER_S, lease_is_stale, writer_alive
from alpha_ckpt.upkeep.complete import remembered_check_complete, remembered_roots
from alpha_ckpt.upkeep.pins import pinned_roots
from alpha_ckpt.generation.reader import latest_order, open_generation
from alpha_ckpt.store import RefRecord, Store, UnreadableRef
from alpha_ckpt.store import sweep

DEFAULT_GRACE_S = 3600.0
@dataclass
class GcPlan:
    refs: list[RefRecord] = field(default_factory=list)      # generations beyond retention or of completed steps
    objects: list[str] = field(default_factory=list)          # unreachable and older than protect_before
    tmp: list[str] = field(default_factory=list)              # temp files older than protect_before, writer gone
    leases: list[str] = field(default_factory=list)           # stale leases in pending/
    kept_generations: int = 0
    reachable: int = 0
    pinned: int = 0
    live_leases: int = 0
    completed: list[str] = field(default_factory=list)        # run/step whose checkpoints completion discards
    records: list[str] = field(default_factory=list)          # verified/ records of generations no longer kept
    validated: int = 0                                        # generations whose bytes this gc hashed
    unreadable: list[str] = field(default_factory=list)       # kept roots whose manifests could not be read
    protect_before: float = 0.0                               # what was modified at or after this is spared
    quarantine: list[str] = field(default_factory=list)       # entries of quarantine/ older than the grace period
    skipped: list[str] = field(default_factory=list)          # "path: why" of entries that are not ours, left alone
    damaged_refs: list[UnreadableRef] = field(default_factory=list)  # unreadable refs to set aside into quarantine/
    unreadable_refs: list[str] = field(default_factory=list)  # "run/step/N: why" of unreadable refs left in place
    refs_aside: list[tuple[str, str, str]] = field(default_factory=list)  # (run, step, name) a killed gc set aside
    held_by_refs: list[str] = field(default_factory=list)     # unreadable refs (run/step/N) in place: no object removed

    def to_json(self) -> dict:
        return {"refs": [f"{r.run}/{r.step}/{r.generation}" for r in self.refs], "objects": len(self.objects),
                "tmp": len(self.tmp), "stale_leases": len(self.leases), "kept_generations": self.kept_generations,
                "reachable": self.reachable, "pinned": self.pinned, "live_leases": self.live_leases,
                "completed_steps": self.completed, "unreadable": self.unreadable,
                "validated": self.validated, "stale_records": len(self.records),
                "quarantine": len(self.quarantine), "skipped": self.skipped,
                "damaged_refs": [f"{u.name}: {u.refusal}" for u in self.damaged_refs],
                "unreadable_refs": self.unreadable_refs, "held_by_refs": self.held_by_refs}

    def skip(self, path: str, why: str) -> None:
        self.skipped.append(f"{path}: {why}; left as it is")


def _reach(store: Store, root: str, record: RefRecord | None) -> tuple[set[str], bool] | Refusal:
    """The objects a generation reaches, and whether every one of them is present; a refusal if unreadable."""
    try:
        with open_generation(store, root, record, wanted=[]) as generation:
            manifests = {m.digest for m in generation.manifests}
            shards = {s.digest for m in generation.manifests for s in m.shards}
    except Refusal as refusal:
        return refusal
    return manifests | shards, all(store.has_object(d) for d in shards)


def plan_gc(store: Store, *, keep: int | None = None, grace: float = DEFAULT_GRACE_S, now: float | None = None,
            completed_steps: bool | Mapping[tuple[str, str], float] = False,
            dropped_objects_only: bool = False, only: tuple[str, str] | None = None) -> GcPlan:
    """What gc would remove. ``completed_steps``: True for every run/step (each completed when its newest
    output file was written), or {(run, step): the time its output was published}. ``dropped_objects_only``: remove only objects that the dropped generations reached (a job
    discarding its own checkpoints), and leave temp files and leases alone. ``only``: ``keep`` drops
    generations of that one (run, step); every other is kept whole."""
    if keep is not None and keep < 2:
        raise StoreUsageError(f"--keep {keep}: at least two generations are kept (the previous complete one "
                              "must survive a failed publish)")
    if not (math.isfinite(grace) and grace >= 0):  # NaN compares false to everything: no object would be young
        raise StoreUsageError(f"--grace {grace}: a number of seconds, finite and not negative")
    ops = sweep.for_store(store)
    now = ops.now() if now is None else now
    plan = GcPlan()

    # Leases first: a publish that takes one after this point writes only objects younger than now.
    starts = [now - max(grace, CLOCK_SLACK_S)]
    busy: set[tuple[str, str]] = set()
    for name, lease, mtime in ops.read_leases(plan.skip):
        if lease is not None:
            if lease_is_stale(lease, now, grace):
                plan.leases.append(name)
            else:
                plan.live_leases += 1
                starts.append(lease.started_at - CLOCK_SLACK_S)
                busy.add((lease.run, lease.step))
        elif name.endswith(".tmp"):  # a lease being written
            if mtime < starts[0] and not writer_alive(name):
                plan.leases.append(name)
        elif now - mtime > max(grace, STALE_AFTER_S):
            plan.leases.append(name)
        else:  # unreadable: trusted as a live lease that started when the file was written
            plan.live_leases += 1
            starts.append(mtime - CLOCK_SLACK_S)
    plan.protect_before = min(starts)

    pins = pinned_roots(store, plan.skip)
    plan.pinned = len(pins)
    reaches: dict[str, tuple[set[str], bool] | Refusal] = {}

    def reach(root: str, record: RefRecord | None):
        if root not in reaches:
            reaches[root] = _reach(store, root, record)
        return reaches[root]

    completeness: dict[str, bool] = {}

    def is_complete(record: RefRecord) -> bool:
        if record.root not in completeness:
            refusal, hashed = remembered_check_complete(store, record)
            plan.validated += hashed
            completeness[record.root] = refusal is None
        return completeness[record.root]

    kept: list[RefRecord] = []
    for run, step in store.runs():
        history = store.history(run, step)
        records = history.records
        # What an unreadable ref reaches cannot be told apart, as for an unreadable manifest (below).
        plan.held_by_refs += [u.name for u in history.unreadable]
        if not dropped_objects_only:
            _plan_unreadable_refs(store, ops, history, plan)
        if only is not None and (run, step) != only:
            kept += records
            continue
        dropped: list[RefRecord] = []
        considered = completed_steps is True or (completed_steps and (run, step) in completed_steps)
        if considered and (run, step) not in busy:
            finished = (completed_steps[(run, step)] if isinstance(completed_steps, Mapping)
                        else ops.output_time(run, step))
            if finished is not None:
                done = [r for r in records if r.published_at <= finished and r.root not in pins]
                if done:
                    plan.completed.append(f"{run}/{step}")
                dropped += done
                records = [r for r in records if r not in done]
        complete = 0
        # latest's own choice (the one restore("latest") resumes) is never dropped by retention
        newest_complete = next((r for r in latest_order(history) if isinstance(r, RefRecord) and is_complete(r)),
                               None) if keep is not None else None
        for record in reversed(records):
            if record.root in pins or record == newest_complete:
                kept.append(record)
                if keep is not None and record.root not in pins:
                    complete += is_complete(record)
            elif keep is not None and complete >= keep:
                dropped.append(record)
            else:
                kept.append(record)
                if keep is not None:
                    complete += is_complete(record)
        plan.refs += sorted(dropped, key=lambda r: r.generation)
    plan.kept_generations = len(kept)

    reachable: set[str] = set()
    kept_roots = {r.root for r in kept}
    for root, record in [(r.root, r) for r in kept] + [(p, None) for p in sorted(pins - kept_roots)]:
        reached = reach(root, record)
        if isinstance(reached, Refusal):
            if root not in plan.unreadable:
                plan.unreadable.append(root)
        else:
            reachable |= reached[0]
    plan.reachable = len(reachable)
    if not dropped_objects_only:
        plan.records = [r for r in remembered_roots(store) if r not in kept_roots and r not in pins]
    candidates: Iterable[str] = store.iter_objects(plan.skip)
    if dropped_objects_only:
        plan.leases = []
        dropped_reach: set[str] = set()
        for record in plan.refs:
            reached = reach(record.root, record)
            if not isinstance(reached, Refusal):
                dropped_reach |= reached[0]
        candidates = sorted(dropped_reach)
    if not plan.unreadable and not plan.held_by_refs:
        plan.objects = [d for d in candidates
                        if d not in reachable and ops.object_mtime(d) < plan.protect_before]
    if not dropped_objects_only:
        plan.tmp = ops.old_tmp_files(plan.protect_before, plan.skip)
        plan.quarantine = ops.quarantined_before(now - grace, plan.skip)
    return plan


def _plan_unreadable_refs(store: Store, ops, history, plan: GcPlan) -> None:
    """Unreadable refs: set aside into quarantine/ those damaged for good that are not the newest number taken
    (a newer ref keeps the numbering past them); leave the rest in place, named. Refs a killed gc set aside
    go back."""
    for entry in history.unreadable:
        if entry.damaged and entry.generation < history.top:
            plan.damaged_refs.append(entry)
        else:
            why = ("its number is the newest taken, and stays taken until a newer generation is published"
                   if entry.damaged else "it may be readable later")
            plan.unreadable_refs.append(f"{entry.name}: {entry.refusal}; left in place: {why}")
    plan.refs_aside += ops.refs_aside(history.run, history.step)


def _remove_refs(store: Store, ops, refs: list[RefRecord]) -> set[str]:
    """Remove the refs of dropped generations, unless pinned by now. Returns the roots spared by a pin.

    A pin taken after planning wins: each ref is first renamed aside in its own
    directory (invisible to a pin, which then refuses, or rescues it: see
    :func:`alpha_ckpt.upkeep.pins.pin_generation`), the pins are read again, and a ref
    whose root is pinned by then is put back; only the rest are unlinked.
    """
    with ops.refs_set_aside(refs) as aside:
        return aside.finish(pinned_roots(store) if aside.entries else set())


def apply_gc(store: Store, plan: GcPlan) -> None:
    """Set-aside objects and refs back, then refs (a generation disappears whole) unless pinned by now,
    unreadable refs into quarantine/, objects (none a generation pinned since planning reaches), temp
    files, stale leases."""
    ops = sweep.for_store(store)
    with ops.object_sweep() as objects_sweep:
        objects_sweep.put_back_set_aside(plan.skip)
        ops.put_back_refs(plan.refs_aside)
        spared = _remove_refs(store, ops, plan.refs)
        for entry in plan.damaged_refs:
            store.set_aside_ref(entry.run, entry.step, entry.generation)
        objects = plan.objects
        if spared:
            keep: set[str] = set()
            for r in plan.refs:
                if r.root in spared:
                    reached = _reach(store, r.root, r)
                    if isinstance(reached, Refusal):
                        objects = []  # what it reaches cannot be told apart: remove no object
                        break
                    keep |= reached[0]
            objects = [d for d in objects if d not in keep]
        if objects:
            objects_sweep.remove_objects(objects, plan.protect_before)
    ops.remove_tmp_files(plan.tmp)
    ops.remove_verified_records(plan.records)
    ops.remove_leases(plan.leases)
    ops.remove_quarantined(plan.quarantine)


def retain_newest(store: Store, run: str, step: str, keep: int) -> GcPlan:
    """A job's own retention: keep the ``keep`` newest complete generations of ``run``/``step`` (pins
    and anything newer than the K-th complete one too) and remove the rest, with only the objects
    nothing kept reaches. "Complete" is gc's (and latest's) definition; what it validated is
    remembered, so each generation is hashed once. Leases protect every publish in flight."""
    plan = plan_gc(store, keep=keep, grace=0.0, only=(run, step), dropped_objects_only=True)
    apply_gc(store, plan)
    return plan


def discard_completed_step(store: Store, run: str, step: str, finished_at: float) -> GcPlan:
    """Once ``run``/``step`` published its declared output, remove its checkpoints (pins excepted).

    Checkpoints are the step's scratch, not its output. Only objects those
    generations reached and nothing kept or pinned reaches are removed, and
    none that a live publish may be writing or reusing (the leases).
    """
    # The caller's clock, read after the output was published: a file's mtime is kernel-tick
    # coarse and can fall before a ref's published_at written in the same tick.
    plan = plan_gc(store, grace=0.0, completed_steps={(run, step): finished_at}, dropped_objects_only=True)
    apply_gc(store, plan)
    return plan
