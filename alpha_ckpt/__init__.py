"""alpha_ckpt: checkpoints that are one consistent state of one learner, or nothing.

The one-process API (the launcher makes it collective)::

    root = alpha_ckpt.save(state_dict, store="ckpt", run="nightly", step="fit", update=3, cursor=96, epoch=0)
    counters = alpha_ckpt.load(state_dict, store="ckpt", digest=root)   # in place, or Refusal
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from .errors import DurableWriteError, PublishConflict, Refusal, RefusalCode
from .format import CapturePrefix
from .restore import Counters, latest_generation, load_state, verify_generation
from .writer import DEFAULT_MAX_SHARD_BYTES, save_state
from .store import Store

__all__ = ["save", "load", "verify", "latest", "Store", "Refusal", "RefusalCode", "Counters", "DurableWriteError", "PublishConflict"]
__version__ = "0.1.0"


def _store(store: Store | str | os.PathLike, create: bool) -> tuple[Store, bool]:
    if isinstance(store, Store):
        return store, False
    return Store(store, create=create), True


def save(state_dict: Mapping[str, Any], *, store: Store | str | os.PathLike, run: str, step: str, update: int,
         cursor: int, epoch: int, metadata: Any = None, compression: str | Mapping[str, str] = "raw",
         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Publish a generation of a (nested) dict of tensors; return its root digest (64 hex).

    The generation is visible (as the newest ref of ``run``/``step``) only once
    every object is durable. ``compression`` is "raw", "zstd", "auto" or a
    mapping from region name (dotted) to one of those. ``metadata`` is any
    JSON value, stored in the manifest.
    """
    prefix = CapturePrefix(run, step, update, cursor, epoch)
    for name in ("update", "cursor", "epoch"):
        value = getattr(prefix, name)
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    s, owned = _store(store, create=True)
    try:
        return save_state(state_dict, store=s, prefix=prefix, metadata=metadata, compression=compression,
                          max_shard_bytes=max_shard_bytes).root
    finally:
        if owned:
            s.close()


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
