"""The states tests/stores/make_format1.py saved, rebuilt bit for bit from seeds (and blank ones to restore into)."""
import blake3
import numpy as np
import torch

import alpha_ckpt


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched


def state(blank: bool = False) -> dict:
    """What the one-process save wrote; ``blank=True``: the same shapes, other values, to restore into."""
    model, optim, sched = _model_and_optimizer(1 if blank else 0)
    if not blank:
        for _ in range(3):  # AdamW state (exp_avg, step) and a scheduler past its first step
            model(torch.randn(4, 6)).square().mean().backward()
            optim.step()
            optim.zero_grad()
            sched.step()
    g = torch.Generator().manual_seed(2 if blank else 3)
    fill = (lambda t: t.zero_()) if blank else (lambda t: t)
    torch.manual_seed(11 if blank else 10)
    return {
        "model": model, "optim": optim, "sched": sched, "rng": alpha_ckpt.RNGState(),
        "f32": fill(torch.randn(17, generator=g)), "f16": fill(torch.randn(3, 4, generator=g).half()),
        "bf16": fill(torch.randn(5, generator=g).bfloat16()), "i64": fill(torch.arange(-4, 5) * 7),
        "bools": fill(torch.tensor([True, False, True])), "empty": torch.zeros(0, 3),
        "array": np.zeros(6, np.float64) if blank else np.linspace(-1, 1, 6),
        "values": {"step": 0 if blank else 12, "lr": 0.0 if blank else 0.1, "name": "" if blank else "run-ö",
                   "raw": b"" if blank else b"\x00\xffbytes", "none": None, "flag": not blank,
                   "pair": (0, 0) if blank else (1, "two"), "nested": [] if blank else [1.5, [2, {"k": 3}]]},
    }


def dcp_state(blank: bool = False) -> dict:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 3, generator=g)
    return {"w": torch.zeros_like(w) if blank else w, "b": torch.zeros(3) if blank else torch.full((3,), 0.25),
            "step": torch.tensor(0 if blank else 9)}


def bits(value):
    """A value reduced to what restore must reproduce exactly: tensors and arrays as dtype, shape and bytes."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                if value.numel() else b"")
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, dict):
        return {k: bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [bits(v) for v in value])
    if isinstance(value, float):
        return ("float", value.hex())
    if hasattr(value, "state_dict") and not isinstance(value, alpha_ckpt.RNGState):
        return bits(value.state_dict())
    return (type(value).__name__, value)


def bits_digest(state: dict) -> str:
    """The digest of a state's exact values (its generators aside): what expected.json records as "bits"."""
    return blake3.blake3(repr(bits({k: v for k, v in state.items() if k != "rng"})).encode()).hexdigest()
