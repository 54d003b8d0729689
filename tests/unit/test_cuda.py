"""CUDA tensors save and load bit-exactly (runs only where CUDA is present)."""
import pytest
import torch

import alpha_ckpt
from alpha_ckpt import Refusal, RefusalCode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool]


def _tensor(dtype, shape, device):
    g = torch.Generator(device=device).manual_seed(11)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g, device=device) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, device=device) * 10).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_state_round_trips_into_cuda_and_cpu_tensors(tmp_path, dtype):
    base = _tensor(dtype, (64, 48), "cuda")
    state = {"dense": base, "strided": base[:, ::3], "transposed": base.t(), "scalar": base[3, 4].clone(),
             "empty": base[:0]}
    root = alpha_ckpt.save(state, store=tmp_path, run="gpu", step="fit", update=1, cursor=2, epoch=0)
    on_gpu = {k: torch.zeros_like(v) for k, v in state.items()}
    on_gpu["transposed"] = torch.zeros(64, 48, dtype=dtype, device="cuda").t()
    alpha_ckpt.restore(on_gpu, store=tmp_path, root=root)
    on_cpu = {k: torch.zeros(v.shape, dtype=dtype) for k, v in state.items()}
    alpha_ckpt.restore(on_cpu, store=tmp_path, root=root)
    for k, v in state.items():
        assert on_gpu[k].device.type == "cuda"
        assert torch.equal(on_gpu[k], v), k
        assert torch.equal(on_cpu[k], v.cpu()), k


def test_nan_on_the_gpu_is_refused_and_the_gpu_destination_untouched(tmp_path):
    state = {"w": torch.ones(1000, device="cuda")}
    state["w"][777] = float("nan")
    root = alpha_ckpt.save(state, store=tmp_path, run="gpu", step="fit", update=1, cursor=2, epoch=0)
    dest = {"w": torch.full((1000,), 5.0, device="cuda")}
    with pytest.raises(Refusal) as info:
        alpha_ckpt.restore(dest, store=tmp_path, root=root)
    assert info.value.code == RefusalCode.NON_FINITE and "word 777" in info.value.message
    assert torch.equal(dest["w"], torch.full((1000,), 5.0, device="cuda"))
