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
"""
from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import blake3
import torch
import torch.distributed as dist

from ..async_save import AsyncSaver
from ..device import check_devices, current_device
from ..hooks import fault_point
from ..heap import cyclic_gc_paused
from ..errors import (DurableWriteError, PublishConflict, PublishFailed, Refusal, RefusalCode, StoreUsageError,
                      UsageError)
from ..format import CapturePrefix, DTYPES, RegionDecl, ShardRef, block_digests, canonical_json, joined_digest
from ..gc import retain_newest
from ..planner import Hierarchy, Piece, WantedSlice, owners_holding, shares
from ..progress import emit, format_bytes, is_tty
from ..publish.tree import GroupTransport, TreeRole, write_or_fail
from ..publish.wire import broadcast_json, gather_json
from ..manifest import check_coverage, check_region_names, check_root_manifest, encode_identity, identity_matches
from ..restore import Counters, latest_order, open_generation, prepare_fill
from ..state.capture import capture_state
from ..state.load import plan_load
from ..state.rules import recorded_per_rank
from ..values import decode_value, dotted_leaves
from ..store import RefRecord, Store
from ..writer import ShardCarry, word_view, write_manifest
from ..launch_env import launcher_settings
from .options import CheckpointerOptions
from .verdict import agree, any_rank

logger = logging.getLogger("alpha_ckpt")

_FROM_OPTIONS = object()


class _Default:
    def __repr__(self) -> str:
        return "<the option's default>"


_DEFAULT: Any = _Default()  # a keyword argument left out: CheckpointerOptions' default
SPREAD_BYTES = 1 << 20  # replicated regions this large are spread over the ranks (star and tree)
# Refusals of a generation's bytes: under "latest" the next older generation is tried. Any other
# refusal (a binding, a destination that does not match) would refuse the older ones too.
DAMAGE = frozenset({RefusalCode.CORRUPT_SHARD, RefusalCode.MISSING_SHARD, RefusalCode.FORMAT, RefusalCode.COVERAGE,
                    RefusalCode.MIXED_CAPTURE, RefusalCode.NON_FINITE})


class Checkpointer:
    """Collective checkpoints of one run/step of a training script (see the module docstring)."""

    def __init__(self, store: str | os.PathLike | Store | None = None, *, run: str | None = None,
                 step: str = _DEFAULT, group: Any = None, publisher: str = _DEFAULT, fanout: int = _DEFAULT,
                 commit_timeout: float = _DEFAULT, save: str = _DEFAULT, in_flight: str = _DEFAULT,
                 identity: Any = _DEFAULT, allow_nonfinite: str | Sequence[str] = _DEFAULT,
                 every: int | str | None = _DEFAULT, mtbf: float | str | None = _DEFAULT,
                 checkpoint_cost: float | str | None = _DEFAULT, keep: int | None = _DEFAULT,
                 metadata: Mapping[str, Any] | None = _DEFAULT, bindings: Callable[[Any], None] | None = None,
                 bind_devices: bool = _DEFAULT, per_rank: Sequence[str] | str = _DEFAULT,
                 from_rank0: Sequence[str] | str = _DEFAULT, resume: str | None = _DEFAULT,
                 options: CheckpointerOptions | None = None):
        """The keyword arguments are :class:`CheckpointerOptions`' (documented there); or pass ``options=``.
        ``group``: the torch.distributed group (default: the default group). ``bindings``: a program's own
        check of a generation's root manifest, run by rank 0 before any rank reads a shard (it raises a
        Refusal)."""
        given = {k: v for k, v in dict(store=store, run=run, step=step, publisher=publisher, fanout=fanout,
                                       commit_timeout=commit_timeout, save=save, in_flight=in_flight,
                                       identity=identity, allow_nonfinite=allow_nonfinite, every=every, mtbf=mtbf,
                                       checkpoint_cost=checkpoint_cost, keep=keep, metadata=metadata,
                                       bind_devices=bind_devices, per_rank=per_rank, from_rank0=from_rank0,
                                       resume=resume).items()
                 if v is not _DEFAULT and (v is not None or k == "resume")}  # None: the default, but resume=None
        if options is not None:
            if given:
                raise UsageError(f"Checkpointer: options= or keyword options, not both ({', '.join(sorted(given))})")
        elif store is None or run is None:
            warnings.warn("Checkpointer() without store= and run= reads alpha-run's settings: call "
                          "Checkpointer.from_launcher_env() instead", DeprecationWarning, stacklevel=2)
            options = _launcher_options(given)
        else:
            options = CheckpointerOptions(**given)
        self.options = options
        self.run, self.step = options.run, options.step
        self.rules = options.rules()  # entries placed by name (alpha_ckpt/state/rules.py), recorded in every root manifest
        # A program's own bindings: recorded in every root manifest (metadata=) and checked by rank 0
        # on a generation before any rank reads a shard (bindings(root manifest) raises a Refusal).
        # bind_devices: each rank's device must be the very one that saved its rank (UUID), not only the product.
        self.metadata = {**options.metadata, **self.rules.recorded()}
        self.bindings, self.bind_devices = bindings, options.bind_devices
        self._branch = False
        self._fence = None  # an asynchronous save whose snapshot is still being taken (defer_snapshot=True)
        self.schedule = options.schedule()
        self._due_asked = False  # due() said yes: the save that follows re-plans (every="auto")
        self.identity, self.keep = options.identity, options.keep
        self.allow_nonfinite = options.allow_nonfinite
        store, fanout, save, in_flight = options.store, options.fanout, options.save, options.in_flight
        self.publisher, self.commit_timeout = options.publisher, options.commit_timeout
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.hierarchy = Hierarchy(self.world, fanout)
        # Rank 0 creates the store; the others open it once it exists. A Store handle given is the caller's.
        self._own_store = not isinstance(store, Store)
        if isinstance(store, Store):
            self.store = store
        else:
            self.store = Store(store, create=True) if self.rank == 0 else None
            dist.barrier(group=group)
            if self.store is None:
                self.store = Store(store, create=False)
        self.epoch = 0
        self.follows: int | None = None  # rank 0: the generation this history continues (store.check_fence)
        self.last_restore: dict | None = None  # what this rank's last restore read (bytes, shards)
        self.skipped = 0  # async saves skipped because one was in flight (in_flight="skip")
        self.last_save: dict | None = None  # the last completed save: root, generation, bytes, bytes_written, seconds
        # What this process wrote before: a region whose bytes did not change (a frozen embedding
        # table) is named again as carried instead of written again (one save in flight at a time).
        self._carry = ShardCarry()
        # Tree messages and an asynchronous save's publish go over gloo groups of their own:
        # NCCL moves only device memory and cannot time out a receive, and a background
        # publish must never interleave with the training collectives of the main thread.
        ranks = None if group is None else dist.get_process_group_ranks(group)
        nccl = dist.get_backend(group) == "nccl"
        self._control = dist.new_group(ranks=ranks, backend="gloo") if nccl else group
        self._saver = AsyncSaver(in_flight=in_flight) if save == "async" else None
        self._save_group = dist.new_group(ranks=ranks, backend="gloo") if save == "async" else None
        # Never closed: at exit, while the interpreter is still whole, the save thread is joined and the
        # groups made here are destroyed (gloo work outliving the interpreter aborts a finished script).
        self._release = weakref.finalize(self, _release, self._saver,
                                         [g for g in (self._save_group, self._control if nccl else None) if g])
        self.device = current_device(torch.device("cuda", torch.cuda.current_device()) if nccl
                                     else torch.device("cpu"))

    @classmethod
    def from_launcher_env(cls, *, group: Any = None, bindings: Callable[[Any], None] | None = None,
                          **overrides: Any) -> "Checkpointer":
        """The Checkpointer of a script started by alpha-run: its store, run, resume choice and
        checkpoint flags (alpha_ckpt/launch_env.py), each overridden by the keyword argument of
        the same name given here; restores are announced. :class:`UsageError` naming what is
        missing when this process was not started by alpha-run."""
        return cls(options=_launcher_options(overrides), group=group, bindings=bindings)

    def due(self, update: int) -> bool:
        """Whether ``update`` should be saved, by ``every=`` (the same answer on every rank).

        Call it at every update, on every rank. With ``every="auto"`` it is collective while no
        interval is planned yet (rank 0 plans as soon as a cost is known, measured or assumed).
        """
        due = self.schedule.due(update)
        if due:
            self._due_asked = True
        elif self.schedule.needs_plan() and self.schedule.update_seconds:
            self._replan(update)
        return due

    # ------------------------------------------------------------------ save

    @cyclic_gc_paused()
    def save(self, state: Mapping[str, Any], *, update: int, cursor: int = 0, defer_snapshot: bool = False):
        """Collective: publish ``state`` as ``update`` of this run/step.

        Sync: returns the root digest on every rank once it is durable. Async: captures
        values and snapshots tensors now, publishes in the background, and returns a
        :class:`~alpha_ckpt.SaveHandle` (``.result()`` is the root); the next ``save`` or
        :meth:`wait` raises a background failure, on every rank. With ``in_flight="skip"``
        a save called while the previous one is still in flight returns None on every rank.
        ``defer_snapshot=True`` (async): the tensors are copied on the save thread; call
        :meth:`wait_snapshot` before changing any of them (before the next optimizer step).
        """
        prefix = CapturePrefix(self.run, self.step, update, cursor, self.epoch)
        if self._saver is not None and self._saver.in_flight == "skip" and self._any_rank(self._saver.busy()):
            self.skipped += 1  # every rank skips, or none: the publish is collective
            self.schedule.saved()
            self._due_asked = False
            return None
        t0 = time.monotonic()
        refused = None
        try:
            captured = capture_state(state, self.rank, self.world, self.rules)
            regions = captured.regions(self.allow_nonfinite)
        except (ValueError, Refusal) as exc:
            # Not raised here alone: the refusal travels in the descriptor exchange, so every rank
            # raises it at once instead of waiting for this rank until the group times out.
            refused = exc if isinstance(exc, Refusal) else Refusal(RefusalCode.FORMAT, str(exc))
            captured, regions = None, ()
        except Exception as exc:  # noqa: BLE001 - a state_dict() of the script's own that failed
            refused = exc
            captured, regions = None, ()
        tensors = [t for _, t in captured.named] if captured is not None else []
        if self._saver is None:
            result = self._exchange(prefix, captured, regions, tensors, self._control, refused)
            cost = time.monotonic() - t0
        else:
            stats: dict = {}

            @cyclic_gc_paused()
            def publish(snapshot):
                root = self._exchange(prefix, captured, regions, snapshot, self._save_group, refused)
                stats.update(self.last_save)  # this save's, before a later save replaces last_save
                return root
            result = self._saver.submit(tensors, publish, defer_snapshot=defer_snapshot)
            result.stats = stats  # filled once the publish completes
            self._fence = result if defer_snapshot else None
            cost = result.stall_s
        self.schedule.saved(cost)
        if self.schedule.auto and self._due_asked:
            self._replan(update)  # after a save the schedule asked for (not after one the script adds)
        self._due_asked = False
        return result

    @property
    def snapshotting(self):
        """The asynchronous save (its handle) whose copy of the tensors is still being taken on the save
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
            decision = {"every": self.schedule.decide(update, floor)}
            if decision["every"] is not None:
                logger.info("checkpoint every %d updates: %s", decision["every"], self.schedule.plan.describe())
        decision = broadcast_json(decision, self._global(0), self._control)
        if decision["every"] is not None:
            self.schedule.apply(update, decision["every"])

    def _any_rank(self, flag: bool) -> bool:
        return any_rank(flag, self._control)

    def _exchange(self, prefix: CapturePrefix, captured, regions, tensors, group,
                  refused: BaseException | None = None) -> str:
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
            self._agree_layout({"refused": _failure_json(refused, self.rank)}, group, refused)
            raise AssertionError("unreachable: the agreement refuses")  # pragma: no cover
        own, hashed, wrote, replicated = [], [], {}, []
        # Large replicas are spread over the ranks, as DCP does; rank 0 writes the small ones.
        writers = replica_writers(regions, captured.placement, self.world)
        for region, view, where in zip(regions, views, captured.placement):
            size = DTYPES[region.dtype][0]
            if where == "replicated":
                replicated.append(region.name)
                if writers.get(region.name, 0) == self.rank:
                    own.append((region.name, 0, region.words, view))
                    wrote[region.name] = view
                else:
                    hashed.append((region.name, view))
            else:
                for lo, hi, at in words_held(where, region.words):
                    own.append((region.name, lo, hi, view[at * size:(at + hi - lo) * size]))
        descriptor = {"prefix": prefix.to_json(), "skeleton": captured.skeleton, "replicated": replicated,
                      "regions": [r.to_json() for r in regions], "pieces": [[n, lo, hi] for n, lo, hi, _ in own],
                      "device": self.device}
        layout = self._agree_layout(descriptor, group)
        regions = tuple(RegionDecl(r["ordinal"], r["name"], r["dtype"], tuple(r["shape"]), bool(r.get("nonfinite")))
                        for r in layout["regions"])  # the agreed list
        # Only digests of replicas travel, never their bytes; a diverged one refuses before any ref.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="alpha-ckpt-replicas") as pool:
            others = pool.submit(lambda: {name: block_digests(view)[0] for name, view in hashed})
            if self.publisher == "tree":
                completion = self._publish_tree(prefix, regions, layout, own, wrote, others, group)
            else:
                completion = self._publish_star(prefix, regions, layout, own, wrote, others, group)
        if not completion["ok"]:
            if completion.get("code"):
                raise Refusal(completion["code"], str(completion["reason"]))
            raise PublishFailed(str(completion["reason"]))
        if self.rank == 0:
            self.follows = completion["generation"]
        # Every rank learns what the publish wrote in all (the tree's ranks write their own shards).
        total = torch.tensor([self.store.bytes_written - written], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        self.last_save = {"root": completion["root"], "update": prefix.update, "generation": completion["generation"],
                          "bytes": completion["bytes"], "bytes_written": int(total.item()),
                          "seconds": time.monotonic() - started}
        if self.rank == 0:
            self._retain()
        return completion["root"]

    def _agree_layout(self, descriptor: dict, group, refused: BaseException | None = None) -> dict:
        """Rank 0 gets every rank's descriptor (metadata, no tensor bytes), checks that the captures
        agree and merges them into one skeleton and region list; every rank gets that, or raises
        the same Refusal (a capture that failed on any rank included)."""
        root0 = self._global(0)
        descriptors = gather_json(descriptor, root0, group)
        if self.rank != 0:
            layout = broadcast_json(None, root0, group)
        else:
            try:
                failed = [d["refused"] for d in descriptors if "refused" in d]
                if failed:  # the lowest refusing rank's, as agree() does
                    raise _Failed(failed[0])
                skeleton, regions = merge_captures(descriptors)
                layout = {"ok": True, "state": skeleton, "regions": [r.to_json() for r in regions],
                          "devices": [d["device"] for d in descriptors],
                          "layout": saved_layout(descriptors, regions),
                          # every rank writes this save's large shards alike, beyond its own probes
                          "write_mode": self.store.save_write_mode(self.world)}
            except _Failed as failure:
                layout = {"ok": False, **failure.args[0]}
            except Refusal as refusal:
                layout = {"ok": False, "code": refusal.code.value, "reason": refusal.message}
            except Exception as exc:  # noqa: BLE001 - the others wait for this verdict: never leave them waiting
                layout = {"ok": False, **_failure_json(exc, 0)}
            # Every rank writes its own shards against the agreed regions.
            broadcast_json(layout, root0, group, echo=False)
        if not layout["ok"]:
            if layout.get("code"):
                raise Refusal(layout["code"], layout["reason"])
            raise PublishFailed(layout["reason"]) from refused
        return layout

    def _replica_digests(self, regions, wrote: Mapping[str, memoryview], written: Mapping[tuple, tuple],
                         others) -> dict[str, str]:
        """This rank's BLAKE3 of every replica: those it wrote as hashed by the write (joined from its
        cuts when it was cut into several shards), and the others'."""
        by_name = {r.name: r for r in regions}
        digests = dict(others.result())
        by_ordinal: dict[int, list[tuple[int, int, str]]] = {}  # one pass over the pieces, not one per replica
        for (o, lo, hi), d in written.items():
            by_ordinal.setdefault(o, []).append((lo, hi, d))
        for name, view in wrote.items():
            region = by_name[name]
            cuts = sorted(by_ordinal.get(region.ordinal, ()))
            covered = [lo for lo, _, _ in cuts] == [0] + [hi for _, hi, _ in cuts[:-1]] and \
                bool(cuts) and cuts[-1][1] == region.words
            digests[name] = joined_digest([d for *_, d in cuts]) if covered else block_digests(view)[0]
        return digests

    def _metadata(self, layout: dict) -> dict:
        meta = {**self.metadata, "identity": encode_identity(self.identity), "owners": self.world,
                "devices": layout["devices"]}
        if layout.get("layout") is not None:
            meta["layout"] = layout["layout"]
        return meta

    def _own_parts(self, regions, own) -> list[tuple[Piece, memoryview, str]]:
        by_name = {r.name: r for r in regions}
        return [(Piece(by_name[n].ordinal, lo, hi, DTYPES[by_name[n].dtype][0]), view, "raw") for n, lo, hi, view in own]

    def _publish_star(self, prefix, regions, layout, own, wrote, others, group) -> dict:
        """Every rank writes its own shards; rank 0 gathers every rank's shard records, replica digests
        and write outcome (one message each), writes the root manifest naming every shard and
        publishes the ref; then the acknowledgment goes to every rank.

        No rank sends another its tensor bytes: the star differs from the tree in its one level
        (rank 0 hears every rank itself, and one manifest names every shard).
        """
        root0 = self._global(0)
        parts = self._own_parts(regions, own)
        written: dict[tuple, str] = {}
        # gc spares what this rank writes until the ref names it, or the publish has failed
        lease = self.store.pending_publish(prefix.run, prefix.step)
        try:
            shard_refs, failure = write_or_fail(self.store, prefix, regions, [parts] if parts else [],
                                                f"rank {self.rank}", carry=self._carry, digests_out=written,
                                                writers=self.world, agreed_mode=layout.get("write_mode"))
            report = {"shards": [s.to_json() for s in shard_refs], "failure": list(failure) if failure else None,
                      "replicas": self._replica_digests(regions, wrote, written, others)}
            reports = gather_json(report, root0, group)
            ack = broadcast_json(None, root0, group) if self.rank != 0 else None
            if self.rank == 0:
                ack = written_verdict(reports)
                if ack["ok"]:
                    ack = self._publish_root(prefix, regions, layout,
                                             _once([ShardRef.from_json(s) for r in reports for s in r["shards"]]))
            fault_point("publish", "before-completion")
            if self.rank == 0:
                broadcast_json(ack, root0, group, echo=False)
            return ack
        finally:
            lease.release()

    def _publish_root(self, prefix, regions, layout, shard_refs: list[ShardRef]) -> dict:
        """The star's rank 0: the root manifest naming every rank's shards, then the ref; the acknowledgment."""
        try:
            root, size = write_manifest(self.store, prefix, regions, shard_refs, self.world,
                                        self._metadata(layout), state=layout["state"],
                                        check=lambda m: check_root_manifest(m, shard_refs, f"root manifest "
                                                                            f"{m.digest[:16]}...",
                                                                            identity=self.identity,
                                                                            metadata=self._metadata(layout)))
            record = self.store.publish_ref(prefix, root, size, size + sum(s.size for s in shard_refs),
                                            owners=self.world, follows=self.follows)
            return {"ok": True, "root": root, "generation": record.generation, "bytes": record.bytes}
        except Refusal as refusal:
            return {"ok": False, "code": refusal.code.value, "reason": refusal.message}
        except (OSError, ValueError, PublishConflict, DurableWriteError) as exc:
            return {"ok": False, "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - any failure here: every rank must hear it, not wait out the group
            logger.exception("rank 0: publishing the root of update %d failed", prefix.update)
            return {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}

    def _publish_tree(self, prefix, regions, layout, own, wrote, others, group) -> dict:
        """Every rank writes its own shards; the ranks agree that the writes succeeded and the replicas
        match; then group manifests and commitments go up, the completion down."""
        parts = self._own_parts(regions, own)
        metadata = self._metadata(layout) if self.rank == 0 else {"device": self.device}
        role = TreeRole(self.store, self.hierarchy, self.rank, GroupTransport(group), timeout=self.commit_timeout,
                        carry=self._carry,
                        check_root=lambda m: check_root_manifest(m, None, f"root manifest {m.digest[:16]}...",
                                                                 identity=self.identity, metadata=metadata))
        written: dict[tuple, str] = {}
        try:
            failure = role.write_own(prefix, regions, [parts] if parts else [], digests_out=written,
                                     agreed_mode=layout.get("write_mode"))
            report = {"replicas": self._replica_digests(regions, wrote, written, others),
                      "failure": list(failure) if failure else None}
            reports = gather_json(report, self._global(0), group)
            verdict = broadcast_json(written_verdict(reports) if self.rank == 0 else None, self._global(0), group)
        except BaseException:
            role.release()
            raise
        if not verdict["ok"]:
            role.release()
            return verdict
        # The commitments carry the agreed layout's digest (the replicas were compared just above).
        agreed = blake3.blake3(canonical_json([layout["state"], layout["regions"]])).hexdigest()
        return role.complete(role.commit(prefix, regions, None, agreed, metadata,
                                         follows=self.follows, state=layout["state"]))

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
        must have no generation yet) from generation ``root`` of another run.
        """
        if root is _FROM_OPTIONS:
            root = self.options.resume
        if per_rank not in ("keep", "drop"):
            raise ValueError(f"per_rank is 'keep' or 'drop', not {per_rank!r}")
        if branch and root in (None, "latest"):
            raise ValueError("branch=True needs the root digest of the generation to branch from")
        self._branch = branch
        candidates = self._candidates(root)
        for i, candidate in enumerate(candidates):
            refusal, fill, counters = None, None, None
            if "root" in candidate:  # rank 0 checks this one's bindings now, not every candidate's up front
                candidate = broadcast_json(self._bound(candidate["root"]) if self.rank == 0 else None,
                                           self._global(0), self.group)
            try:
                if candidate.get("refusal"):
                    raise Refusal(candidate["refusal"]["code"], candidate["refusal"]["message"])
                if self.bind_devices:  # each rank: the very device that saved its rank
                    saved = candidate.get("devices") or []
                    check_devices(saved[self.rank:self.rank + 1] or [None], [self.device], True)
                fill, counters = self._prepare(state, candidate["root"], per_rank)
            except Refusal as exc:
                refusal = exc
            try:
                agree(refusal, self.group)
            except Refusal as agreed:
                if fill is not None:
                    fill(go=False)  # another rank refused: release what this rank validated, copy nothing
                if (root == "latest" and not candidate.get("binding") and agreed.code in DAMAGE
                        and i + 1 < len(candidates)):
                    continue  # damaged: every rank falls back to the next older generation together
                raise
            fill()
            self.epoch = 0 if branch else counters.epoch + 1
            self._announce(counters)
            return counters
        self._announce(None)
        return None

    def _announce(self, counters: Counters | None) -> None:
        """With ``announce`` (alpha-run's scripts): one line from rank 0 saying what the script resumed
        from (update, root, bytes read by every rank) or that it starts fresh. A terminal gets words,
        a log collector one JSON event."""
        if not self.options.announce:
            return
        read = torch.tensor([self.last_restore["bytes_read"] if counters is not None else 0], dtype=torch.int64)
        if counters is not None:  # the same branch on every rank: they all restored, or none did
            if dist.get_backend(self.group) == "nccl":
                read = read.cuda()
            dist.all_reduce(read, group=self.group)
        if self.rank != 0:
            return
        fields = {"run": self.run, "step": self.step}
        if counters is not None:
            fields.update(update=counters.update, root=counters.root, bytes_read=int(read.item()))
        if is_tty(sys.stderr):
            line = (f"alpha-run: {self.run}/{self.step} restored update {counters.update} from {counters.root} "
                    f"({format_bytes(fields['bytes_read'])} read)" if counters is not None else
                    f"alpha-run: {self.run}/{self.step} starts fresh (no generation to resume)")
        else:
            buffer = io.StringIO()
            emit("restored" if counters is not None else "fresh_start", buffer, **fields)
            line = buffer.getvalue().rstrip("\n")
        os.write(sys.stderr.fileno(), (line + "\n").encode("utf-8", "replace"))  # one write: ranks share stderr

    def _candidates(self, root: Any) -> list[dict]:
        """Rank 0 decides what to try, in order; every rank gets the same list."""
        out = None
        if self.rank == 0:
            try:
                out = self._choose(root)
            except Refusal as refusal:
                out = [{"refusal": {"code": refusal.code.value, "message": refusal.message}, "binding": True}]
        return broadcast_json(out, self._global(0), self.group)

    def _choose(self, root: Any) -> list[dict]:
        history = self.store.history(self.run, self.step)
        refs = history.listing()
        if self._branch:
            if refs:
                raise Refusal(RefusalCode.FOREIGN_LEARNER, f"cannot branch into {self.run}/{self.step}: that run "
                              "already has generations")
            self.follows = 0
            return [{"root": self.store.check_digest(root)}]
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
            record = self.store.find_ref(self.store.check_digest(root))
            if record is None or (record.run, record.step) != (self.run, self.step):
                raise Refusal(RefusalCode.FOREIGN_LEARNER, f"generation {root[:16]}... is not one of {self.run}/{self.step}")
            if record.prefix.epoch < newest_epoch:
                later = [r for r in refs if isinstance(r, RefRecord) and r.prefix.epoch == newest_epoch][-1]
                raise Refusal(RefusalCode.STALE_EPOCH, f"generation {root[:16]}... is of epoch {record.prefix.epoch}, "
                              f"but a continuation published generation {later.generation} ({later.root}, update "
                              f"{later.prefix.update}) in epoch {newest_epoch}; restore that one ('latest')")
            return [{"root": record.root}]
        order = latest_order(history)  # latest's rule: unreadable refs and older epochs are passed over
        usable = [r for r in order if isinstance(r, RefRecord)]
        for bad in history.unreadable_above:
            logger.warning("restore latest of %s/%s: ref %s cannot be read and is passed over: %s",
                           self.run, self.step, bad.name, bad.refusal)
        if refs and not usable:
            raise Refusal(RefusalCode.MISSING_SHARD, f"no readable generation of {self.run}/{self.step} to resume")
        return [{"root": r.root} for r in usable]

    def _bound(self, root: str) -> dict:
        """Rank 0: the candidate ``root``, or the refusal that stops the restore (a binding: no fallback past it)."""
        try:
            with open_generation(self.store, root, role=0, wanted=[]) as generation:
                manifest = generation.manifest
        except Refusal as refusal:  # damaged: under "latest", the next older generation is tried
            return {"refusal": {"code": refusal.code.value, "message": refusal.message}}
        try:
            meta = manifest.metadata if isinstance(manifest.metadata, dict) else {}
            if not identity_matches(meta.get("identity"), self.identity):
                raise Refusal(RefusalCode.FOREIGN_LEARNER, f"generation {root[:16]}... was saved with identity "
                              f"{_short(meta.get('identity'))}; this script binds {_short(encode_identity(self.identity))}")
            if self.bindings is not None:
                self.bindings(manifest)
            devices = meta.get("devices") if isinstance(meta.get("devices"), list) else [None]
            if not self.bind_devices:
                check_devices(devices, [self.device] * len(devices), False)
        except Refusal as refusal:  # a binding: no older generation of this history would do either
            return {"refusal": {"code": refusal.code.value, "message": refusal.message}, "binding": True}
        return {"root": root, "devices": meta.get("devices") if self.bind_devices else None}

    def _prepare(self, state: Mapping[str, Any], root: str, per_rank: str):
        """This rank's part: match, open only the shards it reads, validate them. Returns (fill, counters)."""
        what = f"generation {root[:16]}..."
        with open_generation(self.store, root, role=0, wanted=[]) as head:  # the root manifest: the skeleton
            manifest = head.manifest
        if manifest.state is None:
            raise Refusal(RefusalCode.FORMAT, f"{what} records no state skeleton (it was not written by save)")
        plan = plan_load(state, manifest.state, manifest.regions, rank=self.rank, world=self.world,
                         per_rank=per_rank, per_rank_entries=recorded_per_rank(manifest.metadata))
        wanted = [WantedSlice(o, lo, hi, i) for i, (o, _, lo, hi) in enumerate(plan.targets)]
        # A tree: only the group manifests on the paths to the roles that hold this rank's words.
        generation = open_generation(self.store, root, role=lambda m: roles_holding(m, wanted), wanted=wanted,
                                     manifest=manifest)
        try:
            fill = prepare_fill(generation, plan, what)
        except BaseException:
            generation.close()
            raise
        p = manifest.prefix
        self.last_restore = {"root": root, "bytes_read": fill.bytes_read, "shards": len(generation.shards),
                             "manifests": len(generation.manifests),
                             "published": generation.ref.bytes if generation.ref else None}

        def fill_and_close(go: bool = True) -> None:
            try:
                if go:
                    fill()
            finally:
                generation.close()
        return fill_and_close, Counters(p.run, p.step, p.update, p.cursor, p.epoch, manifest.metadata, root)

    def close(self) -> None:
        """Drain an asynchronous save (raising its failure), then release the store."""
        try:
            self.wait()
        finally:
            self._release()  # joins the save thread, destroys this Checkpointer's own groups (once)
            if self._own_store:
                self.store.close()

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def _launcher_options(overrides: Mapping[str, Any]) -> CheckpointerOptions:
    """alpha-run's settings, each overridden by the argument of the same name."""
    settings = launcher_settings()
    if "every" in overrides:  # the script's own schedule: none of alpha-run's parts of it
        settings = {k: v for k, v in settings.items() if k not in ("every", "mtbf", "checkpoint_cost")}
    return CheckpointerOptions(**{**settings, "announce": True, **overrides})


def _release(saver: AsyncSaver | None, groups: list) -> None:
    """Join an asynchronous saver's thread and destroy the process groups a Checkpointer made."""
    if saver is not None:
        saver.close()
    for group in groups:
        try:
            if dist.is_initialized():
                dist.destroy_process_group(group)
        except (RuntimeError, ValueError) as exc:  # already gone with the default group
            logger.debug("process group not destroyed: %s", exc)


class _Failed(Exception):
    """Rank 0: a failure some rank reported in its descriptor (its JSON is ``args[0]``)."""


def _failure_json(exc: BaseException, rank: int) -> dict:
    """What a rank's failed capture (or rank 0's failed merge) tells every rank: a refusal keeps its code."""
    if isinstance(exc, Refusal):
        return {"code": exc.code.value, "reason": f"rank {rank}: {exc.message}"}
    return {"reason": f"rank {rank}: {type(exc).__name__}: {exc}"}


def merge_skeletons(skeletons: list[Any], path: str = "state") -> Any:
    """One skeleton from every rank's: PerRank parts from their own ranks, everything else equal on all."""
    first = skeletons[0]
    if len(skeletons) == 1:  # one rank's skeleton is the merge (its PerRank lists hold its one part)
        return first
    if isinstance(first, dict) and set(first) == {"per_rank"}:
        parts = []
        for r, s in enumerate(skeletons):
            if not (isinstance(s, dict) and set(s) == {"per_rank"} and len(s["per_rank"]) == len(skeletons)):
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r} does not hold it per rank as rank 0 does")
            parts.append(s["per_rank"][r])
        return {"per_rank": parts}
    if isinstance(first, dict):
        for r, s in enumerate(skeletons):
            if not isinstance(s, dict) or set(s) != set(first):
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r}'s state differs from rank 0's")
        return {k: merge_skeletons([s[k] for s in skeletons], f"{path}.{k}" if k != "dict" else path) for k in first}
    if isinstance(first, list):
        for r, s in enumerate(skeletons):
            if not isinstance(s, list) or len(s) != len(first):
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r}'s state differs from rank 0's")
        return [merge_skeletons([s[i] for s in skeletons], path) for i in range(len(first))]
    for r, s in enumerate(skeletons):
        if s != first or type(s) is not type(first):
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r} holds {_short(s)}, rank 0 {_short(first)} "
                          "(a replicated value diverged; wrap what differs per rank in PerRank)")
    return first


