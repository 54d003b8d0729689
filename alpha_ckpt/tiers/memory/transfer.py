"""Carrying out a plan (:mod:`alpha_ckpt.tiers.memory.plan`): objects sent between ranks' holders over gloo.

Every rank walks the same list of transfers, window by window (:func:`transfer_windows`). In a
window, first each source tells its destination what it has (an int64: the size of its copy, or
-1 when it cannot read one), then every copy whose size is the planned one travels as uint8
bytes. Each rank posts all its sends and receives of a phase before it waits on any, so a
phase completes once every rank has reached it: no order of waits can deadlock, and the
windows bound the bytes a rank holds at once. A received copy is checked against its name by
the same validator the store trusts an existing object with, before it is stored; a bad copy is
reported and never stored. No pickle: only tensors travel.
"""
from __future__ import annotations

import logging
import mmap
import os
import warnings
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.generation.reader import validate_object_file
from alpha_ckpt.store import ObjectFile, Store, write_all
from alpha_ckpt.tiers.memory.plan import Transfer, transfer_windows

logger = logging.getLogger("alpha_ckpt")

DEFAULT_WINDOW_BYTES = 256 << 20  # two of the largest objects (alpha_ckpt.generation.writer.DEFAULT_MAX_SHARD_BYTES)
UNREADABLE = -1                   # what a source announces when it cannot read its copy


@dataclass
class TransferReport:
    bytes_sent: int = 0      # bytes of copies this rank sent
    bytes_received: int = 0  # bytes of copies this rank received, good or damaged
    damaged: list[str] = field(default_factory=list)      # copies received whose bytes do not match their name (not stored)
    unavailable: list[str] = field(default_factory=list)  # objects this rank was to send but could not read
    not_stored: list[str] = field(default_factory=list)   # good copies the holder failed to store (logged)

    def add(self, other: "TransferReport") -> "TransferReport":
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.damaged += other.damaged
        self.unavailable += other.unavailable
        self.not_stored += other.not_stored
        return self


def _check_plan(transfers: Sequence[Transfer], world: int) -> None:
    """Refuse a plan no rank can carry out, before any message: every rank gets the same list, so
    every rank refuses it alike and none is left waiting."""
    for t in transfers:
        Store.check_digest(t.digest)
        if t.size < 0 or not (0 <= t.src < world and 0 <= t.dst < world) or t.src == t.dst:
            raise ValueError(f"transfer {t} cannot be carried out in a group of {world} ranks")


