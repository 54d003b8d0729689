"""An FSDP2 training script checkpointed with alpha_ckpt.Checkpointer: sharded state, any world size.

    alpha-run --nproc 2 --store ./ckpt examples/train_fsdp2.py --steps 4
    alpha-run --nproc 3 --store ./ckpt --resume latest examples/train_fsdp2.py --steps 8   # resharded to 3

``get_state_dict`` gives the sharded model and AdamW state as DTensors; each rank writes only its
local shards (recorded as word ranges of the full tensors), and a restore on any rank count reads
the words its own shards hold. ``set_state_dict`` puts them back. Rank 0 prints one JSON line at
the end: the SHA-256 of the full state and the losses.
"""
import argparse
import hashlib
import json
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import alpha_ckpt


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
    parser.add_argument("--fail-at", type=int, default=None,
                        help="to see a recovery: the last rank kills itself after this step, in the first attempt")
    args = parser.parse_args()
    model, optim = build(init_device_mesh("cpu", (dist.get_world_size(),)))
    ckpt = alpha_ckpt.Checkpointer.from_launcher_env()  # store, run and the resume choice: from alpha-run

    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "progress": {"step": 0}}
    if ckpt.restore(state) is not None:  # None: a fresh start
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = state["progress"]["step"]

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
            ckpt.save({"model": msd, "optim": osd, "progress": {"step": step}}, update=step,
                      durable=step == args.steps)  # the last one to the store, also with the memory tier
        if step == args.fail_at and dist.get_rank() == dist.get_world_size() - 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    full_model, full_optim = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256()
    for t in list(full_model.values()) + [v for s in full_optim["state"].values() for v in s.values()]:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    if dist.get_rank() == 0:
        print(json.dumps({"state_sha256": digest.hexdigest(), "step": step, "losses": losses}), flush=True)
    ckpt.close()


if __name__ == "__main__":
    alpha_ckpt.run_resilient(main, backend="gloo")  # init_process_group, then main(); with --in-place, again after a peer dies
