"""Checkpointer: collective save and restore of a training script's own state, on any torch.distributed group.

Call order (every rank of the group, the same calls in the same order)::

    ckpt = Checkpointer(store, run="r")        # or Checkpointer.from_launcher_env() under alpha-run
    counters = ckpt.restore(state)             # None: nothing to resume (a fresh start)
    for step in ...:
        ...
        ckpt.save(state, update=step, cursor=samples_seen)   # the same root digest on every rank
    ckpt.close()

Placement of a state's entries: a plain tensor or value is replicated (one
rank writes it once; every other rank only hashes its replica, and a replica
that differs refuses the publish on every rank); ``PerRank(value)`` is stored
per rank and restored to the same rank; ``Partitioned(tensor, lo, hi, shape)``
is this rank's word range of one region. Large replicas are spread over the
ranks, as DCP spreads them; small ones are rank 0's.

Save: every rank captures (Stateful ``state_dict()``, typed values, tensors)
and sends rank 0 a descriptor (its skeleton and region declarations); rank 0
checks that every capture agrees and sends back the agreed layout. Then every
rank writes its own shards durably (its per-rank and partitioned words and
the replicas it writes), hashing them as it writes, and hashes the replicas
that others write. No rank ever sends another its tensor bytes.

* Star: every rank sends rank 0 its shard records, replica digests and write
  outcome; rank 0 compares the digests, writes the root manifest naming every
  shard and the ref durably, then broadcasts the acknowledgment.
* Tree: rank 0 hears the same digests and outcomes and broadcasts one
  verdict; only then do group manifests and commitments go up the tree
  (every parent hears at most ``fanout`` children), and the completion down.

Every rank returns the root, or raises the same Refusal (exit 3 under
alpha-run) or PublishFailed.

Restore: rank 0 picks the generation (``"latest"``, a digest, or None for a
fresh start) and checks its bindings (run/step, ``identity``, stale epoch);
every rank then validates exactly the slices it restores; the ranks agree
on one verdict before any rank copies a byte. Under ``"latest"``, a
generation that any rank finds damaged makes every rank fall back to the
next older one together.

The parts, by name: every option in :mod:`.options`; capture and agreement
in :mod:`.agreement`; the publishers behind one interface in
:mod:`alpha_ckpt.tiers.durable.publisher` (:mod:`~alpha_ckpt.tiers.durable.star`,
:mod:`~alpha_ckpt.tiers.durable.tree`); choosing the generation to resume in
:mod:`.resume`; the messages ranks exchange, typed and versioned, in
:mod:`alpha_ckpt.tiers.durable.messages`. This class only calls them in order.
"""
from __future__ import annotations

import logging
import os
import time
from types import MappingProxyType
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from alpha_ckpt.state.device import check_devices
from alpha_ckpt.errors import Refusal, RefusalCode, StoreUsageError, UsageError
from alpha_ckpt.format.records import CapturePrefix, block_digests
from alpha_ckpt.upkeep.gc import retain_newest
from alpha_ckpt.runtime.heap import cyclic_gc_paused
from alpha_ckpt.runtime import launch_env
from alpha_ckpt.runtime.launch_env import launcher_settings
from alpha_ckpt.state.manifest import encode_identity
from alpha_ckpt.tiers.durable.choice import DAMAGE, Choice
from alpha_ckpt.tiers.durable.publisher import Contribution
from alpha_ckpt.tiers.durable.messages import Candidate, Descriptor, Interval, Outcome
from alpha_ckpt.tiers.seam import DURABLE, MEMORY, walk_order
from alpha_ckpt.tiers.durable.wire import any_rank, broadcast_json, global_rank
from alpha_ckpt.generation.reader import Counters
from alpha_ckpt.state.capture import capture_state
from alpha_ckpt.store import Store
from alpha_ckpt.generation.writer import word_view
from alpha_ckpt.collective.agreement import agree_layout, agreed_regions, describe, own_parts, replica_digests, shared_digests, split_shared
from alpha_ckpt.collective.options import CheckpointerOptions
from alpha_ckpt.collective.recovery import RecoveryClock
from alpha_ckpt.collective.result import SaveResult, completed
from alpha_ckpt.collective.runtime import build_runtime
from alpha_ckpt.collective.node_reads import NodeReads
from alpha_ckpt.collective.resume import announce, announce_save, plan_prepare, prepare_planned, shards_read
from alpha_ckpt.collective.verdict import agree

