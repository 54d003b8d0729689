"""The messages ranks send one another while they save and restore: typed, versioned records.

Each is a frozen dataclass that travels as canonical JSON (:mod:`alpha_ckpt.tiers.durable.wire`)
carrying ``"v"`` (:data:`VERSION`) and ``"kind"``; :meth:`Record.from_json` refuses a record of
another version or kind (``format``), so ranks of two alpha_ckpt versions in one group stop at
their first message instead of misreading each other. The tree's own messages (commitments,
completions) keep their wire format in :mod:`alpha_ckpt.tiers.durable.tree`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

from alpha_ckpt.errors import PublishFailed, Refusal, RefusalCode

VERSION = 1


class Record:
    """A message's fields, ``to_json`` with ``"v"`` and ``"kind"``, ``from_json`` checking both."""

    KIND: ClassVar[str]
    NESTED: ClassVar[Mapping[str, type]] = {}  # field -> the Record type it holds (or None)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"v": VERSION, "kind": self.KIND}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_json() if isinstance(value, Record) else value
        return out

    @classmethod
    def from_json(cls, obj: Any):
        if not isinstance(obj, dict) or obj.get("kind") != cls.KIND:
            raise Refusal(RefusalCode.FORMAT, f"a rank sent {_kind(obj)} where a {cls.KIND} message belongs")
        if obj.get("v") != VERSION:
            raise Refusal(RefusalCode.FORMAT, f"a rank sent a {cls.KIND} message of version {obj.get('v')!r}; this "
                          f"alpha_ckpt speaks version {VERSION} (every rank must run the same alpha_ckpt)")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in obj:
                continue  # the field's default
            value = obj[f.name]
            nested = cls.NESTED.get(f.name)
            kwargs[f.name] = nested.from_json(value) if nested is not None and value is not None else value
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise Refusal(RefusalCode.FORMAT, f"a {cls.KIND} message lacks a field: {exc}") from None


def _kind(obj: Any) -> str:
    return f"a {obj.get('kind')} message" if isinstance(obj, dict) else type(obj).__name__


@dataclass(frozen=True)
class Outcome(Record):
    """A verdict every rank acts on alike: ok, or a failure (a refusal when ``code`` is set)."""

    KIND: ClassVar[str] = "outcome"
    ok: bool
    reason: str = ""
    code: str | None = None

    @classmethod
    def success(cls) -> "Outcome":
        return cls(True)

    @classmethod
    def of(cls, exc: BaseException, rank: int | None = None) -> "Outcome":
        """A failure: a refusal keeps its code; ``rank`` names where it happened."""
        where = "" if rank is None else f"rank {rank}: "
        if isinstance(exc, Refusal):
            return cls(False, f"{where}{exc.message}", exc.code.value)
        return cls(False, f"{where}{type(exc).__name__}: {exc}")

    def raise_failure(self, cause: BaseException | None = None) -> None:
        """Raise what this failure is (the same on every rank); nothing when ok."""
        if self.ok:
            return
        if self.code:
            raise Refusal(self.code, self.reason) from cause
        raise PublishFailed(self.reason) from cause


@dataclass(frozen=True)
class Descriptor(Record):
    """A rank's capture, told to rank 0 before anything is written: no tensor bytes, or the rank's failure."""

    KIND: ClassVar[str] = "descriptor"
    NESTED: ClassVar[Mapping[str, type]] = {"refused": Outcome}
    prefix: dict | None = None
    skeleton: Any = None
    replicated: list = field(default_factory=list)
    regions: list = field(default_factory=list)   # RegionDecl.to_json() of each region the rank holds
    pieces: list = field(default_factory=list)    # [name, lo, hi] of the words the rank holds to write
    dtensors: list = field(default_factory=list)  # regions it holds a DTensor shard of (others may hold it alike)
    device: Any = None
    refused: Outcome | None = None


@dataclass(frozen=True)
class Layout(Record):
    """Rank 0's answer to every rank's descriptor: the agreed layout of this save, or why there is none."""

    KIND: ClassVar[str] = "layout"
    NESTED: ClassVar[Mapping[str, type]] = {"outcome": Outcome}
    outcome: Outcome
    state: Any = None
    regions: list = field(default_factory=list)
    devices: list = field(default_factory=list)
    layout: dict | None = None        # which rank wrote which words (metadata "layout"), or None
    write_mode: str | None = None     # how every rank writes this save's large shards
    shared: list = field(default_factory=list)  # [name, lo, hi, writer] of words several ranks hold alike


@dataclass(frozen=True)
class WriteReport(Record):
    """What a rank wrote (star: its shard records), its digest of every replica and of every shared
    piece it holds ([name, lo, hi, digest]: words that other ranks hold too), and its write failure."""

    KIND: ClassVar[str] = "write-report"
    replicas: dict
    shards: list = field(default_factory=list)
    failure: list | None = None  # [reason, code or None]
    shared: list = field(default_factory=list)


def written_verdict(reports: Sequence[WriteReport]) -> Outcome:
    """Rank 0's verdict on every rank's writes (pure): the first failure, a diverged replica, or ok."""
    failed = [r.failure for r in reports if r.failure]
    if failed:
        reason, code = failed[0]
        return Outcome(False, reason, code or None)
    try:
        check_replicas([r.replicas for r in reports])
        check_shared([r.shared for r in reports])
    except Refusal as refusal:
        return Outcome.of(refusal)
    return Outcome.success()


