"""Every option of a :class:`~alpha_ckpt.Checkpointer`, typed, documented and checked in one place.

``Checkpointer(store, run=..., ...)`` builds a :class:`CheckpointerOptions`
from its keyword arguments; ``Checkpointer(options=...)`` takes one as it is;
``Checkpointer.from_launcher_env(**overrides)`` fills one from alpha-run's
flags (alpha_ckpt/runtime/launch_env.py), the arguments given overriding them. A value
that cannot be is a :class:`~alpha_ckpt.UsageError` here (exit 2 under
alpha-run), never a checkpoint's refusal later.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from alpha_ckpt.errors import Refusal, UsageError
from alpha_ckpt.format.records import check_json_value, check_name, is_digest
from alpha_ckpt.state.manifest import encode_identity
from alpha_ckpt.state.capture import pattern_list
from alpha_ckpt.state.optimizers import allowed_changes
from alpha_ckpt.state.rules import METADATA_KEY as PLACEMENT_KEY, PlacementRules
from alpha_ckpt.collective.schedule import Schedule

RECORDED = frozenset({"identity", "owners", "devices", "layout", PLACEMENT_KEY})  # metadata= may not set these


@dataclass(frozen=True)
class CheckpointerOptions:
    """The options of one Checkpointer (one run/step of one store)."""

    store: Any
    """The store directory (created by rank 0 if absent), or an open :class:`~alpha_ckpt.Store` (the caller's)."""
    run: str
    """The run's name: a plain path component. Every generation of the run continues one history."""
    step: str = "train"
    """The step's name within the run (``"train"``, ``"fit"``)."""
    publisher: str = "star"
    """``"star"``: rank 0 hears every rank and writes one root manifest; ``"tree"``: group manifests up a
    tree of ``fanout`` children per parent (many ranks)."""
    fanout: int = 8
    """Tree: children per parent at most."""
    commit_timeout: float = 60.0
    """Tree: seconds a parent waits for its children's commitments."""
    save: str = "sync"
    """``"sync"``: :meth:`save` returns once the generation is durable; ``"async"``: it snapshots the tensors
    and publishes in the background."""
    in_flight: str = "wait"
    """Async: a save called while the previous one is in flight waits for it (``"wait"``) or is skipped on every
    rank (``"skip"``)."""
    identity: Any = None
    """The learner's identity (a typed value: model, hyperparameters), recorded in every root manifest; a
    restore of a generation saved with another is refused ``foreign-learner``."""
    allow_nonfinite: tuple[str, ...] = ()
    """Entries (fnmatch patterns on dotted names; a bare string is one pattern) that may hold NaN or inf;
    any other non-finite tensor refuses the save ``non-finite``."""
    every: int | str | None = None
    """What :meth:`due` answers: every K updates, ``"auto"`` (Young/Daly's interval, needs ``mtbf``), or None
    (the script decides)."""
    mtbf: float | str | None = None
    """``every="auto"``: the mean time between failures (seconds, or ``"6h"``)."""
    checkpoint_cost: float | str | None = None
    """``every="auto"``: the checkpoint cost assumed until one is measured (with ``memory``: a durable save's)."""
    memory: bool | str | None = None
    """The memory tier: None or False: none, every save goes to the store; True: each rank holds the
    generations in host memory, in alpha-run's directory for it or the default one, replicated to
    ``replicas`` peers, and one save in ``durable_every`` also goes to the store; a str: the directory
    (tmpfs) holding the ranks' holders."""
    replicas: int = 1
    """With ``memory``: the peer ranks that hold a copy of each rank's objects besides itself (at least 1, so
    every object is held by at least two ranks)."""
    durable_every: int | None = None
    """With ``memory``: one save in this many also goes to the durable store (the first save, then the K-th
    after each durable one). None: planned with ``every="auto"``, else 5 (a whole-job or node loss redoes at
    most five saves' work while the store's write is paid once in five saves). Without ``memory``: None or 1
    (every save is durable)."""
    mtbf_durable: float | str | None = None
    """``every="auto"`` with ``memory``: the mean time between the failures the memory tier does not survive
    (a node's or the whole job's loss; seconds, or ``"30d"``), which with a durable save's cost plans
    ``durable_every``. None: ten times ``mtbf``."""
    keep: int | None = None
    """Retention: after each publish rank 0 keeps the ``keep`` newest complete generations (at least 2), or
    all (None)."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The script's own JSON values, recorded in every root manifest (``Counters.metadata`` on restore)."""
    bind_devices: bool = False
    """Each rank's device must be the very one (UUID) that saved its rank, not only the same product."""
    per_rank: tuple[str, ...] = ()
    """Entries (patterns) stored per rank and restored to the same rank (BatchNorm statistics under DDP)."""
    from_rank0: tuple[str, ...] = ()
    """Entries (patterns) saved from rank 0 alone and restored to every rank."""
    resume: str | None = "latest"
    """What ``restore(state)`` resumes without a root: ``"latest"`` (the newest complete generation that is
    not stale; none yet: a fresh start), a root digest (exactly that one, or a refusal), or None (a fresh
    start, refused ``fenced`` when the run already has history)."""
    allow_optimizer_change: tuple[tuple[str, str], ...] = ()
    """(saved class, destination class) names of optimizers a restore may change between, such as
    ``[("Adam", "AdamW")]``: only between classes of the same hyperparameters. Any other restore of an
    optimizer's state into another class is refused ``coverage``, naming both classes."""
    announce: bool = False
    """Rank 0 says on stderr, in one line, what each restore resumed (or that it starts fresh): alpha-run's
    scripts do (:meth:`Checkpointer.from_launcher_env`)."""

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen: normalize once)
        if self.store is None or self.run is None:
            raise UsageError("Checkpointer needs store= and run= (or Checkpointer.from_launcher_env() under "
                             "alpha-run)")
        if isinstance(self.store, os.PathLike):
            set_("store", os.fspath(self.store))
        try:  # an argument of the script's that cannot be: a usage error (exit 2), not a checkpoint's refusal
            check_name(self.run, "run")
            check_name(self.step, "step")
            encode_identity(self.identity)  # a typed value (tuples, int keys, floats exact): refused here, not at a save
            set_("allow_nonfinite", pattern_list(self.allow_nonfinite, "allow_nonfinite"))
            set_("per_rank", pattern_list(self.per_rank, "per_rank"))
            set_("from_rank0", pattern_list(self.from_rank0, "from_rank0"))
            PlacementRules.of(self.per_rank, self.from_rank0)
            set_("allow_optimizer_change", allowed_changes(self.allow_optimizer_change))
            self.schedule()
        except (Refusal, ValueError, TypeError) as exc:
            raise UsageError(f"Checkpointer: {exc}") from None
        if isinstance(self.memory, os.PathLike):
            set_("memory", os.fspath(self.memory))
        if self.memory is False:
            set_("memory", None)
        if not (self.memory is None or self.memory is True or (isinstance(self.memory, str) and self.memory)):
            raise UsageError(f"memory is None, True or the directory of the ranks' holders, not {self.memory!r}")
        replicas = self.replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise UsageError(f"replicas is the number of peer copies of every object, at least 1, not {replicas!r}")
        if self.memory is None and replicas != 1:
            raise UsageError("replicas goes with memory= (the peers that hold a rank's objects in memory)")
        if self.publisher not in ("star", "tree"):
            raise UsageError(f"publisher is 'star' or 'tree', not {self.publisher!r}")
        if isinstance(self.fanout, bool) or not isinstance(self.fanout, int) or self.fanout < 1:
            raise UsageError(f"fanout is at least 1, not {self.fanout!r}")
        if self.save not in ("sync", "async"):
            raise UsageError(f"save is 'sync' or 'async', not {self.save!r}")
        if self.in_flight not in ("wait", "skip"):
            raise UsageError(f"in_flight is 'wait' or 'skip', not {self.in_flight!r}")
        keep = self.keep
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 2):
            raise UsageError(f"keep is at least 2 (the previous complete generation must survive a failed save), "
                             f"not {keep!r}")
        try:
            timeout = float(self.commit_timeout)
        except (TypeError, ValueError):
            timeout = math.nan
        if not (timeout > 0 and math.isfinite(timeout)):
            raise UsageError(f"commit_timeout is a positive number of seconds, not {self.commit_timeout!r}")
        set_("commit_timeout", timeout)
        metadata = dict(self.metadata or {})
        try:
            check_json_value(metadata, "metadata")  # what a restore reads back is what was given
        except ValueError as exc:
            raise UsageError(f"Checkpointer: {exc}") from None
        if set(metadata) & RECORDED:
            raise UsageError("metadata= may not set identity, owners, devices, layout or placement_patterns (the "
                             "Checkpointer records them)")
        set_("metadata", metadata)
        if not (self.resume is None or self.resume == "latest" or is_digest(self.resume)):
            raise UsageError(f"resume is 'latest', a full 64-hex root digest or None, not {self.resume!r}")

    def replace(self, **changes: Any) -> "CheckpointerOptions":
        """These options with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def rules(self) -> PlacementRules:
        return PlacementRules.of(self.per_rank, self.from_rank0)

    def schedule(self) -> Schedule:
        return Schedule(self.every, self.mtbf, self.checkpoint_cost, memory=self.memory not in (None, False),
                        durable_every=self.durable_every, mtbf_durable=self.mtbf_durable)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CheckpointerOptions))
