"""An FSDP2 training script that checkpoints with torch.distributed.checkpoint, storing in alpha_ckpt.

    alpha-run --nproc 2 --store ./ckpt examples/train_fsdp2_dcp_backend.py --steps 4
    alpha-run --nproc 2 --store ./ckpt examples/train_fsdp2_dcp_backend.py --steps 8   # resumes at step 4

(or ``CKPT_STORE=./ckpt torchrun --nproc-per-node 2 ...``). The script is DCP's usual one:
``get_state_dict``/``set_state_dict`` for the sharded model and AdamW, ``dcp.save`` every 2
steps and ``dcp.load`` of the newest checkpoint at start. Only the two storage lines name
alpha_ckpt. Each checkpoint is one alpha_ckpt generation (BLAKE3 everywhere, durable, fenced;
DCP's metadata as typed JSON); ``dcp.load`` reshards it to whatever world size this run has.
Rank 0 prints one JSON line at the end: the SHA-256 of the full state and the losses.
"""
import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from alpha_ckpt.dcp import StorageReader, StorageWriter
from alpha_ckpt.runtime import launch_env
from alpha_ckpt.store import Store


def build(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    for layer in (model[0], model[3], model[5]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sin()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    # Under alpha-run: its --store and run (the options it hands its ranks); else your own.
    launched = launch_env.launcher_settings() if os.environ.get(launch_env.OPTIONS) else {}
    store = launched.get("store") or os.environ["CKPT_STORE"]
    run = launched.get("run") or "fsdp2-dcp"
    model, optim = build(init_device_mesh("cpu", (dist.get_world_size(),)))

    step = 0
    if Store(store).newest_ref(run, "train") is not None:  # resume: DCP reshards into this run's placement
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        reader = StorageReader(store, run=run)  # the newest complete generation, the same on every rank
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = reader.prefix.update

    losses = []
    while step < args.steps:
        torch.manual_seed(1000 + step)  # dropout: keyed by the step, so a resumed run draws the same
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(round(loss.item(), 6))
        step += 1
        if step % args.every == 0:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, storage_writer=StorageWriter(store, run=run, update=step))

    full_model, full_optim = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256()
    for t in list(full_model.values()) + [v for s in full_optim["state"].values() for v in s.values()]:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    if dist.get_rank() == 0:
        print(json.dumps({"state_sha256": digest.hexdigest(), "step": step, "losses": losses}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
