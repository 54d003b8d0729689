"""The GPT of gpt_training.py under FSDP2 (fully_shard per block and at the root) with AdamW, for sharded-state tests."""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from gpt_training import GPT, optimizer_step


def fsdp2_gpt(world: int, fsdp: bool = True):
    """The model (sharded over ``world`` ranks when ``fsdp`` and world > 1) and AdamW with two param groups."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = GPT()
    if fsdp and world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = list(model.named_parameters())
    optim = torch.optim.AdamW([{"params": [p for n, p in params if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for n, p in params if p.dim() < 2], "weight_decay": 0.0}], lr=3e-3)
    return model, optim


def train(model, optim, steps: int, first: int) -> list[float]:
    """Steps first .. first + steps - 1 on fixed batches; dropout keyed by the step (the same on every rank)."""
    data = torch.randint(0, 32, (64, 17), generator=torch.Generator().manual_seed(7))
    losses = []
    for s in range(first, first + steps):
        torch.manual_seed(1000 + s)
        losses.append(optimizer_step(model, optim, data[4 * (s % 16):4 * (s % 16) + 4]))
    return losses


def full_state(model, optim) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor at full size (gathered), cloned, by dotted name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v for k, v in msd.items()}
    for pid, st in osd["state"].items():
        flat.update({f"optim.{pid}.{k}": v for k, v in st.items()})
    return {k: v.detach().clone() for k, v in flat.items()}  # "step" is the optimizer's live tensor


def differing(full: dict, want: dict) -> list[str]:
    return sorted(set(full) ^ set(want)) + [k for k in full if k in want and not torch.equal(full[k], want[k])]
