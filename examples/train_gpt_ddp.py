"""A small GPT-style model trained with DDP, checkpointed with alpha_ckpt.Checkpointer.

    alpha-run --nproc 2 --store ./ckpt examples/train_gpt_ddp.py --steps 12
    alpha-run --nproc 2 --store ./ckpt --resume latest examples/train_gpt_ddp.py --steps 12   # after a crash
    alpha-run --nproc 2 --store ./ckpt --memory --max-restarts 2 examples/train_gpt_ddp.py --steps 12 --fail-at 7

Dropout, AdamW with two param groups, a warmup LambdaLR, a DataLoader over a
DistributedSampler, and augmentation that draws from each rank's Python,
NumPy and torch generators. Resumed, it ends bit-identical to a run that never
stopped. Rank 0 prints one JSON line at the end: the state's SHA-256 and the losses.
"""
import argparse
import hashlib
import json
import math
import os
import random
import signal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import alpha_ckpt

VOCAB, CONTEXT, WIDTH = 32, 16, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))
        self.register_buffer("mask", torch.triu(torch.full((CONTEXT, CONTEXT), -math.inf), diagonal=1))

    def forward(self, x):
        t = x.shape[1]
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        self.blocks, self.ln = nn.Sequential(Block(), Block()), nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]])))


class Tokens(Dataset):
    def __init__(self, n=64):
        self.data = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=torch.Generator().manual_seed(1234))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        seq = self.data[i].clone()
        seq[random.randrange(CONTEXT)] = int(np.random.randint(VOCAB))  # augmentation: this rank's generators
        return seq


class DataPosition:
    """This rank's place in its share of the data (epoch, batches taken): a Stateful for the checkpoint.

    Making a DataLoader iterator draws a seed from torch's generator, so a load makes
    it at once: placed before the RNG state, the restored generators are not drawn from.
    """

    def __init__(self, dataset, rank, world, batch):
        self.dataset, self.batch = dataset, batch
        self.sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=0)
        self.epoch, self.index, self._it = 0, 0, None

    def _start(self):
        self.sampler.set_epoch(self.epoch)
        order = list(self.sampler)[self.index * self.batch:]
        self._it = iter(DataLoader(self.dataset, batch_size=self.batch, sampler=order))

    def __next__(self):
        if self._it is None:
            self._start()
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.index = self.epoch + 1, 0
            self._start()
            batch = next(self._it)
        self.index += 1
        return batch

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index = state["epoch"], state["index"]
        self._start()


def build():
    """What needs no rank: the model, AdamW and the scheduler (on the CPU). Under alpha-run --in-place a
    waiting spare builds them before any rank fails; a rank that keeps its process keeps them."""
    torch.manual_seed(0)
    module = GPT()
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
    return module, optim, sched


def main(prepared):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--fail-at", type=int, default=None,
                        help="to see a recovery: the last rank kills itself after this step, in the first attempt")
    args = parser.parse_args()
    rank, world = dist.get_rank(), dist.get_world_size()

    module, optim, sched = prepared
    # find_unused_parameters=True keeps DDP's gradient buckets in one layout for the whole run: by
    # default DDP re-lays them out after its first iteration, and on 3 or more ranks the sums then
    # round differently in a restarted process's first step (a layout no state_dict records).
    model = DistributedDataParallel(module, find_unused_parameters=True)
    data = DataPosition(Tokens(), rank, world, batch=4)
    torch.manual_seed(100 + rank), random.seed(100 + rank), np.random.seed(100 + rank)
    progress = {"step": 0, "losses": []}

    # --- checkpointing: these lines are all it takes
    ckpt = alpha_ckpt.Checkpointer.from_launcher_env(identity={"model": "gpt-tiny", "lr": 3e-3}, allow_nonfinite=["*.mask"])
    state = {"model": model, "optim": optim, "sched": sched, "data": alpha_ckpt.PerRank(data),
             "rng": alpha_ckpt.PerRank(alpha_ckpt.RNGState()), "progress": alpha_ckpt.PerRank(progress)}
    ckpt.restore(state)
    # ---

    while progress["step"] < args.steps:
        seq = next(data)
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        progress["step"] += 1
        progress["losses"].append(loss.item())
        if progress["step"] % args.save_every == 0 or progress["step"] == args.steps:
            # --- and this one (the last save goes to the store even with the memory tier: it is host memory)
            ckpt.save(state, update=progress["step"], cursor=progress["step"] * 4 * world,
                      durable=progress["step"] == args.steps)
        if progress["step"] == args.fail_at and rank == world - 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                                     "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    digest = hashlib.sha256()
    for t in list(model.state_dict().values()) + [v for s in optim.state_dict()["state"].values() for v in s.values()]:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps([sched.state_dict(), optim.state_dict()["param_groups"]], sort_keys=True,
                             default=str).encode())  # every non-tensor value too
    if rank == 0:
        print(json.dumps({"state_sha256": digest.hexdigest(), "step": progress["step"],
                          "losses": progress["losses"]}), flush=True)
    ckpt.close()


if __name__ == "__main__":
    # build() once per process, init_process_group, then main(build()); with --in-place, main() again after a peer dies
    alpha_ckpt.run_resilient(main, backend="gloo", prepare=build)
