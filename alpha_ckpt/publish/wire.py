"""Messages between owners: canonical JSON or raw bytes in uint8 tensors. No pickle on the wire."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..format import canonical_json

_LENGTH = 8


def send_bytes(data: bytes | memoryview, dst: int) -> None:
    """Point to point: an 8-byte length, then the bytes."""
    length = torch.tensor([len(data)], dtype=torch.int64)
    dist.send(length, dst)
    if len(data):
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def recv_bytes(src: int) -> bytes:
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src)
    buf = torch.empty(int(length.item()), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src)
    return buf.numpy().tobytes()


def broadcast_json(obj, src: int = 0):
    """Every owner gets owner ``src``'s JSON value (others pass None)."""
    if dist.get_rank() == src:
        data = canonical_json(obj)
        length = torch.tensor([len(data)], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if dist.get_rank() == src \
        else torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(buf, src)
    return json.loads(buf.numpy().tobytes().decode("ascii"))


def gather_json(obj, dst: int = 0):
    """Owner ``dst`` gets every owner's JSON value in owner order; the others get None."""
    if dist.get_rank() != dst:
        send_bytes(canonical_json(obj), dst)
        return None
    out = []
    for r in range(dist.get_world_size()):
        out.append(obj if r == dst else json.loads(recv_bytes(r).decode("ascii")))
    return out
