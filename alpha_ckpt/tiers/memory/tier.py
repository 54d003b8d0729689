"""The memory tier: every save held in host memory, on this rank and on peers, under the store's digests.

Each rank has a *holder*: an ordinary :class:`~alpha_ckpt.store.Store` rooted
in host memory (a tmpfs directory, ``/dev/shm`` by default), one per rank. A
holder outlives its rank's process (a restarted rank finds it) but not the
node, and alpha-run removes the tier when it exits, so a whole-job loss
resumes from the durable store.

The tier keeps the seam of :mod:`alpha_ckpt.tiers.seam`. Inside one save (the ranks already agreed on
the layout), ``tier.publish(contribution)``: the star publisher minus the ref writes every rank's shards
into its own holder, :meth:`MemoryTier.replicate` copies them to peers, then the ref goes on every holder.
Inside one restore of "latest": ``tier.newest(...)`` (rank 0: the newest generation any holder names
that descends from the store), then ``with tier.reader(candidate, wanted)``: every rank pulls what its
restore reads (:meth:`MemoryTier.assemble`) and reads it from its holder and its node's, through the one
validator (``collective.resume.prepare_planned``).

A memory generation counts (its ref is written) only once every object it
names is held by at least two ranks, every copy checked against its name.
Ranks whose holders share a tmpfs (one node) copy through the files, and a
restore reads the objects its node holds in place (:func:`node_view`); only
copies between nodes travel over the tier's gloo group. A
recovery hashes every copy it will use before any rank copies a byte;
anything missing or damaged anywhere makes every rank fall back to the
durable store together.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import fcntl
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Iterator, Sequence

import blake3
import torch
import torch.distributed as dist

from alpha_ckpt.store import durable
from alpha_ckpt.store.location import canonical

from alpha_ckpt.runtime import launch_env
from alpha_ckpt.store._posix import write_all
from alpha_ckpt.store.leases import process_alive, process_start

from alpha_ckpt.errors import DurableWriteError, Refusal, StoreUsageError, UsageError
from alpha_ckpt.format.records import CapturePrefix
from alpha_ckpt.generation.opening import open_generation
from alpha_ckpt.generation.payloads import validate_object_file
from alpha_ckpt.tiers.durable.messages import Candidate, Completion, Outcome, Record
from alpha_ckpt.tiers.durable.publisher import Contribution
from alpha_ckpt.tiers.seam import MEMORY, Reading
from alpha_ckpt.tiers.durable.star import StarPublisher
from alpha_ckpt.tiers.durable.wire import any_rank, broadcast_json, gather_json, global_rank
from alpha_ckpt.store import PosixBackend, RefRecord, Store, StoreLayout
from alpha_ckpt.store.read_through import ReadThroughBackend
from alpha_ckpt.tiers.memory.plan import Transfer, network_needs, plan_fetch, plan_replication, split_by_reach, under_held
from alpha_ckpt.tiers.memory.transfer import TransferReport, copy_through_files, run_transfers

logger = logging.getLogger("alpha_ckpt")

DEFAULT_PARENT = "/dev/shm"
STORE_PREFIX = "store-"  # + a store's instance id: the holders of that store under a tier directory
KEEP_GENERATIONS = 2  # memory generations each holder keeps: the newest, and the one a failed save leaves standing
MIN_HOLDERS = 2       # a memory generation counts only when every object it names has this many holders


@dataclass(frozen=True)
class MemoryGeneration(Record):
    """Rank 0 to every rank after a memory publish, or at a recovery: one generation's objects."""

    KIND = "memory-generation"
    root: str
    root_size: int
    objects: list = field(default_factory=list)  # [[digest, size], ...]: the shards the root names
    holders: list = field(default_factory=list)  # recovery: the ranks whose holders name the root
    epoch: int = 0
    update: int = 0
    lineage: dict | None = None  # {"store": instance id, "follows": [generation, root] or None}: see lineage()
    skipped: list = field(default_factory=list)  # recovery: why newer generations were not taken


