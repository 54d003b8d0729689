"""What alpha_ckpt.dcp's StorageWriter and StorageReader share: the history this process continues
in a run/step (a load records where it resumed, a save continues from there), and closing a store
they opened themselves.
"""
from __future__ import annotations

import dataclasses
import os

from alpha_ckpt.store import Store


@dataclasses.dataclass(frozen=True)
class Chain:
    """The history this process continues in a run/step: the epoch it saves in, the generation it follows,
    and why it may not save at all (it loaded a generation a newer continuation has superseded)."""
    epoch: int
    follows: int
    stale: str | None = None


CHAINS: dict[tuple, Chain] = {}  # (the store's identity (chain_key), run, step): this process's history


def chain_key(store: Store, run: str, step: str) -> tuple:
    """A store's identity, however its path is spelled: its directory's device and inode on a file system,
    else the backend's normalised location (an object store's URL)."""
    if store.layout is None:
        return (store.root, run, step)
    st = os.stat(store.root)
    return (st.st_dev, st.st_ino, run, step)


def close_own_store(storage) -> None:
    """Close the store a writer or reader opened from a path, at the end of its save or load (a next
    one opens it again): its directory descriptors are not held from one checkpoint to the next. A
    Store the caller passed stays open: it is the caller's."""
    if storage._store is not None and not isinstance(storage._store_arg, Store):
        storage._store.close()
        storage._store = None
