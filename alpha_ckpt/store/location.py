"""Where a store lives, from what a user names it by: a path, or a URL whose scheme says which backend.

A string that starts with ``SCHEME://`` is a URL and never a path: ``s3://bucket/x`` taken as a path
would make a local directory named ``s3:``, a save that looks durable and is on the wrong machine.
``file://`` URLs are local paths. Object stores (``s3://``) need a backend this version does not have,
so naming one is a usage error, said before anything is written.
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
        raise StoreUsageError(f"store {text}: {scheme}:// object stores are not supported by this version; name a "
                              "directory (a path or file:///PATH)")
    raise StoreUsageError(f"store {text}: unknown scheme {scheme!r}; a store is a directory (a path or "
                          "file:///PATH)")


def canonical(spec: str | os.PathLike) -> str:
    """One name per store, for what must compare or hash equal across processes (alpha-run's hand-off, the
    memory tier's directory key): the absolute path of a file system store. Refuses what
    :func:`local_path` refuses."""
    return os.path.abspath(local_path(spec))
