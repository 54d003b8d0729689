"""The one refusal type, its stable codes, and the few other typed errors.

A :class:`Refusal` means "this checkpoint (or this request) must not be used";
its ``code`` is stable across releases so orchestrators and tests can match on
it, and its message names the object, region or counter that was wrong.
"""
from __future__ import annotations

import enum


class RefusalCode(str, enum.Enum):
    FORMAT = "format"
    COVERAGE = "coverage"
    MIXED_CAPTURE = "mixed-capture"
    MISSING_SHARD = "missing-shard"
    CORRUPT_SHARD = "corrupt-shard"
    NON_FINITE = "non-finite"
    FOREIGN_LEARNER = "foreign-learner"  # another learner's (identity) or another run's generation
    CONTRACT_MISMATCH = "contract-mismatch"
    STALE_EPOCH = "stale-epoch"
    RESET_CURSOR = "reset-cursor"
    DEVICE_MISMATCH = "device-mismatch"
    PLACEMENT_BOUND = "placement-bound"
    FENCED = "fenced"  # another job (same epoch) owns this run/step's history, or a fresh start over history
    HISTORY_CONFLICT = "history-conflict"  # a branch into a run/step that already has generations

    def __str__(self) -> str:  # so f"{code}" prints "corrupt-shard"
        return self.value


class Refusal(Exception):
    """A checkpoint or request that is refused, with a stable code.

    Raised before any destination byte is written; the store is never modified
    by the code path that raises it.
    """

    def __init__(self, code: RefusalCode | str, message: str):
        self.code = RefusalCode(code)
        self.message = message
        super().__init__(f"[{self.code.value}] {message}")

    def __reduce__(self):
        # DCP carries a rank's exception to every rank with gather_object (pickle): rebuild it whole.
        return (type(self), (self.code.value, self.message))


def refusal_in(exc: BaseException) -> "Refusal | None":
    """The Refusal ``exc`` is, or carries: ``torch.distributed.checkpoint`` raises a ``CheckpointException``
    holding each failed rank's exception (a StorageWriter's or StorageReader's refusal among them)."""
    if isinstance(exc, Refusal):
        return exc
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if isinstance(exc, CheckpointException):
        for rank in sorted(exc.failures):
            failure = exc.failures[rank]
            inner = failure[0] if isinstance(failure, tuple) else failure  # DCP wraps (exception, traceback)
            if isinstance(inner, Refusal):
                return inner
    return None


class DurableWriteError(OSError):
    """A durable write failed at a named stage; nothing was published.

    An fsync failure is final: the pages may already be marked clean, so a
    retry could report success with the data gone. Callers fail the
    generation instead of retrying.
    """

    def __init__(self, stage: str, errno_: int, message: str):
        super().__init__(errno_, f"durable write failed at {stage}: {message}")
        self.stage = stage


class RestoreIncomplete(RuntimeError):
    """A Stateful entry's ``load_state_dict()`` raised after a restore's copies: the state is part restored.

    Every tensor of the state was already filled in place from the generation, and the Stateful
    entries before it (``loaded``) were loaded; ``failed`` raised (the cause) and ``not_loaded``
    were not. Nothing is undone: restore again into a freshly built state, or start over.
    """

    def __init__(self, failed: str, loaded: tuple[str, ...], not_loaded: tuple[str, ...], cause: BaseException):
        self.failed, self.loaded, self.not_loaded = failed, tuple(loaded), tuple(not_loaded)
        done = f"and the Stateful entries {', '.join(map(repr, loaded))} were loaded" if loaded else \
            "and no Stateful entry was loaded"
        after = f"; not loaded: {', '.join(map(repr, not_loaded))}" if not_loaded else ""
        super().__init__(f"restore stopped at state entry {failed!r}: its load_state_dict() raised "
                         f"{type(cause).__name__}: {cause}. Already written: every tensor of the state (filled in "
                         f"place from the checkpoint), {done}{after}. The state is part restored: restore again "
                         "into a freshly built state, or start over")


class PublishConflict(Exception):
    """Another publisher already created the ref this publisher raced for."""


class PublishFailed(Exception):
    """A collective publication did not publish this generation; every owner raises it (exit 75)."""


class CollectiveIncomplete(RuntimeError):
    """A collective call (``call``: "save", "restore") that not every rank of the group made: ``missing``, the
    ranks that did not come to it (they never called it, or died before), named when the call failed (the
    group's timeout, or a peer that left) instead of the transport's own error (``__cause__``)."""

    def __init__(self, call: str, missing: list[int], world: int, cause: BaseException):
        self.call, self.missing, self.world = call, list(missing), world
        ranks = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
        super().__init__(f"{call} is collective: every rank of the group ({world}) calls it, in the same order; "
                         f"{ranks} did not come to this {call} (it failed: {first})")


class UsageError(ValueError):
    """The call or the command must change (exit 2 under alpha-run); ``str()`` is one line."""

    def __init__(self, message: object):
        super().__init__(" ".join(str(message).split()))


class StoreUsageError(UsageError):
    """A caller passed a bad name or argument (not a property of a checkpoint)."""


class WorkerRNGWarning(UserWarning):
    """A saved data loader's worker processes draw from generators its state does not hold: a resumed run's
    random transforms may differ from the run that never stopped (see ``alpha_ckpt.WorkerRNGDataset``)."""
