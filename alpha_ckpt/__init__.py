"""alpha_ckpt: checkpoints that are one consistent state of one learner, or nothing.

The one-process API (the launcher makes it collective)::

    root = alpha_ckpt.save(state_dict, store="ckpt", run="nightly", step="fit", update=3, cursor=96, epoch=0)
    counters = alpha_ckpt.load(state_dict, store="ckpt", digest=root)   # in place, or Refusal

Asynchronous (training goes on while the generation is written)::

    saver = alpha_ckpt.AsyncSaver()
    handle = alpha_ckpt.save_async(state_dict, store=store, run="nightly", step="fit", update=3, cursor=96,
                                   epoch=0, saver=saver)
    root = handle.result().root   # durable once this returns
"""
from __future__ import annotations

import os
from typing import Any, Mapping

# First, before torch (seconds to import): an owner started by alpha-run binds its
# life to the launcher's, so a launcher killed meanwhile leaves no owner running.
from .lifeline import bind_to_named_launcher

bind_to_named_launcher()

from .async_save import AsyncSaver, SaveHandle
from .errors import DurableWriteError, PublishConflict, Refusal, RefusalCode
from .format import CapturePrefix
from .restore import Counters, latest_generation, load_state, verify_generation
from .manifest import flatten_state
from .writer import DEFAULT_MAX_SHARD_BYTES, Published, ShardCarry, save_state
from .store import Store

__all__ = ["save", "save_async", "AsyncSaver", "SaveHandle", "ShardCarry", "load", "verify", "latest", "Store", "Refusal", "RefusalCode", "Counters", "DurableWriteError", "PublishConflict"]
__version__ = "0.1.0"


def _store(store: Store | str | os.PathLike, create: bool) -> tuple[Store, bool]:
    if isinstance(store, Store):
        return store, False
    return Store(store, create=create), True


def _prefix(run: str, step: str, update: int, cursor: int, epoch: int) -> CapturePrefix:
    prefix = CapturePrefix(run, step, update, cursor, epoch)
    for name in ("update", "cursor", "epoch"):
        value = getattr(prefix, name)
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return prefix


def save(state_dict: Mapping[str, Any], *, store: Store | str | os.PathLike, run: str, step: str, update: int,
         cursor: int, epoch: int, metadata: Any = None, compression: str | Mapping[str, str] = "raw",
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, carry: ShardCarry | None = None) -> str:
    """Publish a generation of a (nested) dict of tensors; return its root digest (64 hex).

    The generation is visible (as the newest ref of ``run``/``step``) only once
    every object is durable. ``compression`` is "raw", "zstd", "auto" or a
    mapping from region name (dotted) to one of those. ``metadata`` is any
    JSON value, stored in the manifest. Pass one :class:`ShardCarry` to
    successive saves of a run/step and a region (of at least 1 MiB) whose
    bytes did not change is not written again: the new generation names the
    shard an earlier one wrote.
    """
    prefix = _prefix(run, step, update, cursor, epoch)
    s, owned = _store(store, create=True)
    try:
        return save_state(state_dict, store=s, prefix=prefix, metadata=metadata, compression=compression,
                          max_shard_bytes=max_shard_bytes, carry=carry).root
    finally:
        if owned:
            s.close()


def save_async(state_dict: Mapping[str, Any], *, store: Store, run: str, step: str, update: int, cursor: int,
               epoch: int, metadata: Any = None, compression: str | Mapping[str, str] = "raw",
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, saver: AsyncSaver | None = None,
               defer_snapshot: bool = False) -> SaveHandle | None:
    """Snapshot ``state_dict`` now and publish it in the background, as :func:`save` would.

    Returns a :class:`SaveHandle` (``.result()`` is the :class:`Published`
    generation once it is durable, or raises its failure), or None when
    ``saver`` skips because a save is still in flight (``in_flight="skip"``).
    Pass one ``saver`` for every save of a run: it reuses its snapshot
    buffers and keeps one save in flight. With ``defer_snapshot=True`` the
    copy is made in the background too and the caller must call
    ``handle.wait_snapshot()`` before changing any tensor of ``state_dict``.
    """
    prefix = _prefix(run, step, update, cursor, epoch)
    if not isinstance(store, Store):
        raise TypeError("save_async needs an open Store (the background publish outlives this call)")
    names = [name for name, _ in flatten_state(state_dict)]
    saver = saver if saver is not None else AsyncSaver()

    def publish(snapshot: list) -> Published:
        return save_state(dict(zip(names, snapshot)), store=store, prefix=prefix, metadata=metadata,
                          compression=compression, max_shard_bytes=max_shard_bytes, carry=saver.carry)

    return saver.submit([t for _, t in flatten_state(state_dict)], publish, defer_snapshot=defer_snapshot)


def load(state_dict: Mapping[str, Any], *, store: Store | str | os.PathLike, digest: str) -> Counters:
    """Validate generation ``digest`` completely, then copy it into ``state_dict``'s tensors in place.

    Raises :class:`Refusal` (tensors untouched, store unmodified) when anything
    is wrong. Returns the counters (update, cursor, epoch) and metadata.
    """
    s, owned = _store(store, create=False)
    try:
        return load_state(state_dict, store=s, root=digest)
    finally:
        if owned:
            s.close()


def verify(store: Store | str | os.PathLike, digest: str) -> None:
    """Validate every object of generation ``digest``; raise :class:`Refusal` if anything is wrong."""
    s, owned = _store(store, create=False)
    try:
        verify_generation(s, digest)
    finally:
        if owned:
            s.close()


def latest(store: Store | str | os.PathLike, run: str, step: str) -> str | None:
    """Root digest of the newest complete (fully validated) generation of ``run``/``step``, or None."""
    s, owned = _store(store, create=False)
    try:
        record, _ = latest_generation(s, run, step)
        return record.root if record else None
    finally:
        if owned:
            s.close()
