"""One owner of the forecasting job. Started by `alpha-run` (or plain `torchrun -m alpha_ckpt.worker`).

    torchrun --nproc-per-node 4 -m alpha_ckpt.worker configs/forecast.toml --store S --updates 5

Every owner trains its share of each update, combines gradients in owner
order, and at checkpoint boundaries takes part in star publication. A resume
is validated by owner 0 and the verdict is agreed by all owners before any of
them trains. Exit codes: 0 done, 3 refused, 75 retryable failure, 2 usage.
"""
from __future__ import annotations

import io
import datetime
import json
import os
import signal
import statistics
import sys
import time

import blake3
import torch
import torch.distributed as dist

from . import durable
from .async_save import AsyncSaver, SaveHandle
from .progress import emit, format_bytes, is_tty
from .interval import IntervalPlan, parse_duration, young_daly
from .errors import DurableWriteError, PublishFailed, Refusal, RefusalCode
from .format import DTYPES, CapturePrefix, canonical_json
from .learner.config import JobConfig
from .learner.data import shares
from .learner.digest import state_digest
from .learner.model import (
    COMBINE_ORDER, LearnerState, apply_update, combine, configure_determinism, share_gradient, sum_in_owner_order,
)
from .manifest import match_regions
from .state import capture_state
from .writer import ShardCarry, word_bytes
from .planner import Hierarchy, Piece, WantedSlice, owners_holding
from .publish.star import build_capture, publish_star
from .publish.tree import GroupTransport, TreeRole
from .publish.wire import broadcast_json, gather_json
from .device import check_devices, current_device
from .gc import discard_completed_step
from .restore import PreparedRestore, latest_generation, open_generation
from .store import RefRecord, Store, write_all
from .usage import OneLineArgumentParser, UsageError, check_job_args, check_store_writable
from . import lifeline

EXIT_OK, EXIT_USAGE, EXIT_REFUSED, EXIT_RETRY = 0, 2, 3, 75
KILL_ENV = "ALPHA_CKPT_KILL_OWNER"
TREE_FAULT_ENV = "ALPHA_CKPT_TREE_FAULT"
_IDENTITY_EXCLUDES = ("run", "step", "parameters", "bind_placement")


def learner_identity(config: JobConfig) -> str:
    """The rule (model, initial state, rates, hyper-parameters) and the input sequence; not the placement."""
    rule = {k: v for k, v in config.to_json().items() if k not in _IDENTITY_EXCLUDES}
    return blake3.blake3(canonical_json({"learner": "forecast-mlp-v1", "rule": rule})).hexdigest()


def numerical_contract(compute: str = "cpu") -> dict:
    """What the bits depend on besides the state and the placement: kernels (CPU or CUDA), dtype, threads.

    The combine order belongs to each placement segment (see Owner.segments),
    so the saved state itself is placement-free.
    """
    return {"dtype": "float32", "intra_op_threads": 1, "deterministic": True, "compute": compute}


def compute_device(backend: str) -> torch.device:
    """NCCL owners compute on their local CUDA device (LOCAL_RANK, as torchrun sets it); gloo owners on the host."""
    if backend == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def parse_args(argv):
    p = OneLineArgumentParser(prog="alpha_ckpt.worker", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--store", default="./alpha-store")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--updates", type=int, required=True, help="committed update count to reach (absolute)")
    p.add_argument("--checkpoint-every", default="0", help="publish every K updates, or 'auto' (and at the end)")
    p.add_argument("--mtbf", help="--checkpoint-every auto: mean time between failures (21600, 360m, 6h)")
    p.add_argument("--checkpoint-cost", help="--checkpoint-every auto: the cost assumed until one is measured")
    p.add_argument("--save", choices=["sync", "async"], default="sync")
    p.add_argument("--in-flight", choices=["wait", "skip"], default="wait")
    p.add_argument("--discard-checkpoints", action="store_true",
                   help="once the declared output is published, remove this step's checkpoints (pins excepted)")
    p.add_argument("--resume-from", metavar="ROOT_DIGEST")
    p.add_argument("--resume", choices=["latest"])
    p.add_argument("--branch-from", metavar="ROOT_DIGEST", help="start this run from another run's generation")
    p.add_argument("--publisher", default="star", choices=["star", "tree"])
    p.add_argument("--fanout", type=int, default=8, help="tree publisher: children per owner at most")
    p.add_argument("--commit-timeout", type=float, default=60.0,
                   help="tree publisher: seconds a parent waits for its children's commitments")
    p.add_argument("--backend", choices=["gloo", "nccl"])
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    return p.parse_args(argv)


