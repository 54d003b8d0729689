"""Garbage collection: stale temp files, generations beyond retention, objects no generation reaches.

    alpha-ckpt gc --store DIR [--keep K] [--grace SECONDS] [--dry-run]

Safe while a publish is in flight: a publish writes its objects before its
ref, so an object that no ref reaches yet may belong to it; objects and temp
files younger than ``grace`` seconds are never removed. Retention keeps the
``keep`` newest generations of every run/step (never fewer than two, so the
previous complete generation survives a failed publish); by default every
generation is kept and only unreachable objects and stale temp files go. If
a kept generation's manifests cannot be read, nothing it might reach can be
told apart, so no object is removed at all (temp files still are).

Planning (:func:`plan_gc`) only reads; :func:`apply_gc` removes each file
with unlink and then fsyncs its directory.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from .errors import Refusal, StoreUsageError
from .restore import open_generation
from .store import RefRecord, Store

DEFAULT_GRACE_S = 3600.0


@dataclass
class GcPlan:
    refs: list[RefRecord] = field(default_factory=list)      # generations beyond retention
    objects: list[str] = field(default_factory=list)          # unreachable and older than the grace period
    tmp: list[str] = field(default_factory=list)              # temp files older than the grace period
    kept_generations: int = 0
    reachable: int = 0
    unreadable: list[str] = field(default_factory=list)       # kept roots whose manifests could not be read

    def to_json(self) -> dict:
        return {"refs": [f"{r.run}/{r.step}/{r.generation}" for r in self.refs], "objects": len(self.objects),
                "tmp": len(self.tmp), "kept_generations": self.kept_generations, "reachable": self.reachable,
                "unreadable": self.unreadable}


def _age(path: str, now: float) -> float:
    try:
        return now - os.stat(path, follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return 0.0


def plan_gc(store: Store, *, keep: int | None = None, grace: float = DEFAULT_GRACE_S, now: float | None = None) -> GcPlan:
    if keep is not None and keep < 2:
        raise StoreUsageError(f"--keep {keep}: at least two generations are kept (the previous complete one "
                              "must survive a failed publish)")
    if grace < 0:
        raise StoreUsageError("--grace must not be negative")
    now = time.time() if now is None else now
    plan = GcPlan()
    kept: list[RefRecord] = []
    for run, step in store.runs():
        records = [r for r in store.list_refs(run, step) if isinstance(r, RefRecord)]
        cut = len(records) - keep if keep is not None else 0
        plan.refs += records[:max(0, cut)]
        kept += records[max(0, cut):]
    plan.kept_generations = len(kept)
    reachable: set[str] = set()
    for record in kept:
        try:
            with open_generation(store, record.root, record, wanted=[]) as generation:
                for manifest in generation.manifests:
                    reachable.add(manifest.digest)
                    reachable.update(s.digest for s in manifest.shards)
        except Refusal:
            plan.unreadable.append(record.root)
    plan.reachable = len(reachable)
    if not plan.unreadable:
        plan.objects = [d for d in store.iter_objects()
                        if d not in reachable and _age(store.object_path(d), now) >= grace]
    tmp_dir = os.path.join(store.root, "tmp")
    if os.path.isdir(tmp_dir):
        plan.tmp = sorted(n for n in os.listdir(tmp_dir) if _age(os.path.join(tmp_dir, n), now) >= grace)
    return plan


def _remove(directory: str, names: list[str]) -> None:
    if not names:
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in names:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
        os.fsync(fd)
    finally:
        os.close(fd)


def apply_gc(store: Store, plan: GcPlan) -> None:
    """Refs first (a generation disappears whole), then objects, then temp files."""
    by_dir: dict[str, list[str]] = {}
    for r in plan.refs:
        by_dir.setdefault(os.path.join(store.root, "refs", r.run, r.step), []).append(f"{r.generation:010d}")
    for d in plan.objects:
        by_dir.setdefault(os.path.dirname(store.object_path(d)), []).append(d)
    for directory, names in by_dir.items():
        _remove(directory, names)
    _remove(os.path.join(store.root, "tmp"), plan.tmp)
