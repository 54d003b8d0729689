"""The forecasting model, its optimizers and the declared combine order.

Bit-determinism rules followed here:
- compute runs with one intra-op thread and deterministic algorithms, so a
  share of the same size gives the same bits in any process;
- gradients of the shares are combined by us, in owner order 0, 1, ..., n-1
  (never by a backend all_reduce, whose order the backend picks);
- optimizer updates use only single-rounding elementwise ops (mul, add, sub,
  div, sqrt; no fused addcmul/lerp/alpha=), so updating a word range gives the
  same bits as updating the whole region (partitioned == replicated).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from alpha_ckpt.job.learner.config import JobConfig
from alpha_ckpt.job.learner.data import batch, keyed_generator, sequence_indices

COMBINE_ORDER = "owner-sequential-v1"  # partial sums added in owner order 0..n-1
PARAMS = ("w1", "b1", "w2", "b2")


def configure_determinism() -> None:
    """One intra-op thread, deterministic kernels; on CUDA also deterministic cuBLAS and no TF32."""
    # cuBLAS is only deterministic with a fixed workspace; it must be set before the first CUDA matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def param_shapes(config: JobConfig) -> dict[str, tuple[int, ...]]:
    h = config.hidden
    return {"w1": (h, config.history_days), "b1": (h,), "w2": (config.horizon_days, h), "b2": (config.horizon_days,)}


def initial_params(config: JobConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in param_shapes(config).items():
        fan_in = shape[-1] if len(shape) > 1 else 1
        g = keyed_generator("init", config.seed, name)
        scale = (1.0 / fan_in) ** 0.5 if len(shape) > 1 else 0.0
        out[name] = (torch.randn(shape, generator=g) * scale).to(torch.float32)
    return out


def optimizer_state_names(config: JobConfig) -> tuple[str, ...]:
    return {"sgd": (), "momentum": ("momentum",), "adam": ("exp_avg", "exp_avg_sq")}[config.optimizer]


@dataclass
class LearnerState:
    """The whole learner state as tensors, plus the counters of the capture prefix."""

    params: dict[str, torch.Tensor]
    slots: dict[str, dict[str, torch.Tensor]]  # optimizer state per kind, per parameter
    scalars: dict[str, torch.Tensor]           # optimizer scalars (step, bias-correction powers)
    metrics: dict[str, torch.Tensor]           # running loss sum (float64) and sample count
    frozen: dict[str, torch.Tensor]            # never trained (the embedding table), still checkpointed
    update: int = 0
    cursor: int = 0

    @classmethod
    def initial(cls, config: JobConfig, device: torch.device | str = "cpu") -> "LearnerState":
        """The initial state, drawn on the CPU (so every device starts from the same bits), placed on ``device``."""
        params = {n: p.to(device) for n, p in initial_params(config).items()}
        slots = {kind: {n: torch.zeros_like(p) for n, p in params.items()} for kind in optimizer_state_names(config)}
        scalars = {}
        if config.optimizer == "adam":
            scalars = {"step": torch.zeros((), dtype=torch.int64, device=device),
                       "beta1_power": torch.ones((), dtype=torch.float32, device=device),
                       "beta2_power": torch.ones((), dtype=torch.float32, device=device)}
        metrics = {"loss_sum": torch.zeros((), dtype=torch.float64, device=device),
                   "samples": torch.zeros((), dtype=torch.int64, device=device)}
        frozen = {}
        if config.embedding_rows:
            g = keyed_generator("init", config.seed, "embedding")
            table = torch.randn((config.embedding_rows, config.history_days), generator=g) * 0.1
            frozen["embedding"] = table.to(torch.float32).to(device)
        return cls(params, slots, scalars, metrics, frozen)

    def tensors(self) -> dict:
        """The checkpointed state dict (nested; counters travel in the capture prefix)."""
        out = {"model": self.params, "optim": {**self.slots, **({"scalars": self.scalars} if self.scalars else {})},
               "metrics": self.metrics}
        if self.frozen:
            out["frozen"] = self.frozen
        return out


def share_gradient(config: JobConfig, params: dict[str, torch.Tensor], start: int, stop: int,
                   frozen: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Gradient of the summed squared error over input positions [start, stop), and that sum (float64)."""
    device = next(iter(params.values())).device
    x, y = (t.to(device) for t in batch(config, start, stop))  # samples are drawn on the CPU, keyed
    if frozen and stop > start:
        rows = torch.tensor(sequence_indices(config, start, stop), dtype=torch.int64) % config.embedding_rows
        x = x + frozen["embedding"].index_select(0, rows.to(device))
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    h = torch.relu(x @ leaves["w1"].t() + leaves["b1"])
    err = h @ leaves["w2"].t() + leaves["b2"] - y
    loss = (err * err).sum()
    if stop > start:
        loss.backward()
    grads = {n: (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).detach() for n, leaf in leaves.items()}
    return grads, loss.detach().double()


def combine(partials: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Sum per-owner partial gradients in owner order (the declared combine order)."""
    return {n: sum_in_owner_order([part[n] for part in partials]) for n in partials[0]}


def sum_in_owner_order(values: list[torch.Tensor]) -> torch.Tensor:
    """((v0 + v1) + v2) + ...: the one summation order every placement and the oracle use."""
    total = values[0].clone()
    for value in values[1:]:
        total = total + value
    return total


def apply_update(config: JobConfig, state: LearnerState, grad_sum: dict[str, torch.Tensor], loss_sum: torch.Tensor,
                 ranges: dict[str, tuple[int, int]] | None = None) -> None:
    """One optimizer step on the mean gradient, on word ranges ``ranges`` of each region (default: all)."""
    lr = torch.tensor(config.lr, dtype=torch.float32)
    inv_batch = torch.tensor(1.0 / config.batch, dtype=torch.float32)
    if config.optimizer == "adam":
        s = state.scalars
        s["step"] += 1
        s["beta1_power"].copy_(s["beta1_power"] * config.beta1)
        s["beta2_power"].copy_(s["beta2_power"] * config.beta2)
        correction1 = 1.0 - s["beta1_power"]
        correction2 = 1.0 - s["beta2_power"]
    for name, p in state.params.items():
        lo, hi = ranges[name] if ranges else (0, p.numel())
        flat = p.view(-1)[lo:hi]
        g = grad_sum[name].reshape(-1)[lo:hi] * inv_batch
        if config.optimizer == "sgd":
            flat.copy_(flat - g * lr)
        elif config.optimizer == "momentum":
            buf = state.slots["momentum"][name].view(-1)[lo:hi]
            buf.copy_(buf * config.momentum + g)
            flat.copy_(flat - buf * lr)
        else:
            m = state.slots["exp_avg"][name].view(-1)[lo:hi]
            v = state.slots["exp_avg_sq"][name].view(-1)[lo:hi]
            m.copy_(m * config.beta1 + g * (1.0 - config.beta1))
            v.copy_(v * config.beta2 + (g * g) * (1.0 - config.beta2))
            step = (m / correction1) / (torch.sqrt(v / correction2) + config.eps)
            flat.copy_(flat - step * lr)
    state.metrics["loss_sum"] += loss_sum
    state.metrics["samples"] += config.batch
    state.update += 1
    state.cursor += config.batch
