"""The content-addressed store: objects, refs and tmp under one root.

    STORE/objects/ab/abcdef...        shards and manifests, named by the BLAKE3 of their head
    STORE/refs/RUN/STEP/0000000007    one small file per published generation: its root digest
    STORE/tmp/                        in-flight writes
    STORE/pending/<pid>-<random>      leases of publishes in flight (see :mod:`alpha_ckpt.store.leases`)
    STORE/quarantine/<digest>-<time>-<random>   damaged or hostile entries found at an object's path, set aside
    STORE/quarantine/ref-<generation>-<time>-<random>   unreadable refs gc set aside

Every write goes through :func:`alpha_ckpt.durable.durable_commit`. Every read
opens relative to the store's directory descriptors with O_NOFOLLOW and
requires a regular file, so a name can never escape the store. Paths are
runtime bindings: a copied or moved store works unchanged.
"""
from __future__ import annotations

from ._posix import write_all
from .layout import StoreLayout
from .leases import PENDING_DIR
from .objects import FAN_NAME_RE, ObjectFile, Validate
from .pending import PublishLease
from .refs import (MAX_PUBLISHED_AT, MAX_REF_BYTES, REF_DIGITS, REF_NAME_RE, History, RefRecord, UnreadableRef,
                   check_fence, decode_ref, encode_ref)
from .store import QUARANTINE_DIR, Store
from .write_mode import DEFAULT_WRITE_MODE, DEFAULT_WRITE_THREADS, DIRECT_MARGIN, EXPLORE_EVERY, WRITE_MODES, WriteModes

__all__ = [
    "DEFAULT_WRITE_MODE", "DEFAULT_WRITE_THREADS", "DIRECT_MARGIN", "EXPLORE_EVERY", "FAN_NAME_RE",
    "MAX_PUBLISHED_AT", "MAX_REF_BYTES", "PENDING_DIR", "QUARANTINE_DIR", "REF_DIGITS", "REF_NAME_RE",
    "WRITE_MODES", "WriteModes", "History", "ObjectFile", "PublishLease", "RefRecord",
    "Store", "StoreLayout", "UnreadableRef", "Validate", "check_fence", "decode_ref", "encode_ref", "write_all",
]
