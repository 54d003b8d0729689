"""Device binding: NVML product and UUID, checked against a fake NVML on CPU machines."""
import types

import pytest
import torch

from alpha_ckpt import Refusal, RefusalCode

from alpha_ckpt.state import device


class FakeNvml:
    def __init__(self, names):
        self.names = names
        self.initialized = False

    def nvmlInit(self):
        self.initialized = True

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return uuid.decode() if isinstance(uuid, bytes) else uuid

    def nvmlDeviceGetName(self, handle):
        return self.names[handle]


def test_the_product_and_uuid_come_from_nvml(monkeypatch):
    fake = FakeNvml({"GPU-1234": b"NVIDIA H200"})
    device.set_nvml(fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="1234"))
    try:
        assert device.current_device(torch.device("cuda", 0)) == {"product": "NVIDIA H200", "uuid": "GPU-1234"}
        assert fake.initialized
    finally:
        device.set_nvml(None)


def test_cpu_owners_do_not_touch_nvml():
    device.set_nvml(object())  # any NVML call would fail
    try:
        assert device.current_device(torch.device("cpu")) == {"product": "cpu", "uuid": None}
    finally:
        device.set_nvml(None)


def test_another_product_is_a_device_mismatch():
    saved = [{"product": "NVIDIA H200", "uuid": "GPU-a"}]
    with pytest.raises(Refusal) as info:
        device.check_devices(saved, [{"product": "NVIDIA A100", "uuid": "GPU-b"}], bind_placement=False)
    assert info.value.code == RefusalCode.DEVICE_MISMATCH


def test_another_uuid_is_refused_only_with_placement_binding():
    saved = [{"product": "NVIDIA H200", "uuid": "GPU-a"}]
    moved = [{"product": "NVIDIA H200", "uuid": "GPU-b"}]
    device.check_devices(saved, moved, bind_placement=False)
    with pytest.raises(Refusal) as info:
        device.check_devices(saved, moved, bind_placement=True)
    assert info.value.code == RefusalCode.DEVICE_MISMATCH
