"""A small GPT-style training setup, as users write it: the real client the state tests train with.

Causal self-attention with a ``-inf`` mask buffer, dropout, LayerNorm, AdamW with
two param groups (decay / no decay), a warmup LambdaLR chained with MultiStepLR,
a OneCycleLR on a second (SGD) optimizer, a shuffling StatefulDataLoader, and
augmentation that draws from Python's and NumPy's global generators.
"""
from __future__ import annotations

import math
import random
import struct

import numpy as np
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 32, 16, 32, 4, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.1))
        self.drop = nn.Dropout(0.1)
        # Kept as many GPT implementations keep it: -inf above the diagonal.
        self.register_buffer("causal_mask", torch.triu(torch.full((CONTEXT, CONTEXT), float("-inf")), diagonal=1))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(WIDTH // HEADS) + self.causal_mask[:t, :t]
        y = (self.drop(att.softmax(-1)) @ v).transpose(1, 2).reshape(b, t, WIDTH)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos[: idx.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Tokens(torch.utils.data.Dataset):
    """Fixed sequences; augmentation swaps a token using Python's and NumPy's global generators."""

    def __init__(self, n: int = 24):
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        seq = self.data[i].clone()
        seq[random.randrange(CONTEXT)] = int(np.random.randint(VOCAB))
        return seq


def optimizer_step(model: nn.Module, optim: torch.optim.Optimizer, seq: torch.Tensor) -> float:
    """One next-token step on a batch of sequences; the loss."""
    logits = model(seq[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.item()


class Batches:
    """Endless batches from a StatefulDataLoader; Stateful, so a state may hold the data position.

    Making an iterator draws a seed from torch's global generator, so the load
    makes it at once: with this entry placed before the RNG state, the restored
    generator is never drawn from by the resume itself.
    """

    def __init__(self, loader: StatefulDataLoader):
        self.loader, self._it = loader, None

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._it = iter(self.loader)


class Trainer:
    """Everything a training script holds between steps."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = GPT()
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                        {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
        self.warmup = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: min(1.0, (s + 1) / 4))
        self.steps = torch.optim.lr_scheduler.MultiStepLR(self.optim, milestones=[2, 5], gamma=0.5)
        self.side = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
        self.cycle = torch.optim.lr_scheduler.OneCycleLR(self.side, max_lr=0.5, total_steps=20)
        self.loader = StatefulDataLoader(Tokens(), batch_size=4, shuffle=True)
        self.data = Batches(self.loader)
        self.step = 0
        self.losses: list[float] = []

    def train(self, n: int) -> None:
        self.model.train()
        for _ in range(n):
            loss = optimizer_step(self.model, self.optim, next(self.data))
            self.warmup.step()
            self.steps.step()
            self.side.param_groups[0]["params"][0].grad = torch.ones(3)
            self.side.step()
            self.cycle.step()
            self.step += 1
            self.losses.append(loss)


def assert_identical(a, b, where: str = "state") -> None:
    """Equal values of the same types: tensors bit for bit, floats by their bits (NaN, -0.0)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}.{i}")
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
