"""Messages between owners: canonical JSON or raw bytes in uint8 tensors. No pickle on the wire.

Under NCCL the tensors travel in the owner's CUDA device memory (NCCL moves
nothing else); under gloo they stay on the host.
"""
from __future__ import annotations

import json
import threading
import warnings

import torch
import torch.distributed as dist

from ..format import canonical_json


def wire_device(group=None) -> torch.device:
    """Where a message's tensor must be: the CUDA device under NCCL, else host memory."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_tensor(data: bytes | memoryview, group=None) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(wire_device(group))


# ``group``: None for the default group; an asynchronous save passes its own
# group spanning every owner (ranks are global ranks either way), so its
# messages never interleave with training's collectives.

def send_bytes(data: bytes | memoryview, dst: int, group=None) -> None:
    """Point to point: an 8-byte length, then the bytes."""
    send_views([memoryview(data).cast("B")], dst, group)


def recv_bytes(src: int, group=None) -> bytes:
    return recv_view(src, group).tobytes()


BATCH_BYTES = 1 << 20  # pieces this large travel alone, straight from their memory
RUN_BYTES = 16 << 20   # smaller pieces travel together, up to about this much per message


def batches(sizes: list[int], alone: int = BATCH_BYTES, run_bytes: int = RUN_BYTES) -> list[list[int]]:
    """Which pieces travel in one message (pure; sender and receiver compute it from the same sizes):
    a piece of ``alone`` bytes or more by itself, runs of smaller ones together up to about ``run_bytes``."""
    out: list[list[int]] = []
    run: list[int] = []
    held = 0
    for i, size in enumerate(sizes):
        if size >= alone:
            if run:
                out.append(run)
                run, held = [], 0
            out.append([i])
            continue
        run.append(i)
        held += size
        if held >= run_bytes:
            out.append(run)
            run, held = [], 0
    if run:
        out.append(run)
    return out


def send_pieces(views, dst: int, group=None) -> None:
    """Point to point, pieces whose sizes the receiver knows: a large piece is sent from its own
    memory (no copy on gloo), small ones concatenated by :func:`batches`. Empty pieces send nothing."""
    device = wire_device(group)
    with warnings.catch_warnings():  # read-only views are only read here
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for batch in batches([len(v) for v in views]):
            parts = [torch.frombuffer(views[i], dtype=torch.uint8) for i in batch if len(views[i])]
            if parts:
                dist.send((torch.cat(parts) if len(parts) > 1 else parts[0]).to(device), dst, group=group)


class ReceiveBuffers:
    """Receive buffers reused within one exchange, at most ``limit`` bytes of them (more only for a
    single message larger than that): the receiver's memory stays bounded, and a reused buffer's
    pages are already resident. :meth:`take` waits while the buffers are all in use."""

    def __init__(self, limit: int, device: torch.device | str = "cpu"):
        self.limit, self.device = limit, torch.device(device)
        self.held = 0  # bytes of every buffer, free or in use
        self.peak = 0
        self._free: list[torch.Tensor] = []
        self._cond = threading.Condition()

    def take(self, size: int) -> torch.Tensor:
        with self._cond:
            while True:
                fits = [i for i, b in enumerate(self._free) if b.numel() >= size]
                if fits:  # by index: list.remove would compare tensors with ==, elementwise
                    buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                    return buf[:size]
                if self.held + size <= self.limit or self.held == 0:
                    self.held += size
                    self.peak = max(self.peak, self.held)
                    return torch.empty(size, dtype=torch.uint8, device=self.device)
                if self._free:  # too small for this message: make room for a larger one
                    self.held -= self._free.pop().numel()
                    continue
                self._cond.wait()

    def give(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf if buf._base is None else buf._base)
            self._cond.notify_all()


def recv_batches(sizes: list[int], src: int, group=None, buffers: ReceiveBuffers | None = None):
    """What :func:`send_pieces` sent, one message at a time: yields (piece indices, one view per
    piece, the buffer holding them). With ``buffers``, give each buffer back once its views are done."""
    device = wire_device(group)
    for batch in batches(sizes):
        total = sum(sizes[i] for i in batch)
        if not total:
            yield batch, [memoryview(b"")] * len(batch), None
            continue
        buf = buffers.take(total) if buffers is not None else torch.empty(total, dtype=torch.uint8, device=device)
        dist.recv(buf, src, group=group)
        view, offset, views = memoryview(buf.cpu().numpy()).cast("B"), 0, []
        for i in batch:
            views.append(view[offset:offset + sizes[i]])
            offset += sizes[i]
        yield batch, views, buf


def recv_pieces(sizes: list[int], src: int, group=None) -> list[memoryview]:
    """What :func:`send_pieces` sent, one view per piece (views of the received buffers)."""
    out: list[memoryview] = [memoryview(b"")] * len(sizes)
    for batch, views, _ in recv_batches(sizes, src, group):
        for i, view in zip(batch, views):
            out[i] = view
    return out


def send_views(views, dst: int, group=None) -> None:
    """Point to point: an 8-byte length, then the views' bytes one after another (copied once)."""
    with warnings.catch_warnings():  # read-only views are only read here
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        parts = [torch.frombuffer(v, dtype=torch.uint8) for v in views if len(v)]
    data = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else torch.empty(0, dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=wire_device(group)), dst, group=group)
    if data.numel():
        dist.send(data.to(wire_device(group)), dst, group=group)


def recv_view(src: int, group=None) -> memoryview:
    """What :func:`send_views` sent, as a view of the received buffer (no copy on gloo)."""
    length = torch.zeros(1, dtype=torch.int64, device=wire_device(group))
    dist.recv(length, src, group=group)
    buf = torch.empty(int(length.item()), dtype=torch.uint8, device=wire_device(group))
    if buf.numel():
        dist.recv(buf, src, group=group)
    return memoryview(buf.cpu().numpy()).cast("B")


def broadcast_json(obj, src: int = 0, group=None):
    """Every owner gets owner ``src``'s JSON value (others pass None)."""
    device = wire_device(group)
    if dist.get_rank() == src:
        data = canonical_json(obj)
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    buf = _to_tensor(data, group) if dist.get_rank() == src else torch.empty(int(length.item()), dtype=torch.uint8,
                                                                              device=device)
    dist.broadcast(buf, src, group=group)
    return json.loads(buf.cpu().numpy().tobytes().decode("ascii"))


def gather_json(obj, dst: int = 0, group=None):
    """Rank ``dst`` (a global rank, as everywhere here) gets the JSON value of every rank of ``group``,
    in group-rank order; the others get None."""
    if dist.get_rank() != dst:
        send_bytes(canonical_json(obj), dst, group)
        return None
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return [obj if r == dst else json.loads(recv_bytes(r, group).decode("ascii")) for r in ranks]
