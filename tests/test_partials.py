"""`serving.engine.partials.sum_partials`: split-K partial products summed in split order and rounded once.
Pointwise adds on the CPU and when traced; one Triton kernel when eager on CUDA, checked bit-equal to the adds
under TRITON_INTERPRET=1 (CPU tensors, so in CI only where the interpreter runs) and on the GPU (`gpu`)."""

from __future__ import annotations

import os

import pytest
import torch

from serving.engine.partials import one_kernel_fits, sum_partials, sum_partials_triton, triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton is not None
HAS_CUDA = torch.cuda.is_available() and triton is not None
CUDA_MISSING = "needs a CUDA GPU" if triton is not None else "needs a CUDA GPU and the triton package"


def _adds(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out.to(dtype)


def _parts(split: int, rows: int, n: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(split * 1000 + rows)
    return (torch.randn(split, rows, n, generator=gen) * torch.logspace(-3, 3, n)).to(device)


def test_on_the_cpu_it_is_the_adds_in_split_order_rounded_once():
    parts = _parts(4, 3, 257)
    assert not one_kernel_fits(parts)
    got = sum_partials(parts, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _adds(parts, torch.bfloat16))
    assert torch.equal(sum_partials(parts[:1], torch.bfloat16), parts[0].to(torch.bfloat16))


@pytest.mark.interpreter
@pytest.mark.parametrize(("split", "rows", "n"), [(2, 1, 4096), (3, 5, 300), (8, 1, 1030)])
def test_the_kernel_gives_the_adds_to_the_bit(split, rows, n):
    parts = _parts(split, rows, n)
    for dtype in (torch.float16, torch.float32):
        assert torch.equal(sum_partials_triton(parts, dtype), _adds(parts, dtype)), (split, rows, n, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_eager_on_cuda_it_is_one_kernel_with_the_adds_values_and_traced_it_is_the_adds():
    parts = _parts(8, 1, 4096, "cuda")  # Llama-3.1-8B wo at one row: split 8
    assert one_kernel_fits(parts)
    want = _adds(parts, torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = sum_partials(parts, torch.bfloat16)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert torch.equal(got, want) and len(kernels) == 1, kernels
    compiled = torch.compile(lambda p: sum_partials(p, torch.bfloat16), fullgraph=True)
    assert torch.equal(compiled(parts), want)
