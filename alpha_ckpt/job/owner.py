"""One owner of the forecasting job. Started by `alpha-run` (or plain `torchrun -m alpha_ckpt.job`).

    torchrun --nproc-per-node 4 -m alpha_ckpt.job configs/forecast.toml --store S --updates 5

The job is the first client of the collective layer (:mod:`alpha_ckpt.collective`):
every owner trains its share of each update and combines gradients in owner
order; checkpoints are :class:`~alpha_ckpt.collective.Checkpointer` saves (star or
tree, sync or async), resumes are its restores (the owners validate what each
restores and agree on the verdict before any of them trains). What this module
adds is the learner: its state, its identity and bindings (model, rates, input
sequence, numerical contract, combine order, placement), the schedule, the
declared output. Exit codes: 0 done, 3 refused, 75 retryable failure, 2 usage.
"""
from __future__ import annotations

import dataclasses
import io
import datetime
import json
import os
import sys
import time
from typing import Any

import blake3
import torch
import torch.distributed as dist

from alpha_ckpt.collective import Checkpointer
from alpha_ckpt.runtime.progress import emit, format_bytes, is_tty
from alpha_ckpt.errors import DurableWriteError, PublishFailed, Refusal, RefusalCode
from alpha_ckpt.format.records import canonical_json
from alpha_ckpt.runtime.heartbeat import bound_collectives
from alpha_ckpt.job.learner.config import JobConfig
from alpha_ckpt.job.learner.data import shares
from alpha_ckpt.job.learner.digest import state_digest
from alpha_ckpt.job.learner.model import (
    COMBINE_ORDER, LearnerState, apply_update, combine, configure_determinism, share_gradient, sum_in_owner_order,
)
from alpha_ckpt.state import capture_state
from alpha_ckpt.state.placement import Partitioned
from alpha_ckpt.upkeep.gc import discard_completed_step
from alpha_ckpt.generation.reader import open_generation
from alpha_ckpt.store import Store
from alpha_ckpt.launch.usage import OneLineArgumentParser, UsageError, check_store_writable
from alpha_ckpt.job.usage import JOB_OPTIONS, MEMORY_OPTIONS, check_job_args
from alpha_ckpt.runtime import hooks, launch_env
from alpha_ckpt.runtime import options as options_core

