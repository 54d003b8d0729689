"""Where a store lives, from what a user names it by: a path, or a URL whose scheme says which backend.

A string that starts with ``SCHEME://`` is a URL and never a path: ``s3://bucket/x`` taken as a path
would make a local directory named ``s3:``, a save that looks durable and is on the wrong machine.
``file://`` URLs are local paths; ``s3://BUCKET/PREFIX`` is an S3-compatible object store
(:mod:`alpha_ckpt.store.s3`); any other scheme is a usage error, said before anything is written.
"""
from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from alpha_ckpt.errors import StoreUsageError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
OBJECT_STORE_SCHEMES = ("s3",)


def scheme_of(spec: str | os.PathLike) -> str | None:
    """The URL scheme ``spec`` is named with (lower case), or None for a path."""
    match = _URL.match(os.fspath(spec)) if isinstance(spec, str) else None
    return match.group(1).lower() if match else None


def local_path(spec: str | os.PathLike) -> str:
    """The file system path of a store named by a path or a ``file://`` URL; :class:`StoreUsageError`
    naming the store for any other URL (an object store, or a scheme no backend serves)."""
    scheme = scheme_of(spec)
    if scheme is None:
        return os.fspath(spec)
    text = os.fspath(spec)
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise StoreUsageError(f"store {text}: a file:// URL names a path on this machine, not on host "
                                  f"{parts.netloc!r} (write file:///PATH)")
        if not parts.path:
            raise StoreUsageError(f"store {text}: a file:// URL needs a path (file:///PATH)")
        return unquote(parts.path)
    if scheme in OBJECT_STORE_SCHEMES:
        raise StoreUsageError(f"store {text}: an object store has no path here")
    raise _unknown(text, scheme)


def _unknown(text: str, scheme: str) -> StoreUsageError:
    return StoreUsageError(f"store {text}: unknown scheme {scheme!r}; a store is a directory (a path or "
                           "file:///PATH) or an object store (s3://BUCKET/PREFIX)")


def is_object_store(spec: str | os.PathLike) -> bool:
    """Whether ``spec`` names an object store (``s3://``); :class:`StoreUsageError` for a scheme no backend serves."""
    scheme = scheme_of(spec)
    if scheme is None or scheme == "file":
        return False
    if scheme in OBJECT_STORE_SCHEMES:
        return True
    raise _unknown(os.fspath(spec), scheme)


def canonical(spec: str | os.PathLike) -> str:
    """One name per store, for what must compare or hash equal across processes (alpha-run's hand-off, the
    memory tier's directory key): the absolute path of a file system store, the normalised URL of an object
    store (``s3://BUCKET/PREFIX``). Refuses what neither is."""
    if is_object_store(spec):
        from alpha_ckpt.store.s3 import parse_url
        bucket, prefix = parse_url(os.fspath(spec))
        return f"s3://{bucket}/{prefix}".rstrip("/")
    return os.path.abspath(local_path(spec))