def merge_captures(descriptors: list[dict]) -> tuple[Any, tuple[RegionDecl, ...]]:
    """Rank 0 (pure): every rank's capture must have the same prefix, replicas (by digest) and
    replicated values; the result is one skeleton and the region list it names, in order.

    Before any rank writes: a region every rank declares alike (a Partitioned one of one shape),
    names unique across ranks, and the ranks' pieces holding every word of every region exactly
    once (:func:`~alpha_ckpt.manifest.check_coverage`, which the root manifest passes again)."""
    first = descriptors[0]
    for r, d in enumerate(descriptors):
        if d["prefix"] != first["prefix"]:
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {r} captured {d['prefix']}, rank 0 {first['prefix']}")
        if d["replicated"] != first["replicated"]:
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {r} replicates {_short(d['replicated'])}, rank 0 "
                          f"{_short(first['replicated'])}")
    skeleton = merge_skeletons([d["skeleton"] for d in descriptors])
    names = [name for name, _ in dotted_leaves(decode_value(skeleton, "merged skeleton"))]
    check_region_names([RegionDecl(i, n, "uint8", ()) for i, n in enumerate(names)], "save")
    declared: dict[str, tuple[int, dict]] = {}
    for rank, d in enumerate(descriptors):
        for r in d["regions"]:
            first, decl = declared.setdefault(r["name"], (rank, r))
            if (r["dtype"], list(r["shape"])) != (decl["dtype"], list(decl["shape"])):
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {rank} holds region {r['name']!r} as "
                              f"{r['dtype']}{list(r['shape'])}, rank {first} as {decl['dtype']}{list(decl['shape'])}")
    regions = tuple(RegionDecl(i, n, declared[n][1]["dtype"], tuple(declared[n][1]["shape"]),
                               bool(declared[n][1].get("nonfinite"))) for i, n in enumerate(names))
    ordinals = {r.name: r.ordinal for r in regions}
    check_coverage(regions, [(ordinals.get(name, len(regions)), lo, hi, f"rank {rank}")
                             for rank, d in enumerate(descriptors) for name, lo, hi in d["pieces"]], "save")
    return skeleton, regions