EXIT_OK, EXIT_USAGE, EXIT_REFUSED, EXIT_RETRY = 0, 2, 3, 75
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
    """The job's arguments. Launched by alpha-run (``alpha-run ... -m alpha_ckpt.job CONFIG --updates N``), the
    store, the resume choice, the Checkpointer options and the process groups' timeout come from alpha-run's
    hand-off, as any script's do (alpha_ckpt/runtime/launch_env.py); a flag given here wins. Under plain
    torchrun the flags alone say them."""
    p = OneLineArgumentParser(prog="alpha_ckpt.job", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--store", help="store directory (default: alpha-run's --store, else ./alpha-store)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (run=NAME names the run)")
    p.add_argument("--updates", type=int, required=True, help="committed update count to reach (absolute)")
    p.add_argument("--discard-checkpoints", action="store_true",
                   help="once the declared output is published, remove this step's checkpoints (pins excepted)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume-from", metavar="ROOT_DIGEST", help="continue exactly this generation or refuse")
    resume.add_argument("--resume", choices=["latest"], help="continue the newest complete generation")
    resume.add_argument("--branch-from", metavar="ROOT_DIGEST",
                        help="start a new run (--set run=NEW_RUN, no generations yet) from another run's generation")
    options_core.add_flags(p, JOB_OPTIONS)  # the Checkpointer's options the job takes, as alpha-run spells them
    p.add_argument("--backend", choices=["gloo", "nccl"])
    p.add_argument("--timeout", type=float, help="process-group timeout, seconds (default: alpha-run's, else 120)")
    return p.parse_args(argv)


def settle(args):
    """Fill what the job's flags left out from alpha-run's hand-off (a script of alpha-run's), else defaults."""
    launched = launch_env.launcher_settings() if os.environ.get(launch_env.OPTIONS) else {}
    if any(launched.get(name) not in (None, options_core.by_name()[name].default) for name in MEMORY_OPTIONS):
        raise UsageError("--memory, --replicas, --durable-every and --mtbf-durable are for training scripts (the "
                         "job publishes every generation to the store)")
    args.store = args.store or launched.get("store") or "./alpha-store"
    if not (args.resume_from or args.resume or args.branch_from) and launched.get("resume") not in (None, "latest"):
        args.resume_from = launched["resume"]  # alpha-run --resume-from (a restart's choice: attempt_resume)
    elif not (args.resume_from or args.resume or args.branch_from) and "resume" in launched:
        args.resume = "latest"
    for name in JOB_OPTIONS:
        if getattr(args, name, None) is None and launched.get(name) is not None:
            value = launched[name]
            setattr(args, name, value if isinstance(value, str) else str(value))
    if args.timeout is None:
        args.timeout = launch_env.process_group_timeout() or 120.0
    return args


class Owner:
    def __init__(self, config: JobConfig, store: Store, device: torch.device = torch.device("cpu"),
                 **options: Any):
        """``options``: the Checkpointer's (alpha_ckpt/runtime/options.py) the job's flags gave."""
        self.config, self.store, self.device = config, store, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.state = LearnerState.initial(config, device)
        self.last_generation = None
        self.named = list(capture_state(self.state.tensors()).named)
        self.owned = [self._owned(name, t) for name, t in self.named]
        self.segments = [{"owners": self.world, "from": 0, "combine_order": COMBINE_ORDER}]
        self.ckpt = Checkpointer(store, run=config.run, step=config.step, identity=learner_identity(config),
                                 metadata=self.metadata(), bindings=self._check_binding,
                                 bind_devices=config.bind_placement, **options)
        self._unreported: list[tuple[object, int]] = []  # asynchronous saves not yet reported
        self._plans_reported = 0

    @property
    def epoch(self) -> int:
        return self.ckpt.epoch

    @property
    def asynchronous(self) -> bool:
        return self.ckpt.options.save == "async"

    def _owned(self, name: str, t: torch.Tensor):
        """None for replicated words; this owner's contiguous word range for partitioned ones."""
        mode = self.config.parameters
        if name.startswith("optim.") and not name.startswith("optim.scalars."):
            partitioned = mode in ("partitioned", "optimizer")
        else:
            partitioned = mode == "partitioned" and name.startswith("model.")
        return shares(t.numel(), self.world)[self.rank] if partitioned else None

    def checkpoint_state(self) -> dict:
        """The state the Checkpointer saves and restores: replicated tensors whole, partitioned ones as
        this owner's share (a view: a restore fills the owner's own tensors in place)."""
        return {name: t if own is None else Partitioned(t.view(-1)[own[0]:own[1]], own[0], own[1], tuple(t.shape))
                for (name, t), own in zip(self.named, self.owned)}

    def metadata(self) -> dict:
        """The root manifest's bindings besides the learner's identity (the Checkpointer adds the devices
        and which owner saved which words).

        ``placement`` says whether the checkpoint binds its owner count;
        ``segments`` is the placement history that produced the state (owner
        count and combine order from each update on), which is what an oracle
        needs to reproduce it.
        """
        return {"contract": numerical_contract(self.device.type), "config": self.config.to_json(),
                "parameters": self.config.parameters, "bind_placement": self.config.bind_placement,
                "placement": {"bound": self.config.bind_placement, "owners": self.world},
                "segments": self.segments}

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

    def checkpoint(self, final: bool) -> None:
        """Collective, at an update boundary: publish now (sync) or snapshot and publish in the background."""
        update, cursor = self.state.update, self.state.cursor
        if not self.asynchronous:
            root = self.ckpt.save(self.checkpoint_state(), update=update, cursor=cursor).root
            self._committed(root, self.ckpt.last_save, seconds=self.ckpt.last_save["seconds"],
                            stall=self.ckpt.last_save["seconds"], mode="sync")
            return
        self.reap()
        if final:
            self.finish_saves()  # the last update is always published
        # The copy is taken on the save thread; the next optimizer step waits for it (wait_for_snapshot).
        handle = self.ckpt.save(self.checkpoint_state(), update=update, cursor=cursor, defer_snapshot=not final)
        if handle.skipped:  # --in-flight skip: every owner skipped, or none did
            if self.rank == 0:
                say(f"alpha-run: update {update} not checkpointed: the save of update "
                    f"{self._unreported[-1][1] if self._unreported else '?'} is still in flight (--in-flight skip)")
                emit_event("checkpoint_skipped", update=update, reason="save in flight")
            return
        self._unreported.append((handle, update))
        if final:
            self.finish_saves()

    def _committed(self, root: str, stats: dict, *, seconds: float, stall: float, mode: str) -> None:
        self.last_generation = root
        # Only after the durable completion: the ref naming ``root`` exists.
        say(f"alpha-run: owner {self.rank} committed update {stats['update']} as {root}")
        self._report(stats, root, seconds=seconds, stall=stall, mode=mode)

    def report_plan(self) -> None:
        """Owner 0: one line and one event for each checkpoint interval the schedule planned."""
        schedule = self.ckpt.schedule
        if schedule.plans == self._plans_reported:
            return
        self._plans_reported = schedule.plans
        if self.rank == 0 and schedule.planned is not None:
            p = schedule.planned
            source = "measured" if p["cost_source"] == "measured" else "assumed (--checkpoint-cost)"
            say(f"alpha-run: {schedule.plan.describe()}; C {source}; every {p['every_updates']} updates at "
                f"{p['update_s']:.3g} s per update")
            emit_event("checkpoint_interval", **p)

    def wait_for_snapshot(self) -> None:
        self.ckpt.wait_snapshot()

    def reap(self) -> None:
        """Report the asynchronous saves that completed; a failed one is raised here (never swallowed)."""
        while self._unreported and self._unreported[0][0].done() and self.ckpt.snapshotting is not self._unreported[0][0]:
            handle, _ = self._unreported.pop(0)
            root = handle.result()
            self._committed(root, handle.stats, seconds=handle.save_s, stall=handle.stall_s, mode="async")

    def finish_saves(self) -> None:
        if self.asynchronous:
            self.ckpt.wait()
            self.reap()

    def _report(self, stats: dict, root: str, *, seconds: float, stall: float, mode: str) -> None:
        """Owner 0: one structured event per publish (``seconds``: boundary to durable)."""
        if self.rank == 0:
            emit_event("publish", run=self.config.run, step=self.config.step, root=root, mode=mode,
                       owners=self.world, update=stats["update"], generation=stats["generation"],
                       bytes=stats["bytes"], bytes_written=stats["bytes_written"], seconds=round(seconds, 6),
                       stall_s=round(stall, 6))

    def _check_binding(self, m) -> None:
        """The learner's bindings besides its identity (the Checkpointer checks that, run/step and epochs)."""
        meta = m.metadata if isinstance(m.metadata, dict) else {}
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

    def resume(self, root: str | None, latest: bool, branch: bool = False) -> None:
        """Collective: the Checkpointer picks the generation (owner 0 checks its bindings), every owner
        validates only what it restores, and all agree before any owner copies a byte. A continuation
        runs in the generation's epoch + 1; a branch starts a new run (epoch 0) from another run's."""
        counters = self.ckpt.restore(self.checkpoint_state(), root="latest" if latest else root, branch=branch)
        if counters is None:
            if self.rank == 0:
                say(f"alpha-run: {self.config.run}/{self.config.step} has no generation yet: --resume latest "
                    "starts at update 0")
            return
        if self.config.parameters == "partitioned":
            self._all_gather_params()  # each owner restored its own range of the parameters
        self.state.update, self.state.cursor = counters.update, counters.cursor
        self.last_generation = counters.root
        # The placement history goes on: a new segment when the owner count changed.
        self.segments = [dict(s) for s in counters.metadata["segments"]]
        if self.segments[-1].get("owners") != self.world:
            self.segments.append({"owners": self.world, "from": counters.update, "combine_order": COMBINE_ORDER})
        self.ckpt.metadata = self.metadata()
        read = self.ckpt.last_restore
        say(f"alpha-run: owner {self.rank} restored update {counters.update} from {counters.root}: read "
            f"{read['bytes_read']} payload bytes of {read['shards']} shards and {read['manifests']} manifests, of "
            f"{read['published'] if read['published'] is not None else '?'} bytes published")

    def start_fresh(self) -> None:
        """Collective: a fresh start (epoch 0) owns a run/step only if it has no generation yet; a retry
        continues the first with --resume latest instead (the Checkpointer refuses a second history)."""
        self.ckpt.restore(self.checkpoint_state(), root=None)

    def publish_output(self) -> str:
        """Owner 0 publishes the fitted model once, atomically (safetensors), as the step's declared output.

        The name is the BLAKE3 of canonical bytes, so the same model always has
        the same name: one that is there already is not written again.
        """
        data = canonical_safetensors({n: p.detach().cpu().contiguous() for n, p in self.state.params.items()},
                                     {"run": self.config.run, "step": self.config.step,
                                      "update": str(self.state.update)})
        name = output_name(data)
        # Absolute: the line is read by whoever ran the job, maybe from another directory.
        return self.store.put_output(self.config.run, self.config.step, name, data)


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


def generation_epoch(store: Store, root: str) -> int:
    """The membership epoch a published generation was saved in (its root manifest's prefix)."""
    with open_generation(store, root, role=0, wanted=[]) as generation:
        return generation.manifest.prefix.epoch


@dataclasses.dataclass(frozen=True)
class Resume:
    """What this attempt restores: ``latest``, or generation ``root`` (``branch``: into a new run)."""
    root: str | None = None
    latest: bool = False
    branch: bool = False


def branched(args) -> bool:
    """Whether the run a --branch-from started has a generation yet (a restart then continues it)."""
    config = check_job_args(args, args.set)
    with Store(args.store, create=False) as store:
        return bool(store.history(config.run, config.step).entries)


def attempt_resume(args) -> Resume | None:
    """What this attempt of the job resumes (None: a fresh start).

    The first attempt: its flags. A restart (alpha-run --max-restarts): what the launcher chose once
    the previous attempt stopped (alpha_ckpt/runtime/launch_env.py's RestartContext.resume: the newest
    generation, or ROOT again after alpha-run --resume-from ROOT while nothing continued it); after
    --branch-from, the new run's newest generation once it has one (:func:`branched`), else the branch again. Restarted by plain torchrun, which chooses nothing: the newest generation,
    unless the flags name a generation (--resume-from, --branch-from), which are kept.
    """
    restart = launch_env.restart_context()
    if restart is not None and args.branch_from:  # the new run's newest generation, or the branch again
        return Resume(latest=True) if restart.resume is not None and branched(args) else \
            Resume(root=args.branch_from, branch=True)
    if restart is not None and restart.resume is not None:
        return Resume(latest=True) if restart.resume == "latest" else Resume(root=restart.resume)
    if restart is None and launch_env.restart_attempt() > 0 and not (args.resume_from or args.branch_from):
        return Resume(latest=True)
    if args.resume_from or args.resume or args.branch_from:
        return Resume(root=args.resume_from or args.branch_from, latest=args.resume == "latest",
                      branch=args.branch_from is not None)
    return None


def run_owner(args) -> int:
    try:
        settle(args)
        config = check_job_args(args, args.set)
        check_store_writable(args.store)
    except UsageError as exc:
        # Under alpha-run the launcher says it once, naming the owners (a rank that ends first may see its
        # peers stopped before they print); under plain torchrun one line per node, not one per owner.
        if not launch_env.record_verdict("usage", str(exc)) and os.environ.get("LOCAL_RANK", "0") == "0":
            say(f"alpha-run: {exc}")
        return EXIT_USAGE
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = compute_device(backend)
    configure_determinism()  # before the first CUDA kernel: cuBLAS reads its workspace setting once
    bound_collectives(args.timeout)  # the Checkpointer's own groups are bounded by --timeout too
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout), device_id=device)
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    store = Store(args.store)
    options = options_core.from_flags(args, JOB_OPTIONS)
    owner = Owner(config, store, device, **options)
    try:
        reached = None  # the resumed generation, when it is at --updates already: nothing to train or save
        resume = attempt_resume(args)
        if resume is not None:
            owner.resume(resume.root, latest=resume.latest, branch=resume.branch)
            if owner.state.update >= args.updates:
                reached = owner.last_generation
                if owner.rank == 0:
                    say(f"alpha-run: generation {reached} is at update {owner.state.update} already "
                        f"(--updates {args.updates}): nothing to train")
        else:
            owner.start_fresh()
        scheduled = options.get("every") is not None  # else only the final update is published
        while owner.state.update < args.updates:
            owner.train_update()
            hooks.installed().after_update(owner.rank, owner.state.update)
            final = owner.state.update == args.updates
            # due() on every owner at every update: it times the updates, and plans --checkpoint-every auto.
            due = owner.ckpt.due(owner.state.update) if scheduled else False
            if final or due:
                owner.checkpoint(final)
            owner.report_plan()
            if owner.asynchronous:
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
        # Under alpha-run the launcher tells it once, naming the owners that met it (launch_env.record_verdict).
        if not launch_env.record_verdict("refused", f"[{refusal.code.value}] {refusal.message}"):
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

