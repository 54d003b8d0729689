"""The content-addressed store: objects and refs under one root.

    layout.py      where everything lies under the root (objects and their fan-out, refs, tmp, pending,
                   quarantine, pins, verified, outputs): the one module that knows the directory layout
    backend.py     the storage interface (StorageBackend): put an object if absent, read, list,
                   publish a ref if absent, compare-and-swap a run's head, delete
    posix.py       its first implementation, the POSIX file system (PosixBackend)
    in_memory.py   everything in this process's memory, no file touched (InMemoryBackend)
    read_through.py   one backend reading what it lacks from others, read only (ReadThroughBackend)
    refs.py        the ref format, a run/step's History and the fence a publish passes
    objects.py     an object opened for reading (ObjectFile)
    write_mode.py  how large objects are written (WriteModes, the learner a Store owns)
    leases.py, pending.py   pending-publish leases (what lets gc run beside a publish); a backend keeps them
    sweep.py       gc's file operations: set objects and refs aside, put them back, remove
    pinfiles.py    the pins directory's files (what a pin means: alpha_ckpt.upkeep.pins)
    records.py     the verified directory's files (what a record means: alpha_ckpt.upkeep.complete)
    store.py       the Store, over a backend: Store(path) is over PosixBackend, Store(backend) over any

Every write goes through :func:`alpha_ckpt.store.durable.durable_commit`. Every read
opens relative to the store's directory descriptors with O_NOFOLLOW and
requires a regular file, so a name can never escape the store. Paths are
runtime bindings: a copied or moved store works unchanged.
"""
from __future__ import annotations

from alpha_ckpt.store._posix import write_all
from alpha_ckpt.store.backend import PutResult, RefDir, RefUnreadable, StorageBackend
from alpha_ckpt.store.layout import StoreLayout
from alpha_ckpt.store.leases import PENDING_DIR
from alpha_ckpt.store.objects import FAN_NAME_RE, ObjectFile, Validate
from alpha_ckpt.store.pending import PublishLease
from alpha_ckpt.store.posix import PosixBackend
from alpha_ckpt.store.refs import (MAX_PUBLISHED_AT, MAX_REF_BYTES, REF_DIGITS, REF_NAME_RE, History, RefRecord, UnreadableRef,
                   check_fence, decode_ref, encode_ref)
from alpha_ckpt.store.store import QUARANTINE_DIR, Store
from alpha_ckpt.store.write_mode import (DEFAULT_WRITE_MODE, DEFAULT_WRITE_THREADS, DIRECT_MARGIN, EXPLORE_EVERY, WRITE_MODES,
                         WriteModes)

__all__ = [
    "DEFAULT_WRITE_MODE", "DEFAULT_WRITE_THREADS", "DIRECT_MARGIN", "EXPLORE_EVERY", "FAN_NAME_RE",
    "MAX_PUBLISHED_AT", "MAX_REF_BYTES", "PENDING_DIR", "QUARANTINE_DIR", "REF_DIGITS", "REF_NAME_RE",
    "WRITE_MODES", "History", "ObjectFile", "PosixBackend", "PublishLease", "PutResult", "RefDir", "RefRecord",
    "RefUnreadable", "StorageBackend", "Store", "StoreLayout", "UnreadableRef", "Validate", "WriteModes",
    "check_fence", "decode_ref", "encode_ref", "write_all",
]
