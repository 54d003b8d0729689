"""Reading a generation: validate everything needed, then copy by a plan.

Order (a refusal at any step leaves the destination tensors untouched and the
store unmodified):

1. the root manifest: name, size, digest, header;
2. every shard head it names: presence, size, digest, format, capture prefix,
   schema, word ranges; then coverage of every region on word ranges;
3. every payload slice the plan reads: BLAKE3, zstd bounds, zero padding,
   finiteness of floating-point words;
4. only then the copies, straight from the mapped file into the destination.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from alpha_ckpt.generation.destinations import check_destinations, check_tied_saved_alike, destination_layouts
from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.runtime.heap import cyclic_gc_paused
from alpha_ckpt.format.records import DTYPES
from alpha_ckpt.generation.opening import Generation, open_generation  # noqa: F401 (re-exported: imported from here)
from alpha_ckpt.generation.payloads import (  # noqa: F401 (re-exported: imported from here)
    Payloads, check_payloads, check_zero_padding, decode_slice, payload_bytes, read_span, validate_object_bytes,
    validate_object_file,
)
from alpha_ckpt.generation.planner import PlanError, WantedSlice, plan_restore
from alpha_ckpt.state.load import plan_load
from alpha_ckpt.store import History, RefRecord, Store, UnreadableRef

# Slices are viewed straight from a read-only mapping of the object file and
# only ever read; torch warns about any read-only buffer, so silence exactly that.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=r"alpha_ckpt\.")


@dataclass(frozen=True)
class Counters:
    """What a restore returns: the capture prefix and the user's metadata."""

    run: str
    step: str
    update: int
    cursor: int
    epoch: int
    metadata: Any
    root: str


def verify_generation(store: Store, root: str) -> Generation:
    """Full validation of every object of a generation. Returns the (closed) generation on success."""
    with open_generation(store, root) as generation:
        check_payloads(generation)
    return generation


