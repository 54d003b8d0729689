"""Messages between owners: canonical JSON or raw bytes in uint8 tensors. No pickle on the wire.

Under NCCL the tensors travel in the owner's CUDA device memory (NCCL moves
nothing else); under gloo they stay on the host.
"""
from __future__ import annotations

import json
import warnings

import torch
import torch.distributed as dist

from alpha_ckpt.format.records import canonical_json
from alpha_ckpt.runtime.teardown import exit_clean


def any_rank(flag: bool, group=None) -> bool:
    """Collective: whether ``flag`` holds on any rank of ``group`` (the same answer on every rank)."""
    exit_clean()  # the process leaves gloo cleanly at exit (alpha_ckpt.runtime.teardown)
    value = torch.tensor([int(flag)], dtype=torch.int64, device=wire_device(group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def global_rank(rank: int, group=None) -> int:
    """``rank`` of ``group`` as a rank of the default group (what send, recv and broadcast name)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def wire_device(group=None) -> torch.device:
    """Where a message's tensor must be: the CUDA device under NCCL, else host memory."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def message_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """``data`` copied into a host tensor that owns its memory.

    Never a ``torch.frombuffer`` view: such a tensor keeps a Python object alive, and gloo
    keeps the tensors of finished work past the call; if the process exits without
    destroying the group, that tensor is released after the interpreter is gone, and
    taking the GIL to release it aborts the process (std::terminate, SIGABRT) after the
    script returned.
    """
    out = torch.empty(len(data), dtype=torch.uint8)
    if len(data):
        with warnings.catch_warnings():  # read-only views are only read here
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            out.copy_(torch.frombuffer(data, dtype=torch.uint8))
    return out


def _to_tensor(data: bytes | memoryview, group=None) -> torch.Tensor:
    return message_tensor(data).to(wire_device(group))


# ``group``: None for the default group; an asynchronous save passes its own
# group spanning every owner (ranks are global ranks either way), so its
# messages never interleave with training's collectives.

def send_bytes(data: bytes | memoryview, dst: int, group=None) -> None:
    """Point to point: an 8-byte length, then the bytes."""
    send_views([memoryview(data).cast("B")], dst, group)


def recv_bytes(src: int, group=None) -> bytes:
    return recv_view(src, group).tobytes()


def send_views(views, dst: int, group=None) -> None:
    """Point to point: an 8-byte length, then the views' bytes one after another (copied once)."""
    exit_clean()
    with warnings.catch_warnings():  # read-only views are only read here
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        parts = [torch.frombuffer(v, dtype=torch.uint8) for v in views if len(v)]
    # torch.cat's result owns its memory; a lone part is copied too (see message_tensor).
    data = torch.cat(parts) if len(parts) > 1 else parts[0].clone() if parts else torch.empty(0, dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=wire_device(group)), dst, group=group)
    if data.numel():
        dist.send(data.to(wire_device(group)), dst, group=group)


def recv_view(src: int, group=None) -> memoryview:
    """What :func:`send_views` sent, as a view of the received buffer (no copy on gloo)."""
    exit_clean()
    length = torch.zeros(1, dtype=torch.int64, device=wire_device(group))
    dist.recv(length, src, group=group)
    buf = torch.empty(int(length.item()), dtype=torch.uint8, device=wire_device(group))
    if buf.numel():
        dist.recv(buf, src, group=group)
    return memoryview(buf.cpu().numpy()).cast("B")


def broadcast_json(obj, src: int = 0, group=None, *, echo: bool = True):
    """Every owner gets owner ``src``'s JSON value (others pass None); ``src`` gets it back decoded,
    or None with ``echo=False`` (a source that keeps using its own value decodes nothing)."""
    exit_clean()
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
    if dist.get_rank() == src and not echo:
        return None
    return json.loads(buf.cpu().numpy().tobytes().decode("ascii"))


def gather_json(obj, dst: int = 0, group=None):
    """Rank ``dst`` (a global rank, as everywhere here) gets the JSON value of every rank of ``group``,
    in group-rank order; the others get None."""
    if dist.get_rank() != dst:
        send_bytes(canonical_json(obj), dst, group)
        return None
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return [obj if r == dst else json.loads(recv_bytes(r, group).decode("ascii")) for r in ranks]