class Owner:
    def __init__(self, config: JobConfig, store: Store, device: torch.device = torch.device("cpu"), *,
                 publisher: str = "star", fanout: int = 8, commit_timeout: float = 60.0,
                 save: str = "sync", in_flight: str = "wait"):
        self.config, self.store, self.device = config, store, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.state = LearnerState.initial(config, device)
        self.epoch = 0
        self.last_generation = None
        captured = capture_state(self.state.tensors())  # the same path as alpha_ckpt.save
        self.named, self.skeleton = list(captured.named), captured.skeleton
        self.regions = captured.regions()
        self.owned = [self._owned(name, t) for name, t in self.named]
        self.publisher = publisher
        self.segments = [{"owners": self.world, "from": 0, "combine_order": COMBINE_ORDER}]
        self.hierarchy = Hierarchy(self.world, fanout)
        self.commit_timeout = commit_timeout
        self.own_device = current_device(device)
        # The star records every owner's device in its one manifest (owner 0 gathers them);
        # the tree records each owner's in its own group manifest, so no owner gathers all.
        self.devices = gather_json(self.own_device) if publisher == "star" else None
        # NCCL moves only device memory and its receives cannot time out: tree
        # messages travel over a gloo group beside it.
        self.control_group = dist.new_group(backend="gloo") if dist.get_backend() == "nccl" else None
        # An asynchronous save publishes on its own thread over its own group, so its
        # messages never interleave with the training collectives of the main thread.
        self.saver = AsyncSaver(in_flight=in_flight) if save == "async" else None
        self.save_group = dist.new_group(backend="gloo") if save == "async" else None
        self._fence: SaveHandle | None = None       # the snapshot the next optimizer step must wait for
        self._unreported: list[tuple[SaveHandle, int]] = []
        self.carry = ShardCarry()  # unchanged regions (a frozen table) are not written again
        self.checkpoint_costs: list[float] = []     # training seconds each checkpoint cost (sync: all of it)
        self.last_save_s = 0.0
        # Owner 0: the generation number this job's history continues (0: none yet), so that a
        # second job on this run/step is fenced at publish instead of forking it (store.check_fence).
        self.follows: int | None = None

    def _owned(self, name: str, t: torch.Tensor):
        """None for replicated words; this owner's contiguous word range for partitioned ones."""
        mode = self.config.parameters
        if name.startswith("optim.") and not name.startswith("optim.scalars."):
            partitioned = mode in ("partitioned", "optimizer")
        else:
            partitioned = mode == "partitioned" and name.startswith("model.")
        return shares(t.numel(), self.world)[self.rank] if partitioned else None

    def metadata(self) -> dict:
        """The root manifest's bindings (the star's also lists every owner's device).

        ``placement`` says whether the checkpoint binds its owner count;
        ``segments`` is the placement history that produced the state (owner
        count and combine order from each update on), which is what an oracle
        needs to reproduce it; ``layout`` names which regions were saved by
        owner share (role r holds shares(words, owners)[r]), so a restore on
        another owner count knows whose shards to read.
        """
        meta = {"learner": learner_identity(self.config), "contract": numerical_contract(self.device.type),
                "config": self.config.to_json(), "parameters": self.config.parameters,
                "bind_placement": self.config.bind_placement,
                "placement": {"bound": self.config.bind_placement, "owners": self.world},
                "segments": self.segments,
                "layout": {"rule": "shares", "partitioned": [i for i, own in enumerate(self.owned) if own is not None]}}
        if self.publisher == "star":
            meta["devices"] = self.devices
        return meta

    # -------------------------------------------------------------- training

    def train_update(self) -> None:
        c, s = self.config, self.state
        lo, hi = shares(c.batch, self.world)[self.rank]
        grads, loss = share_gradient(c, s.params, s.cursor + lo, s.cursor + hi, s.frozen)
        names = list(grads)
        flat = torch.cat([grads[n].reshape(-1) for n in names])
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat)
        losses = [torch.empty_like(loss) for _ in range(self.world)]
        dist.all_gather(losses, loss)
        partials = []
        for g in gathered:
            parts, offset = {}, 0
            for n in names:
                numel = grads[n].numel()
                parts[n] = g[offset:offset + numel].view_as(grads[n])
                offset += numel
            partials.append(parts)
        loss_sum = sum_in_owner_order(losses)
        ranges = None
        if c.parameters != "replicated":  # each owner updates the range whose optimizer state it owns
            ranges = {n: shares(p.numel(), self.world)[self.rank] for n, p in s.params.items()}
        self.wait_for_snapshot()  # an asynchronous save's copy must be taken before the state changes
        apply_update(c, s, combine(partials), loss_sum, ranges)
        if c.parameters != "replicated":
            self._all_gather_params()

    def _all_gather_params(self) -> None:
        """Each owner broadcasts its updated ranges, so every owner holds the whole parameters."""
        for r in range(self.world):
            pieces = [p.view(-1)[slice(*shares(p.numel(), self.world)[r])] for p in self.state.params.values()]
            buf = torch.cat(pieces) if r == self.rank else torch.empty(sum(x.numel() for x in pieces),
                                                                       device=self.device)
            dist.broadcast(buf, r)
            offset = 0
            for piece in pieces:
                piece.copy_(buf[offset:offset + piece.numel()])
                offset += piece.numel()

    def materialize(self) -> dict:
        """The whole logical state on every owner (partitioned optimizer state gathered)."""
        for (name, t), own in zip(self.named, self.owned):
            if own is None or name.startswith("model."):
                continue
            flat = t.view(-1)
            for r in range(self.world):
                lo, hi = shares(t.numel(), self.world)[r]
                buf = flat[lo:hi].clone() if r == self.rank else torch.empty(hi - lo, dtype=t.dtype, device=self.device)
                dist.broadcast(buf, r)
                flat[lo:hi] = buf
        return self.state.tensors()

    # -------------------------------------------------------------- checkpoints

    def prefix(self) -> CapturePrefix:
        return CapturePrefix(self.config.run, self.config.step, self.state.update, self.state.cursor, self.epoch)

    def publish(self, tensors=None, prefix: CapturePrefix | None = None, metadata: dict | None = None,
                group=None) -> tuple[str, dict]:
        """Collective: publish ``tensors`` (default: the live state) as ``prefix``; returns (root, stats)."""
        tensors = [t for _, t in self.named] if tensors is None else tensors
        prefix = prefix or self.prefix()
        metadata = metadata if metadata is not None else self.metadata()
        t0, written0 = time.monotonic(), self.store.bytes_written
        if self.publisher == "tree":
            root = self._publish_tree(tensors, prefix, metadata, group)
        else:
            capture = build_capture(prefix, self.regions, tensors, self.owned)
            root = publish_star(self.store if self.rank == 0 else None, capture, self.regions, metadata, group,
                                carry=self.carry, follows=self.follows, state=self.skeleton)
        seconds = time.monotonic() - t0
        # Bytes every owner wrote (the tree's owners write their own shards).
        written = torch.tensor([self.store.bytes_written - written0], dtype=torch.int64)
        dist.all_reduce(written, group=group if group is not None else self.control_group)
        stats = {"update": prefix.update, "seconds": seconds, "bytes_written": int(written.item())}
        if self.rank == 0:
            # The ref this publish just wrote is its run/step's newest: the owners publish one at a time.
            record = self.store.newest_ref(prefix.run, prefix.step)
            record = record if isinstance(record, RefRecord) and record.root == root else None
            stats.update(generation=record.generation if record else None, bytes=record.bytes if record else None)
            # Another ref already after ours can only be one that fences this job: following
            # "none" (0) makes the next publish refuse, never fork.
            self.follows = record.generation if record else 0
        # Only after the durable completion: the ref naming ``root`` exists.
        say(f"alpha-run: owner {self.rank} committed update {prefix.update} as {root}")
        return root, stats

    def checkpoint(self, final: bool) -> None:
        """Collective, at an update boundary: publish now (sync) or snapshot and publish in the background."""
        if self.saver is None:
            root, stats = self.publish()
            self.last_generation = root
            self.checkpoint_costs.append(stats["seconds"])
            self.last_save_s = stats["seconds"]
            self._report(stats, root, seconds=stats["seconds"], stall=stats["seconds"], mode="sync")
            return
        self.reap()
        if final:
            self.finish_saves()  # the last update is always published
        elif self.saver.in_flight == "skip" and self._any_owner(self.saver.busy()):
            # Every owner skips, or none: the publish is collective.
            if self.rank == 0:
                say(f"alpha-run: update {self.state.update} not checkpointed: the save of update "
                      f"{self._unreported[-1][1] if self._unreported else '?'} is still in flight "
                      "(--in-flight skip)")
                emit_event("checkpoint_skipped", update=self.state.update, reason="save in flight")
            return
        prefix, metadata = self.prefix(), self.metadata()
        handle = self.saver.submit([t for _, t in self.named],
                                   lambda snapshot: self.publish(snapshot, prefix, metadata, self.save_group),
                                   defer_snapshot=not final)
        self._fence = handle
        self._unreported.append((handle, prefix.update))
        if final:
            self.finish_saves()

    def wait_for_snapshot(self) -> None:
        if self._fence is not None:
            handle, self._fence = self._fence, None
            handle.wait_snapshot()

    def reap(self) -> None:
        """Report the asynchronous saves that completed; a failed one is raised here (never swallowed)."""
        while self._unreported and self._unreported[0][0].done() and self._unreported[0][0] is not self._fence:
            handle, _ = self._unreported.pop(0)
            root, stats = handle.result()
            self.last_generation = root
            self.checkpoint_costs.append(handle.stall_s)
            self.last_save_s = handle.save_s
            self._report(stats, root, seconds=handle.save_s, stall=handle.stall_s, mode="async")

    def finish_saves(self) -> None:
        if self.saver is not None:
            self.wait_for_snapshot()
            self.saver.drain()
            self.reap()

    def _any_owner(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(value.item())

    def _report(self, stats: dict, root: str, *, seconds: float, stall: float, mode: str) -> None:
        """Owner 0: one structured event per publish (``seconds``: boundary to durable)."""
        if self.rank == 0:
            emit_event("publish", run=self.config.run, step=self.config.step, root=root, mode=mode,
                       owners=self.world, **{**stats, "seconds": round(seconds, 6)}, stall_s=round(stall, 6))

    def _publish_tree(self, tensors, prefix: CapturePrefix, metadata: dict, group=None) -> str:
        """Own words to own shards, group manifest, commitment; the root's ref; completion down the tree."""
        parts, replicated = [], blake3.blake3()
        for region, t, own in zip(self.regions, tensors, self.owned):
            size = DTYPES[region.dtype][0]
            words = word_bytes(t)  # host bytes: a view of a CPU tensor, a copy of a CUDA one
            if own is None:
                replicated.update(memoryview(words.numpy()) if words.numel() else b"")
                if self.rank != 0:
                    continue  # replicated words are published once, by the root
            lo, hi = own if own is not None else (0, region.words)
            view = memoryview(words.numpy())[lo * size:hi * size] if words.numel() else memoryview(b"")
            parts.append((Piece(region.ordinal, lo, hi, size), view, "raw"))
        metadata = {**(metadata if self.rank == 0 else {}), "device": self.own_device}
        fault = os.environ.get(TREE_FAULT_ENV, "")  # test hook: "RANK:FAULT" injects FAULT at that owner
        transport = GroupTransport(group if group is not None else self.control_group)
        role = TreeRole(self.store, self.hierarchy, self.rank, transport, timeout=self.commit_timeout, carry=self.carry,
                        fault=fault.partition(":")[2] if fault.partition(":")[0] == str(self.rank) else None)
        completion = role.complete(role.commit(prefix, self.regions, [parts] if parts else [],
                                               replicated.hexdigest(), metadata, follows=self.follows,
                                               state=self.skeleton))
        if not completion["ok"]:
            if completion.get("code"):  # a refusal (a NaN, a fenced history): exit 3 on every owner
                raise Refusal(completion["code"], str(completion["reason"]))
            raise PublishFailed(completion["reason"])
        return completion["root"]

    def _check_binding(self, generation, branch: bool) -> None:
        m = generation.manifest
        meta = m.metadata if isinstance(m.metadata, dict) else {}
        if branch:
            if self.store.list_refs(self.config.run, self.config.step):
                raise Refusal(RefusalCode.FOREIGN_LEARNER, f"cannot branch into {self.config.run}/{self.config.step}: "
                              "that run already has generations")
        elif (m.prefix.run, m.prefix.step) != (self.config.run, self.config.step):
            raise Refusal(RefusalCode.FOREIGN_LEARNER, f"generation belongs to {m.prefix.run}/{m.prefix.step}, "
                          f"this job is {self.config.run}/{self.config.step}")
        if meta.get("learner") != learner_identity(self.config):
            raise Refusal(RefusalCode.FOREIGN_LEARNER, "generation was saved by another learner (model, rates, "
                          "hyper-parameters or input sequence differ)")
        if meta.get("contract") != numerical_contract(self.device.type):
            raise Refusal(RefusalCode.CONTRACT_MISMATCH, f"generation was saved under contract {meta.get('contract')}, "
                          f"this job runs {numerical_contract(self.device.type)}")
        segments = meta.get("segments")
        last = segments[-1] if isinstance(segments, list) and segments and isinstance(segments[-1], dict) else {}
        if last.get("combine_order") != COMBINE_ORDER:
            raise Refusal(RefusalCode.CONTRACT_MISMATCH, f"generation was produced with combine order "
                          f"{last.get('combine_order')!r}; this job combines in {COMBINE_ORDER!r}")
        placement = meta.get("placement") if isinstance(meta.get("placement"), dict) else {"bound": True}
        if placement.get("bound") and m.owners != self.world:
            raise Refusal(RefusalCode.PLACEMENT_BOUND, f"generation binds its placement to {m.owners} owners; this "
                          f"job has {self.world} (save with bind_placement = false to resume on another count)")
        if m.prefix.cursor != m.prefix.update * self.config.batch:
            raise Refusal(RefusalCode.RESET_CURSOR, f"generation's cursor {m.prefix.cursor} does not follow "
                          f"{m.prefix.update} updates of {self.config.batch}")
        if not branch:
            self._check_not_stale(m.prefix)

    def _check_history_readable(self) -> None:
        """Every ref of this run/step must read back intact: the stale-epoch check needs its whole history."""
        for record in self.store.list_refs(self.config.run, self.config.step):
            if isinstance(record, Refusal):
                raise Refusal(record.code, f"the history of {self.config.run}/{self.config.step} cannot be "
                              f"checked: {record.message}")

    def _check_not_stale(self, prefix: CapturePrefix) -> None:
        """Once a continuation has published, every generation of an older epoch is stale (no silent forks)."""
        newer = [r for r in self.store.list_refs(prefix.run, prefix.step)
                 if not isinstance(r, Refusal) and r.prefix.epoch > prefix.epoch]
        if newer:
            r = newer[-1]  # the newest: the one to resume instead
            raise Refusal(RefusalCode.STALE_EPOCH, f"generation is of epoch {prefix.epoch}, but a continuation of "
                          f"{prefix.run}/{prefix.step} already published generation {r.generation} ({r.root}, update "
                          f"{r.prefix.update}) in epoch {r.prefix.epoch}; resume that one (--resume latest), or "
                          "branch a new run (--branch-from)")

    def resume(self, root: str | None, latest: bool, branch: bool = False) -> None:
        """Collective: owner 0 checks the generation's bindings, then every owner validates what it reads.

        Each owner reads only its own words (a tree: the height + 1 manifests
        down to its role, its own shards and the root's) and validates them
        completely; the owners agree on the verdict before any of them copies
        a byte. A continuation runs in the generation's epoch + 1; a branch
        starts a new run (epoch 0) from another run's generation.
        """
        verdict = None
        if self.rank == 0:
            try:
                verdict = {"ok": True, "root": self._choose_generation(root, latest, branch)}
            except Refusal as refusal:
                verdict = {"ok": False, "code": refusal.code.value, "message": refusal.message}
        verdict = broadcast_json(verdict)
        if not verdict["ok"]:
            raise Refusal(verdict["code"], verdict["message"])
        root = verdict["root"]
        if root is None:
            if self.rank == 0:
                say(f"alpha-run: {self.config.run}/{self.config.step} has no generation yet: --resume latest "
                    "starts at update 0")
            return
        # Restore into host memory: validation and the copy run on the CPU, and
        # a CUDA owner's state is only touched once every owner's bytes passed.
        host = [t if t.device.type == "cpu" else torch.empty_like(t, device="cpu") for _, t in self.named]
        generation, prepared, refusal = None, None, None
        wanted = [WantedSlice(i, *(own or (0, t.numel())), i) for i, ((_, t), own) in enumerate(zip(self.named, self.owned))]
        try:
            generation = self._open_own_part(root, wanted)
            prepared = PreparedRestore(generation, wanted)
        except Refusal as exc:
            refusal = exc
        try:
            self._agree(refusal)
            targets = []
            for i, ((_, t), own) in enumerate(zip(self.named, self.owned)):
                lo, hi = own or (0, t.numel())
                size = t.element_size()
                targets.append(host[i].view(-1).view(torch.uint8)[lo * size:hi * size] if t.dim() else
                               host[i].view(1).view(torch.uint8))
            m = generation.manifest
            read = (f"read {prepared.bytes_read} payload bytes of {len(generation.shards)} shards and "
                    f"{len(generation.manifests)} manifests, of {generation.ref.bytes if generation.ref else '?'} "
                    "bytes published")
            prepared.copy_into(targets)
        finally:
            if generation is not None:
                generation.close()
        for (_, t), h in zip(self.named, host):
            if h is not t:
                t.copy_(h)
        if self.config.parameters == "partitioned":
            self._all_gather_params()  # each owner restored its own range of the parameters
        p = m.prefix
        self.state.update, self.state.cursor, self.epoch = p.update, p.cursor, (0 if branch else p.epoch + 1)
        self.last_generation = root
        # The placement history goes on: a new segment when the owner count changed.
        self.segments = [dict(s) for s in m.metadata["segments"]]
        if self.segments[-1].get("owners") != self.world:
            self.segments.append({"owners": self.world, "from": p.update, "combine_order": COMBINE_ORDER})
        say(f"alpha-run: owner {self.rank} restored update {p.update} from {root}: {read}")

    def _choose_generation(self, root: str | None, latest: bool, branch: bool) -> str | None:
        """Owner 0: the generation to resume (None: --resume latest on an empty history), its bindings checked.

        Also sets what this job's history follows: the run/step's newest generation now (a
        continuation runs in a new epoch after it), or none for a branch or an empty history.
        """
        run, step = self.config.run, self.config.step
        if not branch and not latest:  # --resume latest skips (and names) unreadable refs instead
            self._check_history_readable()
        newest = self.store.newest_ref(run, step)
        if isinstance(newest, Refusal) and not branch:
            raise Refusal(newest.code, f"the newest ref of {run}/{step} cannot be read, so no continuation could be "
                          f"fenced against it: {newest.message}")
        self.follows = newest.generation if isinstance(newest, RefRecord) and not branch else 0
        if latest:
            record, skipped = latest_generation(self.store, run, step)
            if record is None:
                if newest is None:
                    return None  # a first attempt that died before its first checkpoint: start it again
                why = "; ".join(f"{digest[:16]}: [{r.code.value}] {r.message}" for digest, r in skipped[:3])
                raise Refusal(RefusalCode.MISSING_SHARD, f"no complete generation of {run}/{step} to resume "
                              f"({len(skipped)} skipped: {why})")
            root = record.root
        # The bindings live in the root manifest: no shard is opened here.
        with open_generation(self.store, root, role=0, wanted=[]) as generation:
            self._check_binding(generation, branch)
            if match_regions(generation.manifest.regions, self.regions, f"generation {root[:16]}...") != list(
                    range(len(self.regions))):
                raise Refusal(RefusalCode.FOREIGN_LEARNER, f"generation {root[:16]}... declares this learner's "
                              "regions in another order: another program wrote it")
        return root

    def start_fresh(self) -> None:
        """Collective: a fresh start (epoch 0) owns a run/step only if it has no generation yet.

        A second history under one run/step would fork it silently; a retry continues the
        first with --resume latest instead.
        """
        verdict = None
        if self.rank == 0:
            run, step = self.config.run, self.config.step
            refs = self.store.list_refs(run, step)
            if refs:
                newest = refs[-1]
                named = (f"newest generation {newest.generation}: update {newest.prefix.update}, epoch "
                         f"{newest.prefix.epoch}, root {newest.root}" if isinstance(newest, RefRecord)
                         else "its newest ref cannot be read")
                verdict = {"ok": False, "code": RefusalCode.FENCED.value,
                           "message": f"a fresh start of {run}/{step} would fork its history: it already has "
                                      f"{len(refs)} generations ({named}); continue it with --resume latest, or "
                                      "start another --run"}
            else:
                self.follows = 0
                verdict = {"ok": True}
        verdict = broadcast_json(verdict)
        if not verdict["ok"]:
            raise Refusal(verdict["code"], verdict["message"])

    def _open_own_part(self, root: str, wanted: list[WantedSlice]):
        """Open the generation for this owner's words only: the manifests and shards that hold them."""
        roles: set[int] = {0}

        def saved_roles(m) -> list[int]:
            # Which saved roles hold this owner's words: by the saved layout, pure arithmetic.
            meta = m.metadata if isinstance(m.metadata, dict) else {}
            layout = meta.get("layout") if isinstance(meta.get("layout"), dict) else {}
            partitioned = set(layout.get("partitioned") or []) if layout.get("rule") == "shares" else set()
            for w in wanted:
                if w.ordinal in partitioned and w.ordinal < len(m.regions):
                    roles.update(owners_holding(m.regions[w.ordinal].words, m.owners, w.lo, w.hi))
            return sorted(roles)

        generation = open_generation(self.store, root, role=saved_roles, wanted=wanted)
        m = generation.manifest
        meta = m.metadata if isinstance(m.metadata, dict) else {}
        try:
            # Each owner checks its own device against what the generation recorded for the
            # owners it reads (with placement binding: for its own rank, UUID included).
            bound = bool(meta.get("bind_placement"))
            if m.publisher.kind == "tree":
                own = [g for g in generation.manifests if g.publisher.role == (self.rank if bound else -1)]
                read = own or [g for g in generation.manifests if g.publisher.role in roles]
                saved = [g.metadata.get("device") if isinstance(g.metadata, dict) else None for g in read]
            else:
                devices = meta.get("devices") if isinstance(meta.get("devices"), list) else []
                saved = devices[self.rank:self.rank + 1] if bound else devices
            check_devices(saved or [None], [self.own_device] * (1 if bound else len(saved or [None])), bound)
        except BaseException:
            generation.close()
            raise
        return generation

    def _agree(self, refusal: Refusal | None) -> None:
        """Collective verdict: if any owner refused, every owner raises the lowest-ranked owner's refusal."""
        first = torch.tensor([self.rank if refusal is not None else self.world], dtype=torch.int64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.control_group)
        src = int(first.item())
        if src == self.world:
            return
        mine = {"code": refusal.code.value, "message": f"owner {self.rank}: {refusal.message}"} \
            if self.rank == src else None
        verdict = broadcast_json(mine, src)
        raise Refusal(verdict["code"], verdict["message"])

    def publish_output(self) -> str:
        """Owner 0 publishes the fitted model once, atomically (safetensors), as the step's declared output.

        The name is the BLAKE3 of canonical bytes, so the same model always has
        the same name: one that is there already is not written again.
        """
        data = canonical_safetensors({n: p.detach().cpu().contiguous() for n, p in self.state.params.items()},
                                     {"run": self.config.run, "step": self.config.step,
                                      "update": str(self.state.update)})
        name = output_name(data)
        root_fd = os.open(self.store.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            out_fd = durable.make_dir_durable(root_fd, "outputs")
            run_fd = durable.make_dir_durable(out_fd, self.config.run)
            step_fd = durable.make_dir_durable(run_fd, self.config.step)
            tmp_fd = os.open("tmp", os.O_RDONLY | os.O_DIRECTORY, dir_fd=root_fd)
            try:
                if not _exists(step_fd, name):
                    durable.durable_commit(tmp_dir=tmp_fd, dest_dir=step_fd, write=lambda fd: write_all(fd, data),
                                           name=name, kind="output")
            except FileExistsError:
                pass  # published meanwhile: same name, same content
            finally:
                for fd in (tmp_fd, step_fd, run_fd, out_fd):
                    os.close(fd)
        finally:
            os.close(root_fd)
        # Absolute: the line is read by whoever ran the job, maybe from another directory.
        return os.path.abspath(os.path.join(self.store.root, "outputs", self.config.run, self.config.step, name))


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def canonical_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes that depend only on the tensors and the metadata.

    safetensors writes its ``__metadata__`` map in hash-map order, which
    differs from one call to the next; the header is written again with that
    map's keys sorted. The rest of the header (tensor entries in safetensors'
    own order, compact JSON, padded with spaces to 8 bytes) and the data bytes
    are safetensors' own, so readers see the same file.
    """
    from safetensors.torch import save as safetensors_save
    data = safetensors_save(tensors, metadata=metadata)
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + size:]


def output_name(data: bytes) -> str:
    """The published output's file name: a BLAKE3 prefix of its canonical bytes."""
    return f"model-{blake3.blake3(data).hexdigest()[:16]}.safetensors"


def say(line: str) -> None:
    """One log line on stderr in one write(2): owners and the background save thread share the stream,
    and a line written in two pieces (text, then newline) can be split by another writer."""
    os.write(sys.stderr.fileno(), (line + "\n").encode("utf-8", "replace"))


def emit_event(event: str, **fields) -> None:
    """A log collector gets one JSON line; a terminal gets a short line for a publish."""
    if not is_tty(sys.stderr):
        buffer = io.StringIO()
        emit(event, buffer, **fields)
        say(buffer.getvalue().rstrip("\n"))
    elif event == "publish":
        say(f"alpha-run: generation {fields.get('generation')} (update {fields['update']}): "
              f"{format_bytes(fields.get('bytes') or 0)}, {format_bytes(fields['bytes_written'])} written, "
              f"{fields['seconds']:.3g} s ({fields['mode']}), training stalled {fields['stall_s']:.3g} s")
    elif event == "checkpoint_skipped":
        pass  # the human line was printed by the caller


class CheckpointSchedule:
    """Which update boundaries publish: every K updates, or Young/Daly's interval (``auto``).

    ``auto`` measures the seconds per update and the checkpoint cost (sync:
    the publish; async: the training stall), and owner 0 turns
    sqrt(2 x C x M) into a number of updates that every owner applies; an
    asynchronous save's interval is at least one save long, so saves do not
    queue. Without --checkpoint-cost the first checkpoint comes after the
    first update, to measure C.
    """

    def __init__(self, args):
        self.auto = str(args.checkpoint_every) == "auto"
        self.every = 0 if self.auto else int(args.checkpoint_every)
        self.mtbf_s = parse_duration(args.mtbf) if self.auto else None
        self.assumed_cost_s = parse_duration(args.checkpoint_cost) if self.auto and args.checkpoint_cost else None
        self.update_seconds: list[float] = []
        self.next_due: int | None = None
        self.measuring = False  # the checkpoint that measures C was taken

    def due(self, update: int) -> bool:
        if not self.auto:
            return bool(self.every) and update % self.every == 0
        if self.next_due is None:
            if self.assumed_cost_s is None and not self.measuring:
                self.measuring = True  # measure the cost at the first boundary
                return True
            return False  # an asynchronous measuring save is still running
        return update >= self.next_due

    def needs_first_plan(self) -> bool:
        return self.auto and self.next_due is None

    def replan(self, owner: "Owner") -> None:
        """Collective: owner 0 plans from what it measured; every owner takes its number of updates."""
        if not self.auto:
            return
        decision = None
        if owner.rank == 0:
            costs = owner.checkpoint_costs[-3:]
            cost = statistics.fmean(costs) if costs else self.assumed_cost_s
            if cost is None:  # the measuring save has not completed yet: plan at a later boundary
                broadcast_json({"every": None}, 0, owner.control_group)
                return
            update_s = statistics.median(self.update_seconds[-20:])
            plan = young_daly(cost, self.mtbf_s)
            floor = owner.last_save_s if owner.saver is not None else 0.0
            every = plan.every_updates(update_s, floor)
            source = "measured over the last %d checkpoints" % len(costs) if costs else "assumed (--checkpoint-cost)"
            say(f"alpha-run: {plan.describe()}; C {source}; every {every} updates at {update_s:.3g} s per update")
            emit_event("checkpoint_interval", **plan.to_json(), cost_source="measured" if costs else "assumed",
                       update_s=update_s, every_updates=every, update=owner.state.update)
            decision = {"every": every}
        decision = broadcast_json(decision, 0, owner.control_group)
        if decision["every"] is not None:
            self.next_due = owner.state.update + decision["every"]


def generation_epoch(store: Store, root: str) -> int:
    """The membership epoch a published generation was saved in (its root manifest's prefix)."""
    with open_generation(store, root, role=0, wanted=[]) as generation:
        return generation.manifest.prefix.epoch


def run_owner(args) -> int:
    try:
        # The checks alpha-run made before starting us; under plain torchrun they are new.
        config = check_job_args(args, args.set)
        check_store_writable(args.store)
    except UsageError as exc:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one line per node, not one per owner
            say(f"alpha-run: {exc}")
        return EXIT_USAGE
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = compute_device(backend)
    configure_determinism()  # before the first CUDA kernel: cuBLAS reads its workspace setting once
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout), device_id=device)
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    store = Store(args.store)
    owner = Owner(config, store, device, publisher=args.publisher, fanout=args.fanout,
                  commit_timeout=args.commit_timeout, save=args.save, in_flight=args.in_flight)
    try:
        reached = None  # the resumed generation, when it is at --updates already: nothing to train or save
        if args.resume_from or args.resume or args.branch_from:
            owner.resume(args.resume_from or args.branch_from, latest=args.resume == "latest",
                         branch=args.branch_from is not None)
            if owner.state.update >= args.updates:
                reached = owner.last_generation
                if owner.rank == 0:
                    say(f"alpha-run: generation {reached} is at update {owner.state.update} already "
                        f"(--updates {args.updates}): nothing to train")
        else:
            owner.start_fresh()
        schedule = CheckpointSchedule(args)
        kill_at = os.environ.get(KILL_ENV)  # test hook: "RANK:UPDATE" SIGKILLs that owner after that update
        while owner.state.update < args.updates:
            started = time.monotonic()
            owner.train_update()
            schedule.update_seconds.append(time.monotonic() - started)
            if kill_at == f"{owner.rank}:{owner.state.update}":
                os.kill(os.getpid(), signal.SIGKILL)
            final = owner.state.update == args.updates
            if final or schedule.due(owner.state.update):
                owner.checkpoint(final)
                if not final:
                    schedule.replan(owner)
            elif schedule.needs_first_plan():
                schedule.replan(owner)
            if owner.saver is not None:
                owner.reap()
        owner.finish_saves()
        tensors = owner.materialize()
        output = owner.publish_output() if owner.rank == 0 else None
        if owner.rank == 0 and args.discard_checkpoints:
            # Checkpoints are the step's scratch: with its output published they have served.
            plan = discard_completed_step(store, config.run, config.step, time.time())
            say(f"alpha-run: output published; discarded {len(plan.refs)} checkpoints of {config.run}/{config.step} "
                  f"and {len(plan.objects)} objects only they reached")
            emit_event("checkpoints_discarded", run=config.run, step=config.step, generations=len(plan.refs),
                       objects=len(plan.objects), pinned=plan.pinned)
        if owner.rank == 0:
            # Nothing ran in a new epoch when the generation was reached already: the line describes that one.
            epoch = owner.epoch if reached is None else generation_epoch(store, reached)
            print(json.dumps({"state_digest": state_digest(tensors, owner.state.update, owner.state.cursor),
                              "last_generation": owner.last_generation, "update": owner.state.update,
                              "cursor": owner.state.cursor, "epoch": epoch, "owners": owner.world,
                              "output": output}), flush=True)
        dist.barrier()
        return EXIT_OK
    finally:
        store.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        code = run_owner(args)
    except Refusal as refusal:
        say(f"alpha-run: refused [{refusal.code.value}] {refusal.message}")
        code = EXIT_REFUSED
    except (PublishFailed, DurableWriteError) as exc:
        say(f"alpha-run: publish failed: {exc}")
        code = EXIT_RETRY
    except (RuntimeError, ConnectionError, dist.DistBackendError) as exc:
        say(f"alpha-run: owner failed: {exc}")
        code = EXIT_RETRY
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    # Under alpha-run the owner bound its life to the launcher on its first import
    # (alpha_ckpt/lifeline.py); under plain torchrun it binds to the agent now.
    lifeline.bind_to_parent()
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip C++ static destructors: gloo's threads can otherwise hit std::terminate
    # at interpreter exit ("terminate called without an active exception",
    # SIGABRT) after a run that finished and published correctly.
    os._exit(exit_code)