def check_replicas(digests: Sequence[Mapping[str, str]]) -> None:
    """Rank 0 (pure): every rank's BLAKE3 of every replica must be rank 0's."""
    for r, d in enumerate(digests):
        if set(d) != set(digests[0]):
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {r} hashed replicas {short(sorted(d))}, rank 0 "
                          f"{short(sorted(digests[0]))}")
        for name in sorted(d):
            if d[name] != digests[0][name]:
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {r}'s replica of {name!r} differs from rank 0's "
                              + per_rank_hint(name))


def check_shared(pieces: Sequence[Sequence[Sequence]]) -> None:
    """Rank 0 (pure): every holder's BLAKE3 of a shared piece (each rank's [name, lo, hi, digest]) is the
    same: one rank's copy is saved for all of them, so copies that differ are refused, never one chosen."""
    first: dict[tuple, tuple[int, str]] = {}
    for rank, held in enumerate(pieces):
        for name, lo, hi, digest in held:
            at, want = first.setdefault((name, lo, hi), (rank, digest))
            if digest != want:
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {rank}'s copy of words [{lo}, {hi}) of {name!r} "
                              f"differs from rank {at}'s (ranks that hold the same shard of it, e.g. over a mesh "
                              "dimension it is not sharded on, must hold the same values)")


@dataclass(frozen=True)
class Completion(Record):
    """The publish's acknowledgment, the same on every rank: the root and its ref, or the failure."""

    KIND: ClassVar[str] = "completion"
    NESTED: ClassVar[Mapping[str, type]] = {"outcome": Outcome}
    outcome: Outcome
    root: str | None = None
    generation: int | None = None
    bytes: int | None = None

    @classmethod
    def failed(cls, outcome: Outcome) -> "Completion":
        return cls(outcome)

    @classmethod
    def of_tree(cls, done: Mapping[str, Any]) -> "Completion":
        """The tree's completion (its own wire format, :mod:`alpha_ckpt.tiers.durable.tree`) as a record."""
        if not done.get("ok"):
            return cls(Outcome(False, str(done.get("reason")), done.get("code") or None))
        return cls(Outcome.success(), done["root"], done["generation"], done["bytes"])


@dataclass(frozen=True)
class Verdict(Record):
    """The lowest refusing rank's refusal, told to every rank (:func:`alpha_ckpt.collective.verdict.agree`)."""

    KIND: ClassVar[str] = "verdict"
    code: str
    message: str


@dataclass(frozen=True)
class UsageVerdict(Record):
    """The lowest rank's usage error (a store path that is a file), told to every rank
    (:func:`alpha_ckpt.collective.verdict.agree_usage`)."""

    KIND: ClassVar[str] = "usage-verdict"
    message: str


@dataclass(frozen=True)
class Interval(Record):
    """Rank 0's checkpoint interval for ``every="auto"``: a number of updates, or None (not planned yet).

    ``durable_every``: with the memory tier, one save in that many goes to the durable store (planned
    with the interval, so every rank names the same tier); None without the tier. A record without the
    field reads as None, so the field's addition keeps the version."""

    KIND: ClassVar[str] = "interval"
    every: int | None
    durable_every: int | None = None


@dataclass(frozen=True)
class Candidate(Record):
    """A generation a restore tries (rank 0 decides), or the refusal that stops the restore.

    ``binding``: a refusal no older generation of this history would escape (an identity, a
    binding of the program's, a digest that is not this run's), so there is no fallback past it.
    ``tier``: the tier that holds it (``"durable"``, ``"memory"``); ``epoch``/``update``: its counters where
    known, by which the candidates of several tiers are walked newest first."""

    KIND: ClassVar[str] = "candidate"
    NESTED: ClassVar[Mapping[str, type]] = {"refusal": Verdict}
    root: str | None = None
    refusal: Verdict | None = None
    binding: bool = False
    devices: list | None = None  # bind_devices: the devices that saved each rank
    tier: str = "durable"
    epoch: int | None = None
    update: int | None = None

    @classmethod
    def refused(cls, refusal: Refusal, binding: bool) -> "Candidate":
        return cls(refusal=Verdict(refusal.code.value, refusal.message), binding=binding)


@dataclass(frozen=True)
class Candidates(Record):
    """What a restore tries, newest first (empty: a fresh start)."""

    KIND: ClassVar[str] = "candidates"
    items: list = field(default_factory=list)

    def candidates(self) -> list[Candidate]:
        return [Candidate.from_json(c) for c in self.items]

    @classmethod
    def of(cls, candidates: Sequence[Candidate]) -> "Candidates":
        return cls([c.to_json() for c in candidates])


def per_rank_hint(name: str) -> str:
    """What a mixed-capture refusal of a diverged replicated entry ``name`` (its dotted name) suggests: the
    Checkpointer's ``per_rank`` option naming it, which needs no change to the objects of the state."""
    return (f"(a replicated entry diverged: if it differs per rank by nature, save it per rank with "
            f"Checkpointer(..., per_rank=[{json.dumps(name)}]))")


def short(value: Any) -> str:
    """A value in a message, 80 characters at most."""
    try:
        text = json.dumps(value, sort_keys=True)[:80]
    except (TypeError, ValueError):  # not JSON (int beside str keys): for a message only
        text = repr(value)[:80]
    return text
