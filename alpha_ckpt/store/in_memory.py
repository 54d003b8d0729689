"""A storage backend that keeps everything in this process's memory: no file is opened, created or listed.

What it is for: a store whose every byte lives and dies with one process (tests, a scratch capture), and
the proof that the Store above a backend needs nothing of a file system. A writer writes each object into
an anonymous memory file (``os.memfd_create``, no path), which is read back whole and kept as bytes.
"""
from __future__ import annotations

import os
import secrets
import threading
from typing import Callable, Iterator, Sequence

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import is_digest
from alpha_ckpt.store.backend import PutResult, RefDir, RefUnreadable, open_each
from alpha_ckpt.store.objects import ObjectFile, Validate
from alpha_ckpt.store.refs import MAX_REF_BYTES


def _memory_file(data: bytes = b"") -> int:
    fd = os.memfd_create("alpha-ckpt-object", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return fd


class InMemoryRefDir(RefDir):
    """The refs of one (run, step) in a dictionary; publishes are serialised by the backend's lock."""

    def __init__(self, backend: "InMemoryBackend", refs: dict[int, bytes]):
        self._backend, self._refs = backend, refs

    def numbers(self) -> list[int]:
        with self._backend.lock:
            return sorted(self._refs)

    def read(self, generation: int) -> bytes | None:
        with self._backend.lock:
            body = self._refs.get(generation)
        if body is not None and len(body) > MAX_REF_BYTES:
            raise RefUnreadable("too large to be a ref", True)
        return body

    def put(self, generation: int, body: bytes) -> None:
        with self._backend.lock:
            if generation in self._refs:
                raise FileExistsError(generation)
            self._refs[generation] = bytes(body)

    def delete(self, generation: int) -> bool:
        with self._backend.lock:
            return self._refs.pop(generation, None) is not None

    def set_aside(self, generation: int, aside: str, what: str) -> bool:
        with self._backend.lock:
            body = self._refs.pop(generation, None)
            if body is not None:
                self._backend.aside[aside] = body
            return body is not None

    def close(self) -> None:
        pass


class InMemoryBackend:
    """Objects, refs, leases and outputs in dictionaries of bytes (see the module's docstring)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.refs: dict[tuple[str, str], dict[int, bytes]] = {}
        self.aside: dict[str, bytes] = {}       # what was set aside (a damaged object, an unreadable ref)
        self.leases: dict[str, bytes] = {}
        self.outputs: dict[tuple[str, str, str], bytes] = {}
        self.lock = threading.Lock()
        self._instance: str | None = None
        self.location = f"memory:{id(self):x}"

    def read_instance(self) -> str | None:
        return self._instance

    def make_instance(self) -> str:
        with self.lock:
            if self._instance is None:
                self._instance = secrets.token_hex(16)
            return self._instance

    def put_lease(self, name: str, body: bytes) -> None:
        with self.lock:
            self.leases[name] = bytes(body)

    def remove_lease(self, name: str) -> None:
        with self.lock:
            self.leases.pop(name, None)

    def put_output(self, run: str, step: str, name: str, data: bytes) -> str:
        with self.lock:
            self.outputs.setdefault((run, step, name), bytes(data))
        return f"{self.location}/outputs/{run}/{step}/{name}"

    def put_objects(self, writes: Sequence[Callable[[int], str]], threads: int) -> list[PutResult]:
        out = []
        for write in writes:
            fd = _memory_file()
            try:
                name = write(fd)
                if not is_digest(name):
                    raise Refusal(RefusalCode.FORMAT, f"object name {name!r} is not a plain 64-hex digest")
                size = os.fstat(fd).st_size
                data = os.pread(fd, size, 0)
            finally:
                os.close(fd)
            with self.lock:
                created = name not in self.objects
                if created:
                    self.objects[name] = data
            out.append(PutResult(name, size, created))
        return out

    def reuse_object(self, name: str, size: int | None, validate: Validate) -> bool:
        with self.lock:
            data = self.objects.get(name)
        if data is None:
            return False
        problem = size is not None and len(data) != size
        if not problem:
            with self.open_object(name, "existing object") as obj:
                try:
                    validate(obj, name)
                except Refusal:
                    problem = True
        if problem:
            with self.lock:
                if self.objects.get(name) is data:
                    self.aside[f"{name}-{secrets.token_hex(4)}"] = self.objects.pop(name)
        return not problem

    def has_object(self, name: str) -> bool:
        return name in self.objects

    def open_objects(self, wanted: Sequence[tuple[str, int]], what: str) -> list[ObjectFile]:
        return open_each(self, wanted, what)

    def open_object(self, name: str, what: str) -> ObjectFile:
        data = self.objects.get(name)
        if data is None:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {name} is missing from the store")
        return ObjectFile(_memory_file(data), len(data), name)

    def read_object(self, name: str, offset: int, length: int) -> bytes:
        data = self.objects.get(name)
        if data is None:
            raise Refusal(RefusalCode.MISSING_SHARD, f"object {name} is missing from the store")
        return data[offset:offset + length]

    def list_objects(self, on_hostile: Callable[[str, str], None] | None = None) -> Iterator[str]:
        with self.lock:
            return iter(sorted(self.objects))

    def renew_object(self, name: str) -> bool:
        return name in self.objects

    def delete_object(self, name: str) -> bool:
        with self.lock:
            return self.objects.pop(name, None) is not None

    def ref_dir(self, run: str, step: str, create: bool) -> InMemoryRefDir | None:
        with self.lock:
            if (run, step) not in self.refs:
                if not create:
                    return None
                self.refs[(run, step)] = {}
            return InMemoryRefDir(self, self.refs[(run, step)])

    def runs(self) -> list[tuple[str, str]]:
        with self.lock:
            return sorted(k for k, v in self.refs.items() if v)

    def probe_write(self) -> None:
        pass

    def close(self) -> None:
        pass
