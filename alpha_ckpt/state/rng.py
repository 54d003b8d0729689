"""RNGState: every random generator of this process, as one Stateful entry of a state."""
from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch


class RNGState:
    """Captures and restores Python's ``random``, NumPy's global generator, torch's CPU generator
    and every CUDA device's generator of this process.

    Put it in a state (``{"rng": alpha_ckpt.RNGState(), ...}``): a save records the
    generators as they are at that moment, a load sets them. Each process
    (rank) has its own generators; which rank restores which is the caller's
    placement. Restore it after building anything that draws at construction
    (data loaders, samplers), so that nothing draws after the restore.
    """

    def state_dict(self) -> dict[str, Any]:
        return {**cpu_generators_state(),
                "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else []}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_cpu_generators_state(state)
        if state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])


def cpu_generators_state() -> dict[str, Any]:
    """Python's ``random``, NumPy's global generator and torch's CPU generator, as they are now."""
    return {"python": random.getstate(), "numpy": np.random.get_state(legacy=False), "torch": torch.get_rng_state()}


def set_cpu_generators_state(state: Mapping[str, Any]) -> None:
    """Set the generators of :func:`cpu_generators_state` from what it returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])

