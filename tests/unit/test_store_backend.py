"""The storage interface: one short contract that the POSIX backend and a backend keeping everything in
memory (no file system: objects are written through anonymous memory files) both keep."""
from __future__ import annotations

import os
from typing import Callable, Iterator, Sequence

import pytest

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import digest_bytes
from alpha_ckpt.store import ObjectFile, PosixBackend, PutResult, RefUnreadable, StorageBackend, StoreLayout
from alpha_ckpt.store.backend import RefDir
from alpha_ckpt.store.write_mode import DEFAULT_WRITE_THREADS


class MemoryRefDir(RefDir):
    def __init__(self, refs: dict[int, bytes], aside: dict[str, bytes]):
        self._refs, self._aside = refs, aside

    def numbers(self) -> list[int]:
        return sorted(self._refs)

    def read(self, generation: int) -> bytes | None:
        body = self._refs.get(generation)
        if body is not None and len(body) > 4096:
            raise RefUnreadable("too large to be a ref", True)
        return body

    def put(self, generation: int, body: bytes) -> None:
        if generation in self._refs:
            raise FileExistsError(generation)
        self._refs[generation] = bytes(body)

    def delete(self, generation: int) -> bool:
        return self._refs.pop(generation, None) is not None

    def set_aside(self, generation: int, aside: str, what: str) -> bool:
        body = self._refs.pop(generation, None)
        if body is not None:
            self._aside[aside] = body
        return body is not None

    def close(self) -> None:
        pass


class MemoryBackend:
    """Objects and refs in dictionaries; a writer writes into a memfd, which is read back whole."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.refs: dict[tuple[str, str], dict[int, bytes]] = {}
        self.aside: dict[str, bytes] = {}

    def put_objects(self, writes: Sequence[Callable[[int], str]], threads: int) -> list[PutResult]:
        out = []
        for write in writes:
            fd = os.memfd_create("object", os.MFD_CLOEXEC)
            try:
                name = write(fd)
                size = os.fstat(fd).st_size
                data = os.pread(fd, size, 0)
            finally:
                os.close(fd)
            created = name not in self.objects
            if created:
                self.objects[name] = data
            out.append(PutResult(name, size, created))
        return out

    def reuse_object(self, name: str, size: int | None, validate) -> bool:
        if name not in self.objects:
            return False
        if size is not None and len(self.objects[name]) != size:
            self.aside[name] = self.objects.pop(name)
            return False
        with self.open_object(name, "existing object") as obj:
            try:
                validate(obj, name)
            except Refusal:
                self.aside[name] = self.objects.pop(name)
                return False
        return True

    def has_object(self, name: str) -> bool:
        return name in self.objects

    def open_object(self, name: str, what: str) -> ObjectFile:
        if name not in self.objects:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {name} is missing from the store")
        data = self.objects[name]
        fd = os.memfd_create("object", os.MFD_CLOEXEC)
        os.write(fd, data)
        return ObjectFile(fd, len(data), name)

    def read_object(self, name: str, offset: int, length: int) -> bytes:
        return self.objects[name][offset:offset + length]

    def list_objects(self, on_hostile=None) -> Iterator[str]:
        return iter(sorted(self.objects))

    def renew_object(self, name: str) -> bool:
        return name in self.objects

    def delete_object(self, name: str) -> bool:
        return self.objects.pop(name, None) is not None

    def ref_dir(self, run: str, step: str, create: bool) -> MemoryRefDir | None:
        if (run, step) not in self.refs:
            if not create:
                return None
            self.refs[(run, step)] = {}
        return MemoryRefDir(self.refs[(run, step)], self.aside)

    def runs(self) -> list[tuple[str, str]]:
        return sorted(k for k, v in self.refs.items() if v)

    def probe_write(self) -> None:
        pass

    def close(self) -> None:
        pass


def _writer(data: bytes) -> Callable[[int], str]:
    def write(fd: int) -> str:
        os.write(fd, data)
        return digest_bytes(data)
    return write


def _validate(obj: ObjectFile, what: str) -> None:
    if digest_bytes(bytes(obj.view())) != obj.digest:
        raise Refusal(RefusalCode.CORRUPT_SHARD, f"{what}: its bytes are not its name")


@pytest.fixture(params=["posix", "memory"])
def backend(request, tmp_path) -> Iterator[StorageBackend]:
    b = PosixBackend(StoreLayout(tmp_path / "store"), create=True) if request.param == "posix" else MemoryBackend()
    yield b
    b.close()


def test_a_backend_puts_an_object_once_and_reads_back_any_range_of_it(backend):
    data = bytes(range(256)) * 40
    first = backend.put_objects([_writer(data), _writer(b"other")], DEFAULT_WRITE_THREADS)
    name = digest_bytes(data)
    assert [(p.name, p.size, p.created) for p in first] == [(name, len(data), True),
                                                            (digest_bytes(b"other"), 5, True)]
    again = backend.put_objects([_writer(data)], DEFAULT_WRITE_THREADS)
    assert again == [PutResult(name, len(data), False)]  # taken: reported, left as it was
    assert backend.reuse_object(name, len(data), _validate)
    assert backend.has_object(name) and not backend.has_object(digest_bytes(b"never"))
    assert backend.read_object(name, 1000, 24) == data[1000:1024]
    assert backend.read_object(name, len(data) - 3, 10) == data[-3:]
    with backend.open_object(name, "object") as obj:
        assert bytes(obj.view()) == data
    assert list(backend.list_objects()) == sorted([name, digest_bytes(b"other")])
    assert backend.delete_object(name) and not backend.delete_object(name)
    assert list(backend.list_objects()) == [digest_bytes(b"other")]
    with pytest.raises(Refusal) as refused:
        backend.open_object(name, "object")
    assert refused.value.code == RefusalCode.MISSING_SHARD


def test_a_ref_number_is_published_once_and_the_head_moves_only_from_where_it_was(backend):
    assert backend.ref_dir("r", "s", create=False) is None
    with backend.ref_dir("r", "s", create=True) as refs:
        assert refs.numbers() == [] and refs.read(1) is None
        refs.put(1, b"first")
        with pytest.raises(FileExistsError):
            refs.put(1, b"rival")  # publish-if-absent: the number is taken
        assert refs.read(1) == b"first"
        assert refs.cas_head(1, b"second")          # 1 -> 2
        assert not refs.cas_head(1, b"stale")      # a publisher that still saw 1 loses
        assert refs.numbers() == [1, 2] and refs.read(2) == b"second"
        assert refs.delete(1) and not refs.delete(1)
        assert refs.numbers() == [2]
    assert backend.runs() == [("r", "s")]
    with backend.ref_dir("r", "s", create=False) as refs:
        assert refs.read(2) == b"second"
