"""The storage interface: one short contract that the POSIX backend, the backend keeping everything in
memory (no file system: objects are written through anonymous memory files), a read-through view over
either and the S3 backend (against a real server, SeaweedFS) keep."""
from __future__ import annotations

import os
from typing import Callable, Iterator

import pytest

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import digest_bytes
from alpha_ckpt.store import ObjectFile, PosixBackend, PutResult, StorageBackend, StoreLayout
from alpha_ckpt.store.in_memory import InMemoryBackend
from alpha_ckpt.store.read_through import ReadThroughBackend
from alpha_ckpt.store.write_mode import DEFAULT_WRITE_THREADS


def _writer(data: bytes) -> Callable[[int], str]:
    def write(fd: int) -> str:
        os.write(fd, data)
        return digest_bytes(data)
    return write


def _validate(obj: ObjectFile, what: str) -> None:
    if digest_bytes(bytes(obj.view())) != obj.digest:
        raise Refusal(RefusalCode.CORRUPT_SHARD, f"{what}: its bytes are not its name")


@pytest.fixture(params=["posix", "memory", "read-through", "s3"])
def backend(request, tmp_path) -> Iterator[StorageBackend]:
    if request.param == "posix":
        b = PosixBackend(StoreLayout(tmp_path / "store"), create=True)
    elif request.param == "memory":
        b = InMemoryBackend()
    elif request.param == "s3":
        from alpha_ckpt.store.s3 import S3Backend
        b = S3Backend(request.getfixturevalue("s3_store"))
    else:
        b = ReadThroughBackend(InMemoryBackend(), [InMemoryBackend()])
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


def test_a_backend_opens_many_objects_in_order_and_refuses_a_wrong_size_or_a_missing_one_before_its_bytes(backend):
    # the large one spans several of an object store's read ranges (16 MiB)
    large = os.urandom(1 << 20) * 17 + b"tail"
    small, empty = b"small object", b""
    backend.put_objects([_writer(large), _writer(small), _writer(empty)], DEFAULT_WRITE_THREADS)
    wanted = [(digest_bytes(small), len(small)), (digest_bytes(large), len(large)), (digest_bytes(empty), 0)]
    opened = backend.open_objects(wanted, "shard")
    try:
        assert [(obj.digest, obj.size) for obj in opened] == wanted
        assert [bytes(obj.view()) for obj in opened] == [small, large, empty]
        assert opened[1].read_at(len(large) - 4, 4) == b"tail"
    finally:
        for obj in opened:
            obj.close()
    for bad, code in (((digest_bytes(large), len(large) - 1), RefusalCode.FORMAT),
                      ((digest_bytes(small), len(small) + 1), RefusalCode.FORMAT),
                      ((digest_bytes(b"never put"), 9), RefusalCode.MISSING_SHARD)):
        opened = []
        with pytest.raises(Refusal) as refused:
            # refused by the open, or (a backend whose bytes are still arriving) by the first read
            opened = backend.open_objects([wanted[0], bad], "shard")
            bytes(opened[1].view())
        assert refused.value.code == code, bad
        if opened:  # bytes that arrive after the open: every read of the object refuses, not only the first
            with pytest.raises(Refusal):
                opened[1].view()
            for obj in opened:
                obj.close()


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


def test_a_read_through_backend_reads_what_it_lacks_from_a_peer_and_writes_only_to_its_own():
    own, peer = InMemoryBackend(), InMemoryBackend()
    peer.put_objects([_writer(b"held by the peer")], DEFAULT_WRITE_THREADS)
    view = ReadThroughBackend(own, [peer])
    name = digest_bytes(b"held by the peer")
    assert view.has_object(name) and not own.has_object(name)
    with view.open_object(name, "object") as obj:
        assert bytes(obj.view()) == b"held by the peer"
    assert view.read_object(name, 5, 2) == b"by"
    view.put_objects([_writer(b"written through the view")], DEFAULT_WRITE_THREADS)
    assert list(own.list_objects()) == [digest_bytes(b"written through the view")]
    assert list(peer.list_objects()) == [name]
    with pytest.raises(Refusal) as refused:
        view.open_object(digest_bytes(b"nowhere"), "object")
    assert refused.value.code == RefusalCode.MISSING_SHARD