@dataclass
class TierReport:
    """What one memory save or recovery did on this rank (and, summed over the ranks, on all)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    failure: str | None = None


def memory_directory(options: Any, store_root: str) -> str:
    """The tier's directory: the one given, alpha-run's for this launch (``--memory``), or one under
    /dev/shm named by the store, run and step (so a restarted rank finds its holder again)."""
    if isinstance(options.memory, str):
        return os.path.abspath(options.memory)
    launched = launch_env.memory_directory()
    if launched is not None:
        return launched
    key = blake3.blake3(f"{canonical(store_root)}\0{options.run}\0{options.step}".encode()).hexdigest()[:16]
    return os.path.join(default_root(), key)


def default_root() -> str:
    """Where the tier directories named by store, run and step lie (one per user)."""
    parent = DEFAULT_PARENT if os.path.isdir(DEFAULT_PARENT) else tempfile.gettempdir()
    return os.path.join(parent, f"alpha-ckpt-{os.getuid()}")


def store_tier_directory(directory: str, instance: str) -> str:
    """Where the holders of the store with instance id ``instance`` lie under the tier directory
    ``directory``: stores sharing a tier directory never share a holder."""
    return os.path.join(directory, f"{STORE_PREFIX}{instance}")


def holders_of(directory: str, store: str) -> str:
    """The holders' directory of the store at path ``store`` under the tier directory ``directory`` (tools
    and tests: where a job's memory copies of that store lie)."""
    with Store(store, create=False) as opened:
        if opened.instance is None:
            raise UsageError(f"store {store!r} has no instance id: no memory tier holds its generations")
        return store_tier_directory(os.path.abspath(directory), opened.instance)


def lineage(instance: str, follows: tuple[int, str] | None) -> dict:
    """What a memory generation records of where it comes from: the store's instance id, and the store's
    generation (number, root) it descends from (None: none yet; such a generation is taken only if the
    store holds its very root)."""
    return {"store": instance, "follows": list(follows) if follows is not None else None}


def rejection(lineage_: dict | None, root: str, instance: str, holds: Callable[[int | None, str], bool]) -> str | None:
    """Why a memory generation ``root`` with ``lineage_`` is not this store's (None: it is). ``holds(generation,
    root)`` says whether the store holds that generation (generation None: any with that root). Pure."""
    if lineage_ is None:
        return "it records no store it belongs to"
    if lineage_["store"] != instance:
        return f"it belongs to another store (instance {lineage_['store'][:12]}..., this store is {instance[:12]}...)"
    if holds(None, root):
        return None
    follows = lineage_["follows"]
    if follows is None:
        return "it descends from no generation this store holds"
    if not holds(follows[0], follows[1]):
        return f"it descends from generation {follows[0]} (root {follows[1][:16]}...), which this store does not hold"
    return None


