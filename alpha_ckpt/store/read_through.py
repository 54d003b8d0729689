"""A backend that reads what its own backend lacks from other backends (read only on them).

The memory tier's view of one node: a rank's holder, plus in place the objects the other holders of
its node keep. Every write, ref and lease goes to the own backend; no write reaches a peer through it.
Every object read through it is the reader's to validate against its name, as every object is.
"""
from __future__ import annotations

from typing import Sequence

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.store.backend import StorageBackend, open_each
from alpha_ckpt.store.objects import ObjectFile


class ReadThroughBackend:
    """``own`` for everything; an object missing there is read from the first of ``peers`` that has it.
    Closing it closes the peers (it owns them) and ``own``."""

    def __init__(self, own: StorageBackend, peers: Sequence[StorageBackend]):
        self.own, self.peers = own, list(peers)
        self.location = own.location

    def __getattr__(self, name: str):
        # Everything but the reads below is the own backend's: writes never reach a peer.
        return getattr(self.own, name)

    def has_object(self, name: str) -> bool:
        return self.own.has_object(name) or any(peer.has_object(name) for peer in self.peers)

    def open_object(self, name: str, what: str) -> ObjectFile:
        try:
            return self.own.open_object(name, what)
        except Refusal as missing:
            if missing.code != RefusalCode.MISSING_SHARD:
                raise
            for peer in self.peers:
                if peer.has_object(name):
                    return peer.open_object(name, what)
            raise

    def open_objects(self, wanted: Sequence[tuple[str, int]], what: str) -> list[ObjectFile]:
        # one by one through open_object, which falls back to the peers (own's own would not)
        return open_each(self, wanted, what)

    def read_object(self, name: str, offset: int, length: int) -> bytes:
        for backend in (self.own, *self.peers):
            if backend.has_object(name):
                return backend.read_object(name, offset, length)
        return self.own.read_object(name, offset, length)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.own.close()