def written_verdict(reports: Sequence[Mapping[str, Any]]) -> dict:
    """Rank 0's verdict on every rank's writes (pure): the first failure, a diverged replica, or ok."""
    failed = [r["failure"] for r in reports if r["failure"]]
    if failed:
        reason, code = failed[0]
        return {"ok": False, "reason": reason, **({"code": code} if code else {})}
    try:
        check_replicas([r["replicas"] for r in reports])
    except Refusal as refusal:
        return {"ok": False, "code": refusal.code.value, "reason": refusal.message}
    return {"ok": True}


def check_replicas(digests: Sequence[Mapping[str, str]]) -> None:
    """Rank 0 (pure): every rank's BLAKE3 of every replica must be rank 0's."""
    for r, d in enumerate(digests):
        if set(d) != set(digests[0]):
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {r} hashed replicas {_short(sorted(d))}, rank 0 "
                          f"{_short(sorted(digests[0]))}")
        for name in sorted(d):
            if d[name] != digests[0][name]:
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {r}'s replica of {name!r} differs from rank 0's "
                              "(a replicated entry diverged; wrap what differs per rank in PerRank)")


def saved_layout(descriptors: list[dict], regions: Sequence[RegionDecl]) -> dict | None:
    """Which rank wrote which words, as a rule a reader computes (pure): None where no rule fits.

    ``partitioned``: regions every rank holds its :func:`~alpha_ckpt.planner.shares` range of;
    ``own``: [ordinal, rank] for a region one rank wrote whole (a PerRank entry, or a replica spread
    to another rank). Everything else is replicated, written by rank 0. A tree restore then reads
    only the group manifests on the paths to the ranks that hold its words.
    """
    world = len(descriptors)
    replicated = set(descriptors[0]["replicated"])
    held: dict[str, list[tuple[int, int, int]]] = {}
    for rank, d in enumerate(descriptors):
        for name, lo, hi in d["pieces"]:
            held.setdefault(name, []).append((rank, lo, hi))
    partitioned, own = [], []
    for region in regions:
        if region.name in replicated:
            writer = [rank for rank, _, _ in held.get(region.name, [])]
            if writer and writer[0] != 0:  # a spread replica: the rank that wrote it
                own.append([region.ordinal, writer[0]])
            continue
        pieces = held.get(region.name, [])
        if [(lo, hi) for _, lo, hi in sorted(pieces)] == shares(region.words, world) and len(pieces) == world:
            partitioned.append(region.ordinal)
        elif len(pieces) == 1 and pieces[0][1:] == (0, region.words):
            own.append([region.ordinal, pieces[0][0]])
        else:
            return None
    return {"rule": "shares", "partitioned": partitioned, "own": own}