def _flat_destination(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes to fill, tensor to copy back into t or t itself when it can be filled in place)."""
    if t.numel() == 0:  # nothing to fill (NumPy's empty arrays have zero strides, which view() refuses)
        return torch.empty(0, dtype=torch.uint8), t
    if t.is_contiguous() and t.device.type == "cpu":
        return t.detach().reshape(-1).view(torch.uint8), t
    staging = torch.empty(t.shape, dtype=t.dtype)
    return staging.reshape(-1).view(torch.uint8), staging


class PreparedRestore:
    """Every slice a restore reads, validated and held (views of the mapped files); nothing copied yet.

    Distributed owners each prepare their own part, agree on the verdict, and
    only then :meth:`copy_into` their tensors: no owner copies a byte of a
    generation that any owner refused.
    """

    def __init__(self, generation: Generation, wanted: Sequence[WantedSlice], *,
                 advance: Callable[[int], None] | None = None):
        self.generation = generation
        try:
            self.plan = plan_restore(generation.saved_slices(), wanted)
        except PlanError as exc:
            regions = generation.manifest.regions
            named = repr(regions[exc.ordinal].name) if exc.ordinal < len(regions) else f"ordinal {exc.ordinal}"
            raise Refusal(RefusalCode.COVERAGE, f"generation {generation.root[:16]}...: region {named} word "
                          f"{exc.word} is not saved") from None
        self._payloads = Payloads(generation.shards, generation.manifest.regions)
        self._spans = read_spans(generation, self.plan.copies)
        self._raws = self._payloads.decode(list(self._spans), advance=advance, spans=self._spans)

    @property
    def bytes_read(self) -> int:
        """Stored bytes validated (what the restore read of the shards' payloads): whole slices, or
        the blocks that hold the words it restores."""
        return sum(b - a for a, b in self._spans.values())

    def copy_into(self, targets: Sequence[torch.Tensor]) -> None:
        """Fill ``targets[w.dest]`` (flat uint8, exactly words [lo, hi) of its region) by the plan."""
        _copy_by_plan(self.plan, self.generation, self._raws, targets)
        self.release()

    def release(self) -> None:
        self._raws.clear()
        self._payloads.release()


def read_spans(generation: Generation, copies) -> dict[tuple[str, int], tuple[int, int]]:
    """For each saved slice the copies read from, the stored bytes [a, b) to read and verify (pure)."""
    words: dict[tuple[str, int], tuple[int, int]] = {}
    for c in copies:
        key = (c.source, c.index)
        lo, hi = words.get(key, (c.src_word, c.src_word + c.words))
        words[key] = (min(lo, c.src_word), max(hi, c.src_word + c.words))
    out = {}
    for (digest, index), (lo, hi) in words.items():
        rec = generation.shards[digest][1].slices[index]
        size = DTYPES[rec.dtype][0]
        out[(digest, index)] = read_span(rec, lo * size, hi * size)
    return out


def restore_slices(generation: Generation, wanted: Sequence[WantedSlice], targets: Sequence[torch.Tensor]) -> None:
    """Validate every saved slice the plan reads, then fill ``targets[w.dest]`` (flat uint8) by the plan.

    Each wanted slice's target holds exactly words [lo, hi) of its region.
    Nothing is written to any target unless every read slice validated.
    """
    PreparedRestore(generation, wanted).copy_into(targets)


@cyclic_gc_paused()
def load_state(state: Mapping[str, Any], *, store: Store, root: str,
               allow_optimizer_change: Sequence[tuple[str, str]] = ()) -> Counters:
    """Validate the generation for what ``state`` asks, then fill it: tensors in place, values and
    Stateful objects after every copy (:mod:`alpha_ckpt.state.load`).

    The destination is matched to the checkpoint by dotted name; every entry that
    is missing, unexpected or of another shape or dtype is named in one refusal.
    Destinations that share memory are refused first (tied weights, the very
    same view under two names, only where the checkpoint holds the same
    words for both): the copies would otherwise overwrite each other.
    """
    with open_generation(store, root) as generation:
        manifest = generation.manifest
        what = f"generation {root[:16]}..."
        plan = plan_load(state, manifest.state, manifest.regions, allow_optimizer_change=allow_optimizer_change)
        fill = prepare_fill(generation, plan, what)
        fill()
        p = manifest.prefix
        return Counters(p.run, p.step, p.update, p.cursor, p.epoch, manifest.metadata, root)


def prepare_fill(generation: Generation, plan, what: str) -> Callable[[], None]:
    """Validate every slice ``plan`` (:class:`alpha_ckpt.state.load.LoadPlan`) reads; return what fills it.

    Refuses before any copy: a plan that names mismatched entries, destinations that
    share memory, a damaged slice. The returned call copies every target, then runs
    the plan's ``finish`` (values, ``load_state_dict``). Collective restores prepare on
    every rank, agree, and only then fill.
    """
    refusal = plan.refusal(what)
    if refusal is not None:
        raise refusal
    regions = generation.manifest.regions
    names = [regions[o].name for o, *_ in plan.targets]
    tied = check_destinations(destination_layouts([(n, t) for n, (_, t, _, _) in zip(names, plan.targets)]))
    if tied:
        saved = _saved_words(generation)
        check_tied_saved_alike(tied, names, {i: saved.get(o, []) for i, (o, *_) in enumerate(plan.targets)})
    wanted = [WantedSlice(o, lo, hi, i) for i, (o, _, lo, hi) in enumerate(plan.targets)]
    prepared = PreparedRestore(generation, wanted)

    def fill() -> None:
        staged = [_flat_destination(t) for _, t, _, _ in plan.targets]
        prepared.copy_into([flat for flat, _ in staged])
        with torch.no_grad():
            for (_, t, _, _), (_, filled) in zip(plan.targets, staged):
                if filled is not t:
                    t.copy_(filled)
        plan.finish()
    fill.bytes_read = prepared.bytes_read  # what validation read of the shards' payloads
    return fill


def _saved_words(generation: Generation) -> dict[int, list[tuple[int, int, str]]]:
    """Per region ordinal, the (lo, hi, raw BLAKE3) of the slices holding it, from the shard heads."""
    out: dict[int, list[tuple[int, int, str]]] = {}
    for _, head in generation.shards.values():
        for s in head.slices:
            out.setdefault(s.ordinal, []).append((s.lo, s.hi, s.blake3))
    return {ordinal: sorted(slices) for ordinal, slices in out.items()}


def _copy_by_plan(plan, generation: Generation, raws, targets) -> None:
    # numpy copies on this thread. torch's copy_ of a large tensor starts an OpenMP team per call,
    # which oversubscribes the cores when every rank is a process (measured: 512 MiB per rank, 2
    # ranks on 2 cores, 0.15-0.86 s with copy_ against 0.065-0.086 s single-threaded).
    dests = [t.numpy() for t in targets]
    for c in plan.copies:
        rec = generation.shards[c.source][1].slices[c.index]
        if not rec.raw:
            continue
        size = DTYPES[rec.dtype][0]
        src = np.frombuffer(raws[(c.source, c.index)], dtype=np.uint8)
        dests[c.dest][c.dst_word * size:(c.dst_word + c.words) * size] = src[c.src_word * size:(c.src_word + c.words) * size]


def check_complete(store: Store, record: RefRecord) -> Refusal | None:
    """Why generation ``record`` is not complete, or None when it is.

    The one definition that ``latest``, ``--resume latest``, retention and gc
    share: a generation is complete when its ref reads back intact and every
    object it names validates fully (digests, format, coverage, capture
    prefixes, finiteness): exactly what a restore of the whole state checks.
    gc remembers the result per object file (:mod:`alpha_ckpt.upkeep.complete`).
    """
    try:
        with open_generation(store, record.root, record) as generation:
            check_payloads(generation)
    except Refusal as refusal:
        return refusal
    return None


def check_structure(store: Store, record: RefRecord) -> Refusal | None:
    """Why generation ``record``'s ref, manifests or shard heads are damaged or missing, or None.

    Reads every head and no payload byte: O(objects), not O(bytes). A payload byte that does not
    match its digest is found by whoever reads it, before anything is copied.
    """
    try:
        with open_generation(store, record.root, record):
            pass
    except Refusal as refusal:
        return refusal
    return None


UNREADABLE_REF = "(unreadable ref)"  # what latest names in place of a root it cannot read


def latest_order(history: History) -> list[RefRecord | tuple[str, Refusal]]:
    """Newest first: the generations ``latest`` tries, in order, with what it passes over and why (pure).

    The one rule of "newest" when refs are damaged, shared by ``latest``,
    ``restore("latest")``, retention and gc (the fence of every publish reads
    the same :class:`~alpha_ckpt.store.History`): an unreadable ref is passed
    over (named by its refusal; its number stays taken), and so is a
    generation of an older epoch than the newest readable one's (a
    continuation has published since, so a resume of it would be refused as
    ``stale-epoch``). A damaged or stale newer generation never hides an intact
    older one of the newest epoch.
    """
    records = history.records
    newest_epoch = max((r.prefix.epoch for r in records), default=0)
    out: list[RefRecord | tuple[str, Refusal]] = []
    for entry in reversed(history.entries):
        if isinstance(entry, UnreadableRef):
            out.append((UNREADABLE_REF, entry.refusal))
        elif entry.prefix.epoch < newest_epoch:
            out.append((entry.root, Refusal(RefusalCode.STALE_EPOCH, f"generation {entry.generation} is of epoch "
                                            f"{entry.prefix.epoch}; {history.run}/{history.step} has published in "
                                            f"epoch {newest_epoch} since")))
        else:
            out.append(entry)
    return out


def latest_generation(store: Store, run: str, step: str, check: Callable[[Store, RefRecord], Refusal | None] | None = None,
                      ) -> tuple[RefRecord | None, list[tuple[str, Refusal]]]:
    """The newest complete generation of (run, step) that is not stale, and the newer ones skipped with why.

    Complete is ``check`` (default :func:`check_complete`); the order and what is passed over
    unread is :func:`latest_order`'s.
    """
    skipped: list[tuple[str, Refusal]] = []
    for entry in latest_order(store.history(run, step)):
        if not isinstance(entry, RefRecord):
            skipped.append(entry)
            continue
        refusal = (check or check_complete)(store, entry)
        if refusal is not None:
            skipped.append((entry.root, refusal))
            continue
        return entry, skipped
    return None, skipped