def _tensor_of(view: memoryview) -> torch.Tensor:
    """The bytes as a uint8 tensor, without a copy. gloo only reads a send buffer, so a read-only
    map is safe to send from: torch's warning about non-writable buffers does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(view, dtype=torch.uint8)


class _Outgoing:
    """A copy this rank sends: opened from its holder (or why not)."""

    def __init__(self, index: int, transfer: Transfer, holder: Store):
        self.index, self.transfer = index, transfer
        self.obj: ObjectFile | None = None
        try:
            obj = holder.open_object(transfer.digest, f"object {transfer.digest[:16]}... to send")
        except (Refusal, OSError):
            self.announced = UNREADABLE
            return
        try:
            obj.populate(0, obj.size)  # in memory now, so a copy that shrank is unreadable, not a SIGBUS later
        except Refusal:
            obj.close()
            self.announced = UNREADABLE
            return
        self.obj, self.announced = obj, obj.size

    def close(self) -> None:
        if self.obj is not None:
            self.obj.close()


class _Incoming:
    """A copy this rank receives, into anonymous shared memory (memfd) that an ObjectFile then reads."""

    def __init__(self, index: int, transfer: Transfer):
        self.index, self.transfer = index, transfer
        self.announced = torch.empty(1, dtype=torch.int64)
        self.fd = -1
        self.map: mmap.mmap | None = None
        self.buffer: torch.Tensor | None = None

    def allocate(self) -> torch.Tensor:
        size = self.transfer.size
        self.fd = os.memfd_create(f"copy-{self.transfer.digest[:16]}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)
        return self.buffer

    def received(self) -> ObjectFile:
        """The received bytes as an object file (it owns the memfd from now on)."""
        self._unmap()
        obj, self.fd = ObjectFile(self.fd, self.transfer.size, self.transfer.digest), -1
        return obj

    def _unmap(self) -> None:
        self.buffer = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view is still alive somewhere; the GC will unmap it
                pass
            self.map = None

    def close(self) -> None:
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _wait_all(works: list) -> None:
    """Wait for every posted send and receive (each is posted before any is waited on)."""
    for work in works:
        if work is not None:
            work.wait()


def _run_window(transfers: Sequence[Transfer], start: int, stop: int, holder: Store, rank: int, group,
                report: TransferReport) -> None:
    with ExitStack() as cleanup:
        outgoing: list[_Outgoing] = []
        incoming: list[_Incoming] = []
        for index in range(start, stop):
            t = transfers[index]
            if t.src == rank:
                outgoing.append(cleanup.enter_context(closing(_Outgoing(index, t, holder))))
            elif t.dst == rank:
                incoming.append(cleanup.enter_context(closing(_Incoming(index, t))))

        # Phase 1: each source announces what it has; tags keep every message of the list apart.
        announcements = [torch.tensor([o.announced], dtype=torch.int64) for o in outgoing]
        _wait_all([dist.isend(a, group=group, group_dst=o.transfer.dst, tag=2 * o.index)
                   for a, o in zip(announcements, outgoing)] +
                  [dist.irecv(i.announced, group=group, group_src=i.transfer.src, tag=2 * i.index) for i in incoming])

        # Phase 2: the copies both sides now know will travel (the planned size; none for an empty object).
        sending = [o for o in outgoing if o.announced == o.transfer.size]
        receiving = [i for i in incoming if int(i.announced.item()) == i.transfer.size]
        buffers = [(o, _tensor_of(o.obj.view())) for o in sending if o.transfer.size]
        _wait_all([dist.isend(b, group=group, group_dst=o.transfer.dst, tag=2 * o.index + 1) for o, b in buffers] +
                  [dist.irecv(i.allocate(), group=group, group_src=i.transfer.src, tag=2 * i.index + 1)
                   for i in receiving if i.transfer.size])
        del buffers  # views of the sent maps: gone before the maps close

        for o in outgoing:
            if o.announced == UNREADABLE:
                report.unavailable.append(o.transfer.digest)
            elif o.announced == o.transfer.size:
                report.bytes_sent += o.transfer.size
        for i in incoming:
            announced = int(i.announced.item())
            if announced != UNREADABLE and announced != i.transfer.size:
                report.damaged.append(i.transfer.digest)  # a copy of another size cannot be the named object
        good = []
        for i in receiving:
            report.bytes_received += i.transfer.size
            obj = cleanup.enter_context(i.received()) if i.transfer.size else ObjectFile(-1, 0, i.transfer.digest)
            try:
                validate_object_file(obj, f"copy of object {i.transfer.digest[:16]}... from rank {i.transfer.src}")
            except Refusal:
                report.damaged.append(i.transfer.digest)
                continue
            good.append(obj)
        _store_copies(holder, good, report)


def _writer(obj: ObjectFile):
    def write(fd: int) -> str:
        write_all(fd, obj.view())
        return obj.digest
    return write


def _store_copies(holder: Store, copies: list[ObjectFile], report: TransferReport) -> None:
    """Store the window's good copies in one batched commit; one by one where the batch fails, so a
    failure costs only the copies it concerns."""
    if not copies:
        return
    try:
        holder.put_objects([_writer(obj) for obj in copies], validate=validate_object_file)
        return
    except (OSError, Refusal):
        pass
    for obj in copies:
        try:
            holder.put_objects([_writer(obj)], validate=validate_object_file)
        except (OSError, Refusal) as exc:
            logger.warning("alpha_ckpt: memory: a verified copy of object %s could not be stored in %s: %s",
                           obj.digest, holder.root, exc)
            report.not_stored.append(obj.digest)


def copy_through_files(transfers: Sequence[Transfer], holder: Store, rank: int,
                       source: Callable[[int], Store]) -> TransferReport:
    """The transfers whose source holder this rank reads directly (a holder of its node, on the same tmpfs):
    each one this rank is dst of is read from ``source(src)``'s file, checked with the store's validator
    and stored as a received copy is (:func:`run_transfers`); no message, no rank waits on another. A
    source that is src of one counts its size as sent."""
    report = TransferReport()
    for t in transfers:
        if t.src == rank:
            report.bytes_sent += t.size
        if t.dst != rank:
            continue
        try:
            obj = source(t.src).open_object(t.digest, f"object {t.digest[:16]}... of rank {t.src}")
            obj.populate(0, obj.size)  # in memory now: a file that shrank is unreadable, not a SIGBUS later
        except (Refusal, OSError):
            report.unavailable.append(t.digest)
            continue
        with closing(obj):
            report.bytes_received += obj.size
            try:
                if obj.size != t.size:
                    raise Refusal(RefusalCode.CORRUPT_SHARD, f"{obj.size} bytes, {t.size} planned")
                validate_object_file(obj, f"copy of object {t.digest[:16]}... from rank {t.src}'s holder")
            except Refusal:
                report.damaged.append(t.digest)
                continue
            _store_copies(holder, [obj], report)
    return report


def run_transfers(transfers: Sequence[Transfer], holder: Store, rank: int, group=None, *,
                  window_bytes: int = DEFAULT_WINDOW_BYTES) -> TransferReport:
    """Collective over ``group``: every rank calls it with the same list, in the same order (src and
    dst are ranks of ``group``; ``rank`` is this one's). For each transfer this rank is src of, it
    reads the object's bytes from its holder Store and sends them (first an int64 size: -1 when it
    cannot read its copy, then the bytes as a uint8 tensor, only when the size is the planned one);
    for each it is dst of, it receives them, checks them against the digest with the store's own
    validator, and stores a good copy in its holder with the Store's validated put. A bad copy is
    not stored and is listed in ``damaged``; the protocol always stays in step, so no rank waits
    forever. Ranks that are neither src nor dst skip the transfer. ``window_bytes``: how many bytes
    a rank sends and receives at once at most (a larger object travels alone)."""
    world = dist.get_world_size(group)
    if dist.get_rank(group) != rank:
        raise ValueError(f"rank {rank} is not this process's rank in the group ({dist.get_rank(group)})")
    _check_plan(transfers, world)
    report = TransferReport()
    for start, stop in transfer_windows(transfers, window_bytes):
        _run_window(transfers, start, stop, holder, rank, group, report)
    return report
