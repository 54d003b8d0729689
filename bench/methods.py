"""The single-process save and restore methods (ours, torch.save, DCP, raw disk) of the store, stall and
many-tensors sections; the owners and checkpointer sections use the raw disk baseline too."""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import alpha_ckpt

from .common import RAW_BUFFER_BYTES, fsync_dir, open_store

# Each method: save(state, workdir, rep) -> handle ; restore(dest, workdir, handle) -> None.
# The timing brackets exactly these calls.


def ours_save(state, workdir: str, rep: int):
    with open_store(workdir) as store:
        return alpha_ckpt.save(state, store=store, run="bench", step="fit", update=rep, cursor=rep, epoch=0)


def ours_restore(dest, workdir: str, root) -> None:
    alpha_ckpt.restore(dest, store=workdir, root=root)


def torch_save(state, workdir: str, rep: int):
    path = os.path.join(workdir, "state.pt")
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(workdir)
    return path


@torch.no_grad()
def torch_restore(dest, workdir: str, path) -> None:
    loaded = torch.load(path, weights_only=True)
    for k, t in dest.items():
        t.copy_(loaded[k])
    del loaded


def dcp_save(state, workdir: str, rep: int):
    dcp.save(state, checkpoint_id=workdir)
    return workdir


def dcp_t2_save(state, workdir: str, rep: int):
    dcp.save(state, checkpoint_id=workdir, storage_writer=FileSystemWriter(workdir, thread_count=2))
    return workdir


def dcp_restore(dest, workdir: str, path) -> None:
    dcp.load(dest, checkpoint_id=path)


class RawDisk:
    """dd-like baseline: one reused buffer written until ``total`` bytes, one fsync at the end."""

    def __init__(self, state: dict[str, torch.Tensor], total: int):
        first = next(iter(state.values())).reshape(-1).view(torch.uint8)
        n = min(RAW_BUFFER_BYTES, total)
        if first.numel() >= n:
            self.buf = bytes(first[:n].numpy())
        else:
            self.buf = os.urandom(n)
        self.total = total

    def save(self, state, workdir: str, rep: int, name: str = "raw.bin"):
        path = os.path.join(workdir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = self.total
            view = memoryview(self.buf)
            while left:
                chunk = view[:min(left, len(view))]
                while chunk:
                    n = os.write(fd, chunk)
                    chunk = chunk[n:]
                    left -= n
            os.fsync(fd)
        finally:
            os.close(fd)
        return path

    @staticmethod
    def restore(dest, workdir: str, path) -> None:
        with open(path, "rb", buffering=0) as f:
            for t in dest.values():
                view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{path} is shorter than the state")
                    view = view[n:]