def words_held(where: Any, words: int) -> tuple[tuple[int, int, int], ...]:
    """(lo, hi, at) of the region's words a rank holds, by its placement (pure): at is where in the rank's flat tensor."""
    if isinstance(where, tuple) and where[0] == "ranges":
        return where[1]
    if isinstance(where, tuple):
        return ((where[0], where[1], 0),)
    return ((0, words, 0),)


def replica_writers(regions: Sequence[RegionDecl], placement: Sequence[Any], world: int) -> dict[str, int]:
    """Which rank writes each replicated region of at least SPREAD_BYTES (pure; the same on every rank
    whose capture agrees): largest first, each to the rank with the fewest replicated bytes so far.
    Smaller ones stay with rank 0, in few shards."""
    load = [0] * world
    out = {}
    replicated = [r for r, where in zip(regions, placement)
                  if where == "replicated" and r.words * DTYPES[r.dtype][0] >= SPREAD_BYTES]
    for region in sorted(replicated, key=lambda r: (-r.words * DTYPES[r.dtype][0], r.name)):
        rank = min(range(world), key=lambda k: (load[k], k))
        out[region.name] = rank
        load[rank] += region.words * DTYPES[region.dtype][0]
    return out


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


def _once(shards: list[ShardRef]) -> list[ShardRef]:
    """Each shard object once, in order. Ranks can write byte-identical shards (each holding only
    an empty piece of the same regions: a [1, k] Shard(0) parameter on 3 ranks), and a manifest
    that named one object twice would be refused by every reader."""
    return list({s.digest: s for s in shards}.values())


def _short(value: Any) -> str:
    try:
        text = json.dumps(value, sort_keys=True)[:80]
    except (TypeError, ValueError):  # not JSON (int beside str keys): for a message only
        text = repr(value)[:80]
    return text