class Job:
    """Who uses a store's holders under a tier directory: the launcher process of this node (its pid and
    start time, so a reused pid is not taken for it) and the launch's run id (torchrun's rendezvous id,
    alpha-run's launch). A job is dead once its launcher is gone and the run id is not this job's: a
    restart within the same run keeps its holders, under a new launcher process too."""

    FILE = "job.json"
    UNNAMED_RUNS = (None, "", "none")  # torchrun's default rendezvous id names no particular run

    def __init__(self, launcher: int, started: int | None, run_id: str | None):
        self.launcher, self.started, self.run_id = launcher, started, run_id

    @classmethod
    def this(cls) -> "Job":
        parent = os.getppid()
        return cls(parent, process_start(parent), launch_env.run_id())

    def to_json(self) -> dict:
        return {"launcher": self.launcher, "started": self.started, "run_id": self.run_id}

    @classmethod
    def read(cls, directory: str) -> "Job | None":
        try:
            with open(os.path.join(directory, cls.FILE), "rb") as f:
                obj = json.loads(f.read(4096))
            return cls(int(obj["launcher"]), obj["started"], obj["run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def same_run(self, other: "Job") -> bool:
        return self.run_id not in self.UNNAMED_RUNS and self.run_id == other.run_id

    def alive(self) -> bool:
        return process_alive(self.launcher, pid_start=self.started) is not False


def claim_store_directory(directory: str, instance: str, job: Job) -> str:
    """Make the holders' directory of store ``instance`` under the tier directory ``directory`` this job's:
    first remove every store directory there whose job is dead (host memory a crashed job left behind; under
    the default location, in the tier directories of other stores too), then create this store's if
    missing, naming this job. Under a lock per tier directory: the ranks of one node do it at once."""
    os.makedirs(directory, exist_ok=True)
    root = default_root()
    if os.path.dirname(os.path.abspath(directory)) == root:
        for name in sorted(os.listdir(root)):
            other = os.path.join(root, name)
            if other != os.path.abspath(directory) and os.path.isdir(other) and not os.path.islink(other):
                with _locked(other):
                    _remove_dead_jobs(other, job)
    with _locked(directory):
        _remove_dead_jobs(directory, job)
        mine = store_tier_directory(directory, instance)
        os.makedirs(mine, exist_ok=True)
        if not os.path.exists(os.path.join(mine, Job.FILE)):
            fd = os.open(mine, os.O_RDONLY | os.O_DIRECTORY)
            try:
                durable.durable_commit(tmp_dir=fd, dest_dir=fd, name=Job.FILE, kind="tier-job",
                                       write=lambda f: write_all(f, json.dumps(job.to_json()).encode()))
            except FileExistsError:
                pass
            finally:
                os.close(fd)
    return mine


@contextlib.contextmanager
def _locked(directory: str):
    with open(os.path.join(directory, ".lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield


def _remove_dead_jobs(directory: str, job: Job) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not name.startswith(STORE_PREFIX) or os.path.islink(path) or not os.path.isdir(path):
            continue
        owner = Job.read(path)
        if owner is not None and not owner.same_run(job) and not owner.alive():
            shutil.rmtree(path, ignore_errors=True)


def replica_stride(world: int) -> int:
    """Copies go ``stride`` ranks away: the ranks of one node apart when the job spans nodes (so a copy is
    on another node), the next rank on one node."""
    per_node = launch_env.ranks_per_node()
    return per_node if per_node and world > per_node and world % per_node == 0 else 1


def holder_directory(parent: str, rank: int) -> str:
    """Where rank ``rank`` keeps its holder under the tier's directory."""
    return os.path.join(parent, f"rank-{rank:05d}")


def node_view(holder: str, peers: Sequence[str]) -> Store:
    """The holder at ``holder``, reading an object it lacks from the holders at ``peers`` (read only:
    no write goes to a peer's holder through it)."""
    def opened(path: str) -> PosixBackend:
        return PosixBackend(StoreLayout(path), create=False)
    own = opened(holder)
    try:
        peer_backends = []
        for path in peers:
            peer_backends.append(opened(path))
    except BaseException:
        for backend in (own, *peer_backends):
            backend.close()
        raise
    return Store(ReadThroughBackend(own, peer_backends), create=False)


class MemoryTier:
    """This rank's holder and the tier's collective steps over ``group`` (a gloo group of the tier's own)."""

    name = MEMORY

    def __init__(self, directory: str, *, store: Store, instance: str, rank: int, world: int, copies: int,
                 stride: int = 1, group: Any = None, identity: Any = None):
        """Collective over ``group``. ``directory``: the tier directory (shared by stores; each store's holders
        lie under their own directory in it, named by the store's ``instance`` id). ``store``: the durable
        store this tier stands in front of (rank 0 reads its history: a memory generation is taken only if
        it descends from it). A tier that cannot be written on any rank is a :class:`UsageError` on every rank."""
        self.store = store
        if world < MIN_HOLDERS:
            raise UsageError(f"the memory tier keeps copies on peer ranks: it needs at least {MIN_HOLDERS} ranks, "
                             f"this group has {world}")
        if copies < MIN_HOLDERS:
            raise UsageError(f"the memory tier needs at least one copy on a peer (replicas >= 1)")
        self.rank, self.world, self.copies, self.stride, self.group = rank, world, copies, stride, group
        self.instance = instance
        problem, self.holder = None, None
        try:
            self.directory = claim_store_directory(directory, instance, Job.this())
            self.holder = Store(holder_directory(self.directory, rank), create=True, write_mode="buffered")
            self.holder.probe_write()
        except (OSError, Refusal, StoreUsageError, DurableWriteError) as exc:
            problem = f"rank {rank}: {exc}"
        problems = broadcast_json(gather_json(problem, global_rank(0, group), group), global_rank(0, group), group)
        failed = [p for p in problems if p is not None]
        if failed:
            if self.holder is not None:
                self.holder.close()
            raise UsageError(f"memory tier directory {directory!r} cannot hold the tier ({failed[0]})")
        self.identity = identity
        self.last: TierReport | None = None
        # The star publisher minus the ref: the tier writes its refs once the copies stand.
        self._publisher = StarPublisher(self.holder, rank, world, identity=identity, publish_ref=False)
        self.readable = self._readable_holders()
        self.skipped: list[str] = []  # the last newest(): newer memory generations passed over, and why
        self.phases: dict[str, float] = {}  # the last publish's seconds: write, commit, replicate
        self._offers: dict[str, MemoryGeneration] = {}

    def _readable_holders(self) -> frozenset[tuple[int, int]]:
        """Collective: the pairs (dst, src) where rank dst sees rank src's holder itself (the same directory:
        ranks of one node under one tier directory). Copies between them go through the files, not the network."""
        own = os.stat(self.holder.root)
        root = global_rank(0, self.group)
        ids = broadcast_json(gather_json([own.st_dev, own.st_ino], root, self.group), root, self.group)
        sees = []
        for src in range(self.world):
            try:
                st = os.stat(holder_directory(self.directory, src))
            except OSError:
                continue
            if src != self.rank and [st.st_dev, st.st_ino] == ids[src]:
                sees.append(src)
        every = broadcast_json(gather_json(sees, root, self.group), root, self.group)
        return frozenset((dst, src) for dst, srcs in enumerate(every) for src in srcs)

    def _node_view(self) -> Store:
        """What a restore of an assembled generation reads: this rank's holder, and in place the objects it
        lacks from the holders of its node (each validated by the restore, as every object it reads is).
        The caller closes it."""
        readable = sorted(src for dst, src in self.readable if dst == self.rank)
        return node_view(self.holder.root, [holder_directory(self.directory, src) for src in readable])

    def _carry(self, transfers: Sequence[Transfer]) -> TransferReport:
        """Collective: carry out ``transfers``, through the files between ranks that read each other's
        holders, over the tier's group between the others."""
        through_files, over_network = split_by_reach(transfers, self.readable)
        sources: dict[int, Store] = {}

        def source(src: int) -> Store:
            if src not in sources:
                sources[src] = Store(holder_directory(self.directory, src), create=False)
            return sources[src]
        try:
            report = copy_through_files(through_files, self.holder, self.rank, source)
        finally:
            for store in sources.values():
                store.close()
        return report.add(run_transfers(over_network, self.holder, self.rank, self.group))

    def close(self, discard: bool = False) -> None:
        """Release the holder; ``discard``: remove it too (the script is done with the tier)."""
        self.holder.close()
        if discard:
            shutil.rmtree(self.holder.root, ignore_errors=True)

    # ------------------------------------------------------------------ the tier seam (alpha_ckpt.tiers.seam)

    def publish(self, contribution: Contribution) -> Completion:
        """Collective: the contribution into this rank's holder, then copies to peers, then the tier's refs once
        they stand, each recording the store's generation this one descends from (``contribution.ancestor``).
        A failed completion, the same on every rank, when the generation does not count in memory."""
        self.last = None
        completion = self._publisher.publish(dataclasses.replace(contribution, follows=None))
        self.phases = dict(self._publisher.phases)
        if not completion.outcome.ok:
            return Completion.failed(Outcome(False, f"the memory tier: {completion.outcome.reason}"))
        started = time.perf_counter()
        report = self.replicate(contribution.prefix, completion, owners=self.world,
                                lineage_=lineage(self.instance, contribution.ancestor) if self.rank == 0 else None)
        self.phases["replicate"] = time.perf_counter() - started
        if report.failure is not None:
            return Completion.failed(Outcome(False, f"the memory tier: {report.failure}"))
        return completion

    def newest(self, run: str, step: str, root: Any, branch: bool) -> list[Candidate]:
        """Collective: the newest generation any holder names that descends from the store (only for a
        restore of "latest"; :attr:`skipped` says why newer ones were passed over)."""
        self.skipped = []
        if root != "latest" or branch:
            return []
        offer = self._offer(run, step, self._rejects(run, step) if self.rank == 0 else None)
        if offer is None:
            return []
        self.skipped = list(offer.skipped)
        if self.skipped and self.rank == 0:
            logger.warning("memory tier: %s/%s: passed over %s", run, step, "; ".join(self.skipped))
        if not offer.root:
            return []
        self._offers = {offer.root: offer}
        return [Candidate(root=offer.root, tier=MEMORY, epoch=offer.epoch, update=offer.update)]

    @contextlib.contextmanager
    def reader(self, candidate: Candidate, wanted: Callable[[Any], set[str]]) -> Iterator[Reading | None]:
        """Collective: every rank pulls what ``wanted(root manifest)`` names, every copy checked first; then
        this rank's holder, reading in place what the holders of its node keep. None: something is missing or
        damaged somewhere (every rank falls back together)."""
        offer = self._offers[candidate.root]
        report = self.assemble(offer, wanted)
        if report.failure is not None:
            if self.rank == 0:
                logger.warning("memory tier: update %d cannot be recovered from memory (%s); trying the store",
                               offer.update, report.failure)
            yield None
            return
        with self._node_view() as holders:
            yield Reading(holders, bytes_from_peers=report.bytes_received, seconds=report.seconds)

    def _rejects(self, run: str, step: str) -> Callable[[str, dict | None], str | None]:
        """Rank 0: why a memory generation is not this store's (None: it is), from the store's history."""
        records = self.store.history(run, step).records
        held, roots = {(r.generation, r.root) for r in records}, {r.root for r in records}

        def holds(generation: int | None, root: str) -> bool:
            return root in roots if generation is None else (generation, root) in held
        return lambda root, lineage_: rejection(lineage_, root, self.instance, holds)

    # ------------------------------------------------------------------ save

    def replicate(self, prefix: CapturePrefix, completion: Completion, owners: int,
                  lineage_: dict | None = None) -> TierReport:
        """Collective, after a memory publish: copies until every object has ``copies`` holders, then the ref
        on every holder (only if every object has at least two verified holders), then retention.
        ``lineage_`` (rank 0's, see :func:`lineage`) is recorded in every holder's ref."""
        started = time.monotonic()
        generation = None
        if self.rank == 0:
            generation = MemoryGeneration(completion.root, completion.bytes, self._publisher.named.pop(completion.root, []),
                                          lineage=lineage_)
        generation = MemoryGeneration.from_json(broadcast_json(generation.to_json() if generation else None,
                                                               global_rank(0, self.group), self.group))
        objects = [(generation.root, generation.root_size)] + [(d, int(s)) for d, s in generation.objects]
        digests = [d for d, _ in objects]
        holders = self._holdings(digests)
        transfers = plan_replication(objects, holders, self.world, self.copies, self.stride,
                                     everywhere=frozenset({generation.root}))
        moved = self._carry(transfers)
        holders = self._holdings(digests)
        short = under_held(digests, holders, MIN_HOLDERS)
        failure = None
        if any_rank(bool(moved.damaged or moved.unavailable), self.group):
            failure = "a copy sent to a peer did not arrive intact"
        elif short:
            failure = f"{len(short)} objects have fewer than {MIN_HOLDERS} holders"
        if failure is None:
            total = sum(s for _, s in objects)
            try:
                self._put_ref(prefix, generation.root, generation.root_size, total, owners, generation.lineage)
            except (OSError, Refusal, DurableWriteError) as exc:
                failure = f"rank {self.rank}: its ref could not be written: {exc}"
            if any_rank(failure is not None, self.group):
                failure = failure or "another rank could not write its ref"
        if failure is not None:
            logger.warning("memory save of update %d does not count: %s", prefix.update, failure)
        try:
            self._retain(prefix.run, prefix.step)
        except (OSError, Refusal) as exc:  # what is kept too long costs memory, never a save
            logger.warning("memory tier: retention in %s did not run: %s", self.holder.root, exc)
        self.last = TierReport(moved.bytes_sent, moved.bytes_received, time.monotonic() - started, failure)
        return self.last

    def _put_ref(self, prefix: CapturePrefix, root: str, root_size: int, total: int, owners: int,
                 lineage_: dict | None) -> None:
        """This holder's ref for ``root``, numbered after its own newest (holders number independently)."""
        for _ in range(3):
            top = self.holder.history(prefix.run, prefix.step).top
            record = RefRecord(prefix.run, prefix.step, top + 1, root, root_size, prefix, time.time(), total, owners,
                               lineage_)
            try:
                self.holder.put_ref(record)
                return
            except FileExistsError:
                continue  # numbered meanwhile (this holder is this rank's alone): read the top again

    def _retain(self, run: str, step: str) -> None:
        """Keep the newest :data:`KEEP_GENERATIONS` refs of this holder and the objects they name."""
        records = [r for r in self.holder.list_refs(run, step) if isinstance(r, RefRecord)]
        records.sort(key=lambda r: r.generation)
        keep, drop = records[-KEEP_GENERATIONS:], records[:-KEEP_GENERATIONS]
        if not drop:
            return
        named: set[str] = set()
        for r in keep:
            named |= self._names(r.root)
        for r in drop:
            self.holder.delete_ref(run, step, r.generation)
        for digest in list(self.holder.iter_objects()):
            if digest not in named:
                self.holder.delete_object(digest)

    def _names(self, root: str) -> set[str]:
        """The objects a generation names, read from this holder's copy of its root manifest."""
        try:
            with open_generation(self.holder, root, role=0, wanted=[]) as head:
                return {root} | {s.digest for s in head.manifest.shards}
        except Refusal:
            return {root}

    def held_bytes(self) -> int:
        """Bytes this rank's holder keeps."""
        return sum(self.holder.object_size(d) for d in self.holder.iter_objects())

    # ------------------------------------------------------------------ recovery

    def _offer(self, run: str, step: str,
               rejects: Callable[[str, dict | None], str | None] | None) -> MemoryGeneration | None:
        """Collective: rank 0 learns every holder's refs and answers the newest generation any of them
        names that ``rejects(root, lineage)`` (rank 0's) does not reject, with the ranks naming it (every rank
        gets the same answer). The answer's ``skipped`` says why each newer generation was passed over; an
        answer with no root (``root == ""``) means none was taken but some were skipped."""
        mine = []
        for r in self.holder.list_refs(run, step):
            if isinstance(r, RefRecord):
                mine.append([r.root, r.root_size, r.prefix.epoch, r.prefix.update, r.published_at, r.lineage])
        heard = gather_json(mine, global_rank(0, self.group), self.group)
        answer = None
        if self.rank == 0:
            named: dict[str, set[int]] = {}
            seen: dict[str, list] = {}
            for rank, refs in enumerate(heard):
                for root, size, epoch, update, at, lineage_ in refs:
                    named.setdefault(root, set()).add(rank)
                    key = (epoch, update, at)
                    if root not in seen or key > seen[root][0]:
                        seen[root] = [key, size, lineage_]
            skipped = []
            for root, (key, size, lineage_) in sorted(seen.items(), key=lambda kv: kv[1][0], reverse=True):
                reason = rejects(root, lineage_) if rejects is not None else None
                if reason is None:
                    answer = MemoryGeneration(root, int(size), holders=sorted(named[root]), epoch=int(key[0]),
                                              update=int(key[1]), lineage=lineage_, skipped=skipped)
                    break
                skipped.append(f"update {key[1]} (root {root[:16]}...): {reason}")
            if answer is None and skipped:
                answer = MemoryGeneration("", 0, skipped=skipped)
        got = broadcast_json(answer.to_json() if answer else None, global_rank(0, self.group), self.group)
        return MemoryGeneration.from_json(got) if got is not None else None

    def assemble(self, offer: MemoryGeneration, wanted: Callable[[Any], set[str]]) -> TierReport:
        """Collective: every rank pulls, by digest, what its restore of ``offer.root`` reads (``wanted(manifest)``
        names it), after every copy any rank holds was checked against its name. ``failure`` set: fall back."""
        started = time.monotonic()
        report = TierReport()
        root = offer.root
        # 1. the root manifest, to every rank (a new or lost holder has none)
        fetch = plan_fetch({root: offer.root_size}, {root: frozenset(offer.holders)},
                           {r: frozenset({root}) for r in range(self.world)})
        moved = self._carry(fetch.transfers)
        report.bytes_received += moved.bytes_received
        report.bytes_sent += moved.bytes_sent
        manifest, failure = None, None
        if fetch.missing or moved.damaged or moved.unavailable:
            failure = "the root manifest could not be copied intact"
        else:
            try:
                with open_generation(self.holder, root, role=0, wanted=[]) as head:
                    manifest = head.manifest
                if manifest.publisher.kind != "star":
                    failure = "not a memory generation"
            except Refusal as refusal:
                failure = f"root manifest: {refusal}"
        if any_rank(failure is not None, self.group):
            report.failure = failure or "another rank could not read the root manifest"
            return self._done(report, started)
        sizes = {s.digest: s.size for s in manifest.shards}
        digests = sorted(sizes)
        needed = wanted(manifest)
        # What this rank restores is validated by the restore itself before any rank copies (damage there
        # refuses, and every rank falls back together); every other copy it holds is hashed now.
        held, damaged = self._verified(digests, trusted=needed)
        flags = torch.tensor([[d in held for d in digests], [d in damaged for d in digests],
                              [d in needed for d in digests]], dtype=torch.uint8).reshape(3, len(digests))
        every = [torch.empty_like(flags) for _ in range(self.world)]
        dist.all_gather(every, flags, group=self.group)
        holders = {d: frozenset(r for r in range(self.world) if every[r][0, i]) for i, d in enumerate(digests)}
        broken = [d for i, d in enumerate(digests) if any(every[r][1, i] for r in range(self.world))]
        needs = {r: frozenset(d for i, d in enumerate(digests) if every[r][2, i]) for r in range(self.world)}
        if broken:
            report.failure = f"{len(broken)} objects have a damaged copy (first {broken[0][:16]}...)"
            return self._done(report, started)
        far = network_needs(needs, holders, self.readable)
        fetch = plan_fetch(sizes, holders, far)
        # What this rank's restore reads in place from the holders of its node counts as from peers too.
        report.bytes_received += sum(sizes[d] for d in needs[self.rank] - far[self.rank] if d not in held)
        if fetch.missing:
            report.failure = f"{len(fetch.missing)} objects are held by no rank (first {fetch.missing[0][:16]}...)"
            return self._done(report, started)
        moved = self._carry(fetch.transfers)
        report.bytes_received += moved.bytes_received
        report.bytes_sent += moved.bytes_sent
        if any_rank(bool(moved.damaged or moved.unavailable), self.group):
            report.failure = "a copy pulled from a peer did not arrive intact"
        return self._done(report, started)

    def _done(self, report: TierReport, started: float) -> TierReport:
        report.seconds = time.monotonic() - started
        self.last = report
        return report

    def _verified(self, digests: Sequence[str], trusted: AbstractSet[str] = frozenset()) -> tuple[set[str], set[str]]:
        """The objects this holder has intact, and those it has damaged: each copy hashed whole, except the
        ``trusted`` ones (present is enough: the restore validates them before it copies a byte)."""
        held, damaged = set(), set()
        for d in digests:
            if not self.holder.has_object(d):
                continue
            if d in trusted:
                held.add(d)
                continue
            try:
                with self.holder.open_object(d, "memory copy") as obj:
                    validate_object_file(obj, f"memory copy {d[:16]}...")
                held.add(d)
            except (Refusal, OSError):
                damaged.add(d)
        return held, damaged

    def _holdings(self, digests: Sequence[str]) -> dict[str, frozenset[int]]:
        """Collective: which ranks hold each object."""
        mine = torch.tensor([self.holder.has_object(d) for d in digests], dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        return {d: frozenset(r for r in range(self.world) if every[r][i]) for i, d in enumerate(digests)}

