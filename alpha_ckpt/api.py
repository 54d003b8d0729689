"""The one-process API: save, save_async, restore, verify, latest (re-exported by :mod:`alpha_ckpt`).

A generation is named by its root digest, ``root`` everywhere (the Checkpointer, the DCP backend and
the alpha-ckpt command say the same); bringing one back is ``restore`` everywhere.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from alpha_ckpt.generation.async_save import AsyncSaver, SaveHandle
from alpha_ckpt.runtime.launch_env import note_checkpoint_call, note_step
from alpha_ckpt.errors import RefusalCode, UsageError
from alpha_ckpt.format.records import CapturePrefix
from alpha_ckpt.generation.reader import Counters, latest_generation, load_state, verify_generation
from alpha_ckpt.state import CapturedState, capture_state
from alpha_ckpt.runtime.options import allowed_changes
from alpha_ckpt.generation.writer import DEFAULT_MAX_SHARD_BYTES, Published, ShardCarry, save_state
from alpha_ckpt.store import Store

_log = logging.getLogger("alpha_ckpt")


def _store(store: Store | str | os.PathLike, create: bool) -> tuple[Store, bool]:
    if isinstance(store, Store):
        return store, False
    return Store(store, create=create), True


def _allowed_changes(value: Any) -> tuple[tuple[str, str], ...]:
    try:
        return allowed_changes(value)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _prefix(run: str, step: str, update: int, cursor: int, epoch: int) -> CapturePrefix:
    return CapturePrefix(run, step, update, cursor, epoch)  # refuses counters no reader accepts (StoreUsageError)


def save(state: Mapping[str, Any], *, store: Store | str | os.PathLike, run: str, step: str, update: int,
         cursor: int, epoch: int, metadata: Any = None, compression: str | Mapping[str, str] = "raw",
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, carry: ShardCarry | None = None,
         allow_nonfinite: str | Sequence[str] = ()) -> str:
    """Publish a generation of ``state``; return its root digest (64 hex).

    ``state`` is a dict of tensors, NumPy arrays, Stateful objects (modules,
    optimizers, schedulers, data loaders, :class:`RNGState`: their
    ``state_dict()`` is saved) and plain values (None, bool, int, float, str,
    bytes, and lists, tuples and dicts of them), saved exactly, with their
    types, without pickle. Regions are named by dotted path
    (``optim.state.0.exp_avg``).

    The generation is visible (as the newest ref of ``run``/``step``) only once
    every object is durable. Refused (:class:`Refusal`, nothing published):
    a NaN or inf in a floating-point region that no ``allow_nonfinite`` pattern
    (fnmatch on dotted names, e.g. ``"*.causal_mask"``; a bare string is one pattern) declares
    (``non-finite``); an update not after the newest of this run/step and
    epoch (``reset-cursor``); an epoch older than the newest (``stale-epoch``).
    ``epoch`` counts continuations: a run that restarts from an older
    generation saves in a newer epoch, so that its history may go back.

    ``compression`` is "raw", "zstd", "auto" or a mapping from region name
    (dotted) to one of those. ``metadata`` is any JSON value, stored in the
    manifest. Pass one :class:`ShardCarry` to successive saves of a run/step
    and a region (of at least 1 MiB) whose bytes did not change is not
    written again: the new generation names the shard an earlier one wrote.
    """
    note_checkpoint_call()  # under alpha-run: a failure from here on is retryable (launch_env)
    note_step()  # a save: a training step done (alpha-run --in-place starts its spares after one)
    prefix = _prefix(run, step, update, cursor, epoch)
    s, owned = _store(store, create=True)
    try:
        return save_state(state, store=s, prefix=prefix, metadata=metadata, compression=compression,
                          max_shard_bytes=max_shard_bytes, carry=carry, allow_nonfinite=allow_nonfinite).root
    finally:
        if owned:
            s.close()


def save_async(state: Mapping[str, Any], *, store: Store, run: str, step: str, update: int, cursor: int,
               epoch: int, metadata: Any = None, compression: str | Mapping[str, str] = "raw",
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, saver: AsyncSaver | None = None,
               defer_snapshot: bool = False, allow_nonfinite: str | Sequence[str] = ()) -> SaveHandle | None:
    """Snapshot ``state`` now and publish it in the background, as :func:`save` would.

    Values and Stateful objects are captured during the call; tensors are
    copied (the snapshot). Returns a :class:`SaveHandle` (``.result()`` is the
    :class:`Published` generation once it is durable, its ``.root`` the root digest
    :func:`save` would return, or raises its failure),
    or None when ``saver`` skips because a save is still in flight
    (``in_flight="skip"``). Pass one ``saver`` for every save of a run: it
    reuses its snapshot buffers and keeps one save in flight. With
    ``defer_snapshot=True`` the copy is made in the background too and the
    caller must call ``handle.wait_snapshot()`` before changing any tensor.
    """
    note_checkpoint_call()  # under alpha-run: a failure from here on is retryable (launch_env)
    prefix = _prefix(run, step, update, cursor, epoch)
    if not isinstance(store, Store):
        raise TypeError("save_async needs an open Store (the background publish outlives this call)")
    captured = capture_state(state)
    names = [name for name, _ in captured.named]
    saver = saver if saver is not None else AsyncSaver()

    def publish(snapshot: list) -> Published:
        return save_state(CapturedState(tuple(zip(names, snapshot)), captured.skeleton), store=store, prefix=prefix,
                          metadata=metadata, compression=compression, max_shard_bytes=max_shard_bytes,
                          carry=saver.carry, allow_nonfinite=allow_nonfinite)

    return saver.submit([t for _, t in captured.named], publish, defer_snapshot=defer_snapshot)


def restore(state: Mapping[str, Any], *, store: Store | str | os.PathLike, root: str,
            allow_optimizer_change: Sequence[tuple[str, str]] = ()) -> Counters:
    """Validate generation ``root`` (its root digest) completely, then restore it into ``state``.

    Entries are matched by dotted name, in any order (a torch.compile'd module's keys as the plain
    module's, so either restores into the other): tensors and arrays are
    filled in place, values are replaced by the saved ones (types kept), and
    each Stateful object gets ``load_state_dict()`` of its own ``state_dict()``
    filled from the checkpoint (an optimizer's state that does not exist yet is
    created). Raises :class:`Refusal` (nothing touched, store unmodified) when
    anything is wrong, naming every entry that is missing, unexpected, or of
    another shape or dtype, and an optimizer whose state another optimizer
    class saved (``coverage``, naming both classes; ``allow_optimizer_change``
    names the (saved, destination) class pairs allowed, such as
    ``[("Adam", "AdamW")]``, between classes of the same hyperparameters).
    Returns the counters (update, cursor, epoch) and metadata.
    """
    note_checkpoint_call()  # under alpha-run: a failure from here on is retryable (launch_env)
    allowed = _allowed_changes(allow_optimizer_change)
    s, owned = _store(store, create=False)
    try:
        return load_state(state, store=s, root=root, allow_optimizer_change=allowed)
    finally:
        if owned:
            s.close()


def verify(store: Store | str | os.PathLike, root: str) -> None:
    """Validate every object of generation ``root``; raise :class:`Refusal` if anything is wrong."""
    s, owned = _store(store, create=False)
    try:
        verify_generation(s, root)
    finally:
        if owned:
            s.close()


@dataclass(frozen=True)
class Skipped:
    """A generation newer than the one :func:`latest` returned, and why it was passed over."""

    root: str          # "(unreadable ref)" when the ref itself cannot be read
    code: RefusalCode
    message: str


@dataclass(frozen=True)
class Latest:
    """What :func:`latest` found with ``explain=True``: the newest complete generation (or None) and what it skipped."""

    root: str | None
    skipped: tuple[Skipped, ...]


def latest(store: Store | str | os.PathLike, run: str, step: str, *, explain: bool = False) -> str | Latest | None:
    """Root digest of the newest complete (fully validated) generation of ``run``/``step``, or None.

    Newer generations passed over (damaged, or of an older epoch than a
    continuation's) are logged as warnings on the ``alpha_ckpt`` logger with
    their root and refusal code; ``explain=True`` returns a :class:`Latest`
    that lists them.
    """
    s, owned = _store(store, create=False)
    try:
        record, skipped = latest_generation(s, run, step)
    finally:
        if owned:
            s.close()
    found = record.root if record else None
    passed = tuple(Skipped(root, refusal.code, refusal.message) for root, refusal in skipped)
    for item in passed:
        _log.warning("latest %s/%s: skipped generation %s [%s] %s", run, step, item.root, item.code.value, item.message)
    return Latest(found, passed) if explain else found
