"""A small ResNet-style CNN with BatchNorm trained with DDP, checkpointed with alpha_ckpt.Checkpointer.

    alpha-run --nproc 2 --store ./ckpt examples/train_resnet_bn_ddp.py --steps 20
    alpha-run --nproc 2 --store ./ckpt --resume latest examples/train_resnet_bn_ddp.py --steps 20   # after a crash

BatchNorm's running statistics differ per rank under DDP (each rank updates them from its own
batches), and so do those of an EMA copy of the model that averages buffers: they are stored per
rank by name (``per_rank=`` patterns), while every parameter, the optimizer and the scheduler stay
replicated and reshardable. A StatefulDataLoader with its default generator over a
DistributedSampler, AdamW, a cosine schedule, and augmentation that draws from each rank's
generators. Resumed, it ends bit-identical to a run that never stopped. Rank 0 prints one JSON
line at the end: every rank's SHA-256 of its tensors and values, and every rank's losses.
"""
import argparse
import hashlib
import json
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import alpha_ckpt

CLASSES, WIDTH = 4, 8


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, WIDTH, 3, padding=1, bias=False), nn.BatchNorm2d(WIDTH), nn.ReLU())
        self.blocks = nn.Sequential(Block(WIDTH), Block(WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class Images(Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1234)
        self.x, self.y = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if torch.rand(()) < 0.5:  # augmentation: this rank's torch, NumPy and Python generators
            x = x.flip(-1)
        return x + 0.05 * float(np.random.randn()) * random.random(), self.y[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = DistributedDataParallel(ResNet())
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    dataset = Images()
    sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler)  # its default generator
    torch.manual_seed(100 + rank), random.seed(100 + rank), np.random.seed(100 + rank)
    progress = {"step": 0, "epoch": 0, "losses": []}

    # --- checkpointing: BatchNorm statistics and this rank's own entries are stored per rank, by name
    ckpt = alpha_ckpt.Checkpointer.from_launcher_env(identity={"model": "resnet-bn-tiny"}, per_rank=[
        "*.running_mean", "*.running_var", "*.num_batches_tracked", "data", "rng", "progress"])
    state = {"model": model, "ema": ema, "optim": optim, "sched": sched, "data": loader,
             "rng": alpha_ckpt.RNGState(), "progress": progress}
    ckpt.restore(state)
    # ---

    while progress["step"] < args.steps:
        sampler.set_epoch(progress["epoch"])
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            ema.update_parameters(model.module)
            progress["step"] += 1
            progress["losses"].append(loss.item())
            if progress["step"] % args.save_every == 0 or progress["step"] == args.steps:
                ckpt.save(state, update=progress["step"], cursor=progress["step"] * 4 * world)  # --- and this one
            if progress["step"] == args.steps:
                break
        else:
            progress["epoch"] += 1

    digest = hashlib.sha256()
    tensors = list(model.state_dict().values()) + list(ema.state_dict().values()) + \
        [v for s in optim.state_dict()["state"].values() for v in s.values()]
    for t in tensors:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps([sched.state_dict(), optim.state_dict()["param_groups"], progress,
                              loader.state_dict()], sort_keys=True, default=str).encode())
    mine = torch.tensor(list(digest.digest()), dtype=torch.uint8)
    digests = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(digests, mine)
    losses = torch.tensor(progress["losses"], dtype=torch.float64)
    every_loss = [torch.empty_like(losses) for _ in range(world)]
    dist.all_gather(every_loss, losses)
    if rank == 0:
        print(json.dumps({"state_sha256": [bytes(d.tolist()).hex() for d in digests], "step": progress["step"],
                          "losses": [t.tolist() for t in every_loss]}), flush=True)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