logger = logging.getLogger("alpha_ckpt")

_FROM_OPTIONS = object()


class Checkpointer:
    """Collective checkpoints of one run/step of a training script (see the module docstring)."""

    def __init__(self, store: str | os.PathLike | Store | None = None, *, run: str | None = None,
                 group: Any = None, bindings: Callable[[Any], None] | None = None,
                 options: CheckpointerOptions | None = None, **option_kwargs: Any):
        """``store``, ``run`` and the keyword options (one per option of
        :data:`alpha_ckpt.runtime.options.OPTIONS`: ``step=``, ``publisher=``, ``memory=``, ...), checked
        once by :class:`CheckpointerOptions`; or ``options=`` alone: given with any of them, neither would
        plainly win, so that is a :class:`UsageError`. ``group``: the torch.distributed group (default: the
        default group). ``bindings``: a program's own check of a generation's root manifest, run by rank 0
        before any rank reads a shard (it raises a Refusal)."""
        if options is not None:
            given = [name for name, value in (("store", store), ("run", run)) if value is not None]
            if given or option_kwargs:
                raise UsageError(f"Checkpointer: options= or store=, run= and keyword options, not both "
                                 f"({', '.join(given + sorted(option_kwargs))} given beside options=)")
        else:
            options = CheckpointerOptions(store=store, run=run, **option_kwargs)
        self.options = options
        self._recovery = RecoveryClock(launch_env.restart_context())  # marks this process's recovery, if it is one
        self._restore_started = time.monotonic()
        self.run, self.step = options.run, options.step
        self.rules = options.rules()  # entries placed by name (alpha_ckpt/state/rules.py), recorded in every root manifest
        # A program's own bindings: recorded in every root manifest (metadata=) and checked by rank 0
        # on a generation before any rank reads a shard (bindings(root manifest) raises a Refusal).
        # bind_devices: each rank's device must be the very one that saved its rank (UUID), not only the product.
        self.metadata = {**options.metadata, **self.rules.recorded()}
        self.bindings, self.bind_devices = bindings, options.bind_devices
        self._fence = None  # an asynchronous save whose snapshot is still being taken (defer_snapshot=True)
        self.schedule = options.schedule()
        self._due_asked = False  # due() said yes: the save that follows re-plans (every="auto")
        self.identity, self.keep = options.identity, options.keep
        self.allow_nonfinite = options.allow_nonfinite
        self.publisher, self.commit_timeout = options.publisher, options.commit_timeout
        self.epoch = 0
        self.follows: int | None = None  # rank 0: the generation this history continues (store.check_fence)
        self._last_restore: dict | None = None  # what this rank's last restore read (bytes, shards)
        self.skipped = 0  # async saves skipped because one was in flight (in_flight="skip")
        self._last_save: dict | None = None  # the last completed save: root, generation, bytes, bytes_written, seconds
        self.memory_skipped: list[str] = []  # the last restore: newer memory generations passed over, and why
        self._ancestor: tuple[int, str] | None = None  # rank 0: (generation, root) of self.follows
        # Everything it runs on, from the options alone (alpha_ckpt/collective/runtime.py); named here
        # as the methods below use it.
        runtime = build_runtime(options, group, self)  # not kept whole: close() drops the groups it holds
        self.group, self.rank, self.world, self.hierarchy = group, runtime.rank, runtime.world, runtime.hierarchy
        self._arrivals, self.store, self._own_store = runtime.arrivals, runtime.store, runtime.own_store
        self._control, self._saver, self._save_group = runtime.control, runtime.saver, runtime.save_group
        self.memory, self._carry, self.device = runtime.memory, runtime.carry, runtime.device
        self._durable, self._tiers, self._release = runtime.durable, runtime.tiers, runtime.release

    @classmethod
    def from_launcher_env(cls, *, group: Any = None, bindings: Callable[[Any], None] | None = None,
                          **overrides: Any) -> "Checkpointer":
        """The Checkpointer of a script started by alpha-run: its store, run, resume choice and
        checkpoint flags (alpha_ckpt/runtime/launch_env.py), each overridden by the keyword argument of
        the same name given here; restores are announced. :class:`UsageError` naming what is
        missing when this process was not started by alpha-run."""
        return cls(options=_launcher_options(overrides), group=group, bindings=bindings)

    def due(self, update: int) -> bool:
        """Whether ``update`` should be saved, by ``every=`` (the same answer on every rank).

        Call it at every update, on every rank. With ``every="auto"`` it is collective while no
        interval is planned yet (rank 0 plans as soon as a cost is known, measured or assumed).
        """
        self._recovery.first_step(self.run, self.step, self.rank, self.options.announce)
        launch_env.note_step()
        due = self.schedule.due(update)
        if due:
            self._due_asked = True
        elif self.schedule.needs_plan() and self.schedule.update_seconds:
            self._replan(update)
        return due

    # ------------------------------------------------------------------ save

    @cyclic_gc_paused()
    def save(self, state: Mapping[str, Any], *, update: int, cursor: int = 0,
             defer_snapshot: bool = False, durable: bool = False) -> SaveResult:
        """Collective: publish ``state`` as ``update`` of this run/step; a :class:`SaveResult` in every mode.

        Sync: returns once the generation is durable; ``.root`` is its root digest, the same on
        every rank. Async: captures values and snapshots tensors now, publishes in the
        background; ``.root`` (or ``.result()``) waits for it, and the next ``save`` or
        :meth:`wait` raises a background failure, on every rank. With ``in_flight="skip"`` a
        save called while the previous one is still in flight is skipped on every rank
        (``.skipped``). ``defer_snapshot=True`` (async): the tensors are copied on the save
        thread; call :meth:`wait_snapshot` before changing any of them (before the next
        optimizer step). With the memory tier (``memory=``), a save goes to host memory on this
        rank and its peers, and one in ``durable_every`` also to the store; ``durable=True``
        sends this one to the store too (the last save of a job: the tier is host memory).

        Every rank of the group calls it, in the same order: when ranks do not, the call fails (at the
        group's timeout, or as soon as one of them leaves) with :class:`~alpha_ckpt.CollectiveIncomplete`
        naming them.
        """
        launch_env.note_checkpoint_call()  # under alpha-run: a failure from here on is retryable
        with self._arrivals.call("save") as number:
            return self._save(state, update, cursor, defer_snapshot, durable, number)

    def _save(self, state: Mapping[str, Any], update: int, cursor: int, defer_snapshot: bool, durable: bool,
              number: int) -> SaveResult:
        self._recovery.first_step(self.run, self.step, self.rank, self.options.announce)
        launch_env.note_step()
        prefix = CapturePrefix(self.run, self.step, update, cursor, self.epoch)
        if self._saver is not None and self._saver.in_flight == "skip" and self._any_rank(self._saver.busy()):
            self.skipped += 1  # every rank skips, or none: the publish is collective
            self.schedule.saved()
            self._due_asked = False
            return SaveResult(skipped=True)
        t0 = time.monotonic()
        tier = DURABLE if durable or self.memory is None else self.schedule.next_tier()  # the same on every rank
        durable = tier == DURABLE
        refused = None
        try:
            captured = capture_state(state, self.rank, self.world, self.rules)
            regions = captured.regions(self.allow_nonfinite)
            capture_s = time.monotonic() - t0
        except (ValueError, Refusal) as exc:
            # Not raised here alone: the refusal travels in the descriptor exchange, so every rank
            # raises it at once instead of waiting for this rank until the group times out.
            refused = exc if isinstance(exc, Refusal) else Refusal(RefusalCode.FORMAT, str(exc))
            captured, regions = None, ()
        except Exception as exc:  # noqa: BLE001 - a state_dict() of the script's own that failed
            refused = exc
            captured, regions = None, ()
        capture_s = time.monotonic() - t0
        tensors = [t for _, t in captured.named] if captured is not None else []
        if self._saver is None:
            result = completed(self._exchange(prefix, captured, regions, tensors, self._control, refused, durable,
                                              capture_s), dict(self._last_save))
            cost = time.monotonic() - t0
            tier = self._last_save["tier"]  # durable after all when the memory tier could not hold it
        else:
            stats: dict = {}

            @cyclic_gc_paused()
            def publish(snapshot):
                with self._arrivals.named("save", number):  # on the save thread: its failure names who did not come
                    root = self._exchange(prefix, captured, regions, snapshot, self._save_group, refused, durable,
                                          capture_s)
                stats.update(self._last_save)  # this save's, before a later save replaces last_save
                return root
            handle = self._saver.submit(tensors, publish, defer_snapshot=defer_snapshot)
            result = SaveResult(handle=handle, stats=stats) if handle is not None else SaveResult(skipped=True)
            self._fence = result if defer_snapshot and handle is not None else None
            cost = result.stall_s
        self.schedule.saved(cost, tier)
        if self.options.announce and self.rank == 0 and not result.skipped:
            announce_save(self.run, self.step, update, tier, result, cost,
                          self._last_save.get("memory_skipped") if self._saver is None else None)
        if self.schedule.auto and self._due_asked:
            self._replan(update)  # after a save the schedule asked for (not after one the script adds)
        self._due_asked = False
        return result

    @property
    def last_save(self) -> Mapping[str, Any] | None:
        """The last completed save, read-only: root, update, generation, bytes, bytes_written, tier, seconds, and
        ``phases``, this rank's seconds in each (capture, agree, then per tier: ``durable.write``,
        ``durable.commit``, ``memory.write``, ``memory.commit``, ``memory.replicate``); with the memory tier,
        ``memory_ok``, ``memory_skipped``, ``memory_bytes_sent``, ``memory_held_bytes``."""
        return None if self._last_save is None else MappingProxyType(self._last_save)

    @property
    def last_restore(self) -> Mapping[str, Any] | None:
        """What this rank's last restore read, read-only: bytes, shards, tier, bytes from peers and store, and
        ``phases``, this rank's seconds choosing the generation, validating (every candidate tried) and copying."""
        return None if self._last_restore is None else MappingProxyType(self._last_restore)

    @property
    def last_recovery(self) -> dict | None:
        """The ``recovered`` event's fields of this process's recovery, once its first step is done (or None)."""
        return self._recovery.last

    @property
    def snapshotting(self) -> SaveResult | None:
        """The asynchronous save whose copy of the tensors is still being taken on the save
        thread (``defer_snapshot=True``), or None: its tensors must not change before :meth:`wait_snapshot`."""
        return self._fence

    def wait_snapshot(self) -> None:
        """Return once the asynchronous save in flight has its copy of the tensors (``defer_snapshot``)."""
        fence, self._fence = self._fence, None
        if fence is not None:
            fence.wait_snapshot()  # counts the wait in the handle's stall_s

    def wait(self) -> None:
        """Collective in effect: drain the asynchronous save in flight; raise its failure (every rank does)."""
        if self._saver is not None:
            self.wait_snapshot()
            self._saver.drain()

    def _replan(self, update: int) -> None:
        """every="auto": rank 0 turns the costs measured so far into a number of updates; every rank applies it."""
        decision = None
        if self.rank == 0:
            pending = self._saver.pending if self._saver is not None else None
            floor = pending.save_s if pending is not None and pending.done() else 0.0  # async: one save long
            decision = self.schedule.decision(update, floor)
            if decision.every is not None:
                logger.info("checkpoint every %d updates: %s", decision.every, self.schedule.describe())
        decision = Interval.from_json(broadcast_json(decision.to_json() if decision else None, global_rank(0, self.group),
                                                     self._control))
        self.schedule.apply_interval(update, decision)

    def _any_rank(self, flag: bool) -> bool:
        return any_rank(flag, self._control)

    def _exchange(self, prefix: CapturePrefix, captured, regions, tensors, group,
                  refused: BaseException | None = None, durable: bool = True, capture_s: float = 0.0) -> str:
        """Agree on one layout (rank 0 checks every capture), then publish it by star or tree.

        Every rank hashes each replica once: the one that writes it while writing, the others
        beside their own writes. The digests are compared before anything is published.
        ``refused``: this rank's capture failed; it still takes part in the agreement, which
        then refuses on every rank.
        """
        started, written = time.monotonic(), self.store.bytes_written
        try:
            views = [] if refused else [word_view(t) for t in tensors]
        except Exception as exc:  # noqa: BLE001 - told to every rank below, as a failed capture is
            refused = exc
        if refused is not None:
            agree_layout(Descriptor(refused=Outcome.of(refused, self.rank)), group, self.rank, self.store,
                                   self.world, refused)
            raise AssertionError("unreachable: the agreement refuses")  # pragma: no cover
        descriptor, own, hashed, wrote = describe(prefix, captured, regions, views, self.rank, self.world,
                                                  self.device)
        agreeing = time.monotonic()
        layout = agree_layout(descriptor, group, self.rank, self.store, self.world)
        phases = {"capture": capture_s, "agree": time.monotonic() - agreeing}
        regions = agreed_regions(layout)
        own, shared_wrote, shared_hashed = split_shared(layout, self.rank, own)
        # Only digests of replicas travel, never their bytes; a diverged one refuses before any ref.
        tier = DURABLE if durable else MEMORY  # a durable save is held in memory too, with the memory tier
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="alpha-ckpt-replicas") as pool:
            others = pool.submit(lambda: {name: block_digests(view)[0] for name, view in hashed})
            others_shared = pool.submit(lambda: [[name, lo, hi, block_digests(view)[0]]
                                                 for name, lo, hi, view in shared_hashed])
            contribution = Contribution(
                prefix, regions, layout, own_parts(regions, own),
                self._metadata(layout) if self.rank == 0 else {},
                lambda digests: replica_digests(regions, wrote, digests, others.result()), self.follows, group,
                lambda digests: shared_digests(regions, shared_wrote, digests, others_shared.result()),
                ancestor=self._ancestry() if self.memory is not None and self.rank == 0 else None)
            named = {DURABLE if durable else MEMORY} | ({MEMORY} if self.memory is not None else set())
            memory_skipped, completion = None, None
            for each in self._tiers:  # fastest first: a durable save is held in memory too
                if each.name not in named:
                    continue
                done = each.publish(contribution)
                phases.update({f"{each.name}.{phase}": seconds for phase, seconds in each.phases.items()})
                if each.name == MEMORY and not done.outcome.ok:
                    memory_skipped = done.outcome.reason  # the same verdict on every rank: the store holds it
                    named.add(DURABLE)
                    durable, tier = True, DURABLE
                completion = done
        completion.outcome.raise_failure()
        if durable and self.rank == 0:
            self.follows, self._ancestor = completion.generation, (completion.generation, completion.root)
        if memory_skipped is not None and self.rank == 0:
            logger.warning("update %d is durable but not held in memory: %s", prefix.update, memory_skipped)
        # Every rank learns what the publish wrote in all (the tree's ranks write their own shards).
        total = torch.tensor([self.store.bytes_written - written], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        self._last_save = {"root": completion.root, "update": prefix.update, "generation": completion.generation,
                          "bytes": completion.bytes, "bytes_written": int(total.item()), "tier": tier,
                          "seconds": time.monotonic() - started, "phases": phases}
        if self.memory is not None:
            self._last_save.update(memory_ok=memory_skipped is None, memory_skipped=memory_skipped,
                                  memory_bytes_sent=self.memory.last.bytes_sent if self.memory.last else 0,
                                  memory_held_bytes=self._held_bytes())
        if durable and self.rank == 0:
            self._retain()
        return completion.root

    def _ancestry(self) -> tuple[int, str] | None:
        """Rank 0: (generation, root) of the store's generation this history continues (self.follows)."""
        if not self.follows:
            self._ancestor = None
        elif self._ancestor is None or self._ancestor[0] != self.follows:
            record = next((r for r in self.store.history(self.run, self.step).records if r.generation == self.follows),
                          None)
            self._ancestor = (record.generation, record.root) if record is not None else None
        return self._ancestor

    def _held_bytes(self) -> int:
        try:
            return self.memory.held_bytes()
        except OSError:
            return 0

    def _metadata(self, layout) -> dict:
        """The root manifest's metadata: the script's, the identity, the ranks' devices, the saved layout."""
        meta = {**self.metadata, "identity": encode_identity(self.identity), "owners": self.world,
                "devices": layout.devices}
        if layout.layout is not None:
            meta["layout"] = layout.layout
        return meta

    def _retain(self) -> None:
        """Rank 0, after a publish: keep=K newest complete generations of this run/step."""
        if self.keep is None:
            return
        try:
            retain_newest(self.store, self.run, self.step, self.keep)
        except (OSError, Refusal, StoreUsageError) as exc:  # retention never fails the save it follows
            logger.warning("retention (keep=%d) of %s/%s did not run: %s", self.keep, self.run, self.step, exc)

    # ------------------------------------------------------------------ restore

    @cyclic_gc_paused()
    def restore(self, state: Mapping[str, Any], root: Any = _FROM_OPTIONS, *, per_rank: str = "keep",
                branch: bool = False) -> Counters | None:
        """Collective: restore ``state`` from ``root`` ("latest", a digest, or None: start fresh).

        Without ``root``: the option ``resume`` (default "latest": the newest complete generation
        that is not stale; none yet, a fresh start), the same under torchrun and alpha-run
        (whose ``--resume-from D`` sets it). Returns the generation's counters, or None when
        there was nothing to resume. Every rank raises the same Refusal, before any rank
        copies a byte, when anything is wrong. ``branch=True`` starts this run (epoch 0; it
        must have no generation yet) from generation ``root`` of another run. Every rank of the group calls
        it: when ranks do not, it fails with :class:`~alpha_ckpt.CollectiveIncomplete` naming them, as ``save``.
        """
        launch_env.note_checkpoint_call()  # under alpha-run: a failure from here on is retryable
        with self._arrivals.call("restore"):
            return self._restore(state, root, per_rank, branch)

    def _restore(self, state: Mapping[str, Any], root: Any, per_rank: str, branch: bool) -> Counters | None:
        self._restore_started = time.monotonic()
        if root is _FROM_OPTIONS:
            root = self.options.resume
        elif isinstance(root, SaveResult):
            root = root.result()
        if per_rank not in ("keep", "drop"):
            raise ValueError(f"per_rank is 'keep' or 'drop', not {per_rank!r}")
        if branch and root in (None, "latest"):
            raise ValueError("branch=True needs the root digest of the generation to branch from")
        # this rank's seconds: choosing the candidates, validating them (every one tried), copying the one taken
        phases = {"choose": 0.0, "validate": 0.0, "copy": 0.0}
        started = time.perf_counter()
        walk = walk_order([tier.newest(self.run, self.step, root, branch) for tier in self._tiers])
        phases["choose"] = time.perf_counter() - started
        if self.rank == 0 and self._durable.follows is not None:
            self.follows = self._durable.follows
        self.memory_skipped = list(self.memory.skipped) if self.memory is not None else []
        tiers = {tier.name: tier for tier in self._tiers}

        def wanted(manifest) -> set[str]:
            return shards_read(state, manifest, rank=self.rank, world=self.world, per_rank=per_rank,
                               allow_optimizer_change=self.options.allow_optimizer_change)
        for i, candidate in enumerate(walk):
            if candidate.root is None:  # rank 0's refusal of the choice itself
                raise Refusal(candidate.refusal.code, candidate.refusal.message)
            started = time.perf_counter()
            with tiers[candidate.tier].reader(candidate, wanted) as reading:
                if reading is None:
                    phases["validate"] += time.perf_counter() - started
                    continue  # not within reach (the same on every rank): the next candidate
                bound, refused, fill, counters = self._prepare_agreed(
                    reading.store, candidate.root, state, per_rank,
                    share_reads=self.options.share_reads and candidate.tier == DURABLE and self.world > 1)
                phases["validate"] += time.perf_counter() - started
                if refused is not None:
                    # Damaged: every rank tries the next candidate together (from memory, the store always is).
                    if (root == "latest" and not bound.binding and refused.code in DAMAGE
                            and (i + 1 < len(walk) or candidate.tier == MEMORY)):
                        if self.rank == 0:
                            logger.warning("%s tier: update %s refused (%s); trying the next candidate",
                                           candidate.tier, candidate.update, refused)
                        continue
                    raise refused
                started = time.perf_counter()
                fill()
                phases["copy"] = time.perf_counter() - started
            from_store = self._last_restore["bytes_read"] if candidate.tier == DURABLE else 0
            return self._restored(counters, 0 if branch else counters.epoch + 1, tier=candidate.tier,
                                  bytes_from_peers=reading.bytes_from_peers, bytes_from_store=from_store, phases=phases,
                                  **({"assemble_seconds": reading.seconds} if candidate.tier == MEMORY else {}))
        self._announce(None)
        return None

    def _prepare_agreed(self, store: Store, root: str, state: Mapping[str, Any], per_rank: str, *,
                        share_reads: bool = False):
        """Collective, for one generation ``root`` of ``store`` (the durable store or this rank's holder): rank 0
        checks its bindings, every rank prepares (validates) its part, and the ranks agree on one verdict.
        ``share_reads``: each object is read from the store once per node (:mod:`alpha_ckpt.collective.node_reads`).
        Returns (candidate, refusal, fill, counters): the agreed refusal (what this rank validated released,
        nothing copied), or None with ``fill`` ready to copy."""
        bound = Choice(store, self.run, self.step).bound(
            root, identity=self.identity, bindings=self.bindings, bind_devices=self.bind_devices,
            device=self.device) if self.rank == 0 else None
        candidate = Candidate.from_json(broadcast_json(bound.to_json() if bound else None, global_rank(0, self.group),
                                                       self.group))
        refusal, fill, counters, preparing, shared = None, None, None, None, None
        try:
            if candidate.refusal is not None:
                raise Refusal(candidate.refusal.code, candidate.refusal.message)
            if self.bind_devices:  # each rank: the very device that saved its rank
                check_devices((candidate.devices or [])[self.rank:self.rank + 1] or [None], [self.device], True)
            preparing = plan_prepare(store, state, root, rank=self.rank, world=self.world, per_rank=per_rank,
                                     allow_optimizer_change=self.options.allow_optimizer_change)
        except Refusal as exc:
            refusal = exc
        try:
            if share_reads:  # every rank, refused or not: the plan is collective (None where any rank refused)
                shared = NodeReads.share(store, None if preparing is None else preparing.objects(), self.group,
                                         () if preparing is None else preparing.opening.manifest.regions)
            if preparing is not None:
                fill, counters, self._last_restore = prepare_planned(
                    store, preparing, None if shared is None else shared.open_objects)
                if shared is not None:
                    self._last_restore["bytes_from_node"] = shared.bytes_from_node
        except Refusal as exc:
            refusal = exc
        try:
            agree(refusal, self.group)
        except Refusal as agreed:
            if fill is not None:
                fill(go=False)  # another rank refused: release what this rank validated, copy nothing
            return candidate, agreed, None, None
        finally:
            if shared is not None:
                shared.close()  # every rank opened what it maps: the node's files may go
        return candidate, None, fill, counters

    def _restored(self, counters: Counters, epoch: int, **read: Any) -> Counters:
        """Every rank, once its state holds the generation: what it read, the new epoch, the schedule, the line."""
        self._last_restore.update(read)
        if self.memory_skipped:
            self._last_restore["memory_skipped"] = list(self.memory_skipped)
        self.epoch = epoch
        self.schedule.restored()
        self._announce(counters)
        return counters

    def _announce(self, counters: Counters | None) -> None:
        """With the option ``announce`` (alpha-run's scripts): rank 0 says what the script resumed.
        A restarted rank's clock marks the end of its restore (the ``recovered`` event follows its first step)."""
        self._recovery.restored(counters, self._last_restore if counters else None,
                                time.monotonic() - self._restore_started, self.group)
        if self.options.announce:
            announce(self.run, self.step, counters, self._last_restore["bytes_read"] if counters else 0,
                     self.rank, self.group, memory_skipped=self.memory_skipped)

    def close(self) -> None:
        """Drain an asynchronous save (raising its failure), then release the store."""
        try:
            self.wait()
        finally:
            if self.memory is not None:
                self.memory.close(discard=True)  # the script is done: its memory generations go with it
            self._release()  # joins the save thread, destroys this Checkpointer's own groups (once)
            # Their last references: a destroyed gloo group's workers are joined only when it is freed.
            self._save_group = None
            self._control = self.group
            if self.memory is not None:
                self.memory.group = None
            if self._own_store:
                self.store.close()


def _launcher_options(overrides: Mapping[str, Any]) -> CheckpointerOptions:
    """alpha-run's settings, each overridden by the argument of the same name."""
    settings = launcher_settings()
    if "every" in overrides:  # the script's own schedule: none of alpha-run's parts of it
        settings = {k: v for k, v in settings.items() if k not in ("every", "mtbf", "checkpoint_cost")}
    return CheckpointerOptions(**{**settings, "announce": True, **overrides})


