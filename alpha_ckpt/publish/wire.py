"""Messages between owners: canonical JSON or raw bytes in uint8 tensors. No pickle on the wire.

Under NCCL the tensors travel in the owner's CUDA device memory (NCCL moves
nothing else); under gloo they stay on the host.
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..format import canonical_json


def _wire_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_tensor(data: bytes | memoryview) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_wire_device())


def send_bytes(data: bytes | memoryview, dst: int) -> None:
    """Point to point: an 8-byte length, then the bytes."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64, device=_wire_device()), dst)
    if len(data):
        dist.send(_to_tensor(data), dst)


def recv_bytes(src: int) -> bytes:
    length = torch.zeros(1, dtype=torch.int64, device=_wire_device())
    dist.recv(length, src)
    buf = torch.empty(int(length.item()), dtype=torch.uint8, device=_wire_device())
    if buf.numel():
        dist.recv(buf, src)
    return buf.cpu().numpy().tobytes()


def broadcast_json(obj, src: int = 0):
    """Every owner gets owner ``src``'s JSON value (others pass None)."""
    device = _wire_device()
    if dist.get_rank() == src:
        data = canonical_json(obj)
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(length, src)
    buf = _to_tensor(data) if dist.get_rank() == src else torch.empty(int(length.item()), dtype=torch.uint8,
                                                                       device=device)
    dist.broadcast(buf, src)
    return json.loads(buf.cpu().numpy().tobytes().decode("ascii"))


def gather_json(obj, dst: int = 0):
    """Owner ``dst`` gets every owner's JSON value in owner order; the others get None."""
    if dist.get_rank() != dst:
        send_bytes(canonical_json(obj), dst)
        return None
    out = []
    for r in range(dist.get_world_size()):
        out.append(obj if r == dst else json.loads(recv_bytes(r).decode("ascii")))
    return out
