"""Large hierarchies in one process: the real tree code over in-process mailboxes and a real store.

Every role owns ``words`` float32 words of one partitioned region; the root
also holds a small replicated region. :func:`publish` runs each role's
commit in reverse preorder (children before parents, as their messages need)
and then each role's completion in preorder; :func:`restore` opens each
role's path and restores its words, checking every value. Both record, per
role, what the seed's bounds are about: messages, bytes held, manifests read.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import blake3
import torch

from alpha_ckpt.format.records import CapturePrefix, RegionDecl
from alpha_ckpt.generation.planner import Hierarchy, Piece, WantedSlice
from alpha_ckpt.generation.reader import open_generation, restore_slices
from alpha_ckpt.store import Store
from alpha_ckpt.runtime.faults import FaultHooks, installed
from alpha_ckpt.tiers.durable.tree import MemoryTransport, TreeRole

REPLICATED_WORDS = 8


def regions(owners: int, words: int) -> tuple[RegionDecl, ...]:
    return (RegionDecl(0, "shared", "float32", (REPLICATED_WORDS,)), RegionDecl(1, "owned", "float32", (owners * words,)))


def owned_values(role: int, words: int) -> torch.Tensor:
    return torch.arange(role * words, (role + 1) * words, dtype=torch.float32)


SHARED = torch.arange(REPLICATED_WORDS, dtype=torch.float32) * 0.5


@dataclass
class Report:
    owners: int
    fanout: int
    height: int
    root: str | None
    completions_ok: int
    publish_seconds: float
    restore_seconds: float = 0.0
    levels: dict[int, dict[str, int]] = field(default_factory=dict)  # depth -> largest per-role figures

    def level(self, depth: int) -> dict[str, int]:
        return self.levels.setdefault(depth, {"roles": 0, "messages": 0, "bytes_held": 0, "manifests_read": 0,
                                              "objects_opened": 0})


def publish(store: Store, owners: int, fanout: int, *, words: int = 4, faults: dict[int, str] | None = None,
            run: str = "sim", update: int = 1) -> tuple[Report, list[dict]]:
    """Publish one generation with ``owners`` roles; returns the report and every role's completion."""
    faults = faults or {}
    hierarchy = Hierarchy(owners, fanout)
    decls = regions(owners, words)
    prefix = CapturePrefix(run, "fit", update, update * owners, 0)
    replicas = blake3.blake3(SHARED.numpy().tobytes()).hexdigest()
    net = MemoryTransport()
    started = time.perf_counter()
    completions: list[dict] = [{}] * owners
    depth: list[int] = [0] * owners
    roles: list[TreeRole | None] = [None] * owners
    with installed(FaultHooks(tree_faults=faults)), ThreadPoolExecutor(max_workers=2) as pool:
        at_root = None
        for r in reversed(range(owners)):
            role = TreeRole(store, hierarchy, r, net.endpoint(r), timeout=0.0, pool=pool)
            roles[r] = role
            own = owned_values(r, words)
            parts = [(Piece(1, r * words, (r + 1) * words, 4), memoryview(own.numpy()).cast("B"), "raw")]
            if r == 0:
                parts.insert(0, (Piece(0, 0, REPLICATED_WORDS, 4), memoryview(SHARED.numpy()).cast("B"), "raw"))
            result = role.commit(prefix, decls, [parts], replicas, {"sim": True} if r == 0 else None)
            if r == 0:
                at_root = result
        for r in range(owners):
            role = roles[r]
            completions[r] = role.complete(at_root if r == 0 else None)
            parent = role.parent
            depth[r] = 0 if parent is None else depth[parent] + 1
    report = Report(owners, fanout, hierarchy.height(), at_root.get("root") if at_root and at_root["ok"] else None,
                    sum(1 for c in completions if c.get("ok")), time.perf_counter() - started)
    for r, role in enumerate(roles):
        figures = report.level(depth[r])
        figures["roles"] += 1
        figures["messages"] = max(figures["messages"], role.stats.messages_sent + role.stats.messages_received)
        figures["bytes_held"] = max(figures["bytes_held"], role.stats.bytes_held)
        roles[r] = None
    return report, completions


def restore(store: Store, report: Report, *, words: int = 4) -> None:
    """Every role restores its own words (and the replicated ones) along its path; values are checked."""
    hierarchy = Hierarchy(report.owners, report.fanout)
    ref = next(r for r in store.list_refs("sim", "fit") if getattr(r, "root", None) == report.root)
    started = time.perf_counter()
    for r in range(report.owners):
        opened_before = store.objects_opened
        own, shared = torch.zeros(words), torch.zeros(REPLICATED_WORDS)
        with open_generation(store, report.root, ref, role=r) as generation:
            restore_slices(generation, [WantedSlice(0, 0, REPLICATED_WORDS, 0), WantedSlice(1, r * words, (r + 1) * words, 1)],
                           [shared.view(torch.uint8), own.view(torch.uint8)])
            manifests = len(generation.manifests)
        if not (torch.equal(own, owned_values(r, words)) and torch.equal(shared, SHARED)):
            raise AssertionError(f"role {r} restored other values")
        figures = report.level(len(hierarchy.path(r)) - 1)
        figures["manifests_read"] = max(figures["manifests_read"], manifests)
        figures["objects_opened"] = max(figures["objects_opened"], store.objects_opened - opened_before)
    report.restore_seconds = time.perf_counter() - started
