"""The device an owner computes on, read through NVML (nvidia-ml-py), for binding checkpoints.

A checkpoint records each owner's device product and UUID. A resume on a
different product is refused (`device-mismatch`); a different UUID is refused
only when the checkpoint was saved with placement binding on. On a CPU owner
the device is {"product": "cpu", "uuid": None} and NVML is not touched.
Tests replace NVML with a fake through :func:`set_nvml`.
"""
from __future__ import annotations

from typing import Any

import torch

from alpha_ckpt.errors import Refusal, RefusalCode

_nvml: Any = None


def set_nvml(module: Any) -> None:
    """Use ``module`` (pynvml's API: nvmlInit, nvmlDeviceGetHandleByUUID, nvmlDeviceGetName) instead of NVML."""
    global _nvml
    _nvml = module


def _nvml_module():
    global _nvml
    if _nvml is None:
        import pynvml  # nvidia-ml-py
        _nvml = pynvml
    return _nvml


def current_device(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"product": "cpu", "uuid": None}
    nvml = _nvml_module()
    nvml.nvmlInit()
    uuid = "GPU-" + str(torch.cuda.get_device_properties(device).uuid)
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode() if isinstance(uuid, str) else uuid)
    name = nvml.nvmlDeviceGetName(handle)
    return {"product": name.decode() if isinstance(name, bytes) else str(name), "uuid": uuid}


def check_devices(saved: list, current: list[dict], bind_placement: bool) -> None:
    """Refuse a resume on other device products (with placement binding: other devices).

    ``saved`` are the recorded devices that matter to the caller (a restoring
    owner passes those of the owners whose words it reads, and its own device
    as ``current``): their products must be exactly the current ones, since
    another product's kernels give other bits. A record that is not a device
    counts as unknown and is refused.
    """
    saved = [d if isinstance(d, dict) else {} for d in saved]
    saved_products = sorted({str(d.get("product")) for d in saved})
    current_products = sorted({str(d.get("product")) for d in current})
    if saved_products != current_products:
        raise Refusal(RefusalCode.DEVICE_MISMATCH, f"checkpoint was saved on {saved_products}, "
                      f"this job runs on {current_products}")
    if bind_placement and [d.get("uuid") for d in saved] != [d.get("uuid") for d in current]:
        raise Refusal(RefusalCode.DEVICE_MISMATCH, "checkpoint binds its placement to devices "
                      f"{[d.get('uuid') for d in saved]}, this job runs on {[d.get('uuid') for d in current]}")
