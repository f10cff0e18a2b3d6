"""`row_norm.rms_norm` (one Triton kernel) against `model.RMSNorm`'s torch ops.

- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the kernel on CPU tensors, in
  float16 (exactly equal there; the interpreter's float32 -> bfloat16 cast does not round to nearest, so bf16
  is checked on the GPU).
- CUDA (`gpu`): the module itself on the GPU, which dispatches eager calls to the kernel, against its torch
  ops (forced through `torch.compiler.is_compiling`).
The kernel rounds as the module does (to the dtype, then times the weight, rounded again); only the sum's
order and the rsqrt differ, so a value may land a step of the dtype away: a bf16 step is 2^-8 relative to the
value, twice that after the weight), almost every value equal.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from serving.engine import row_norm
from serving.engine.model import RMSNorm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and row_norm.triton is not None
HAS_CUDA = torch.cuda.is_available() and row_norm.triton is not None and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if row_norm.triton is not None else "needs a CUDA GPU and the triton package"
SHAPES = ((3, 4096), (2, 5, 2048), (4, 3000))  # rows x hidden (a non-power of two masks the row's tail)


def torch_ops(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        return norm(x)


def check_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2.0**-6 + 1e-6).all()), float(diff.max())
    assert float((diff == 0).float().mean()) > 0.97


def make(shape: tuple[int, ...], device: str, dtype: torch.dtype = torch.bfloat16) -> tuple[RMSNorm, torch.Tensor]:
    torch.manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps=1e-5).to(device=device, dtype=dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    return norm, (3 * torch.randn(*shape, device=device)).to(dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pdl", (False, True))
def test_kernel_matches_the_modules_torch_ops_interpreted(shape: tuple[int, ...], pdl: bool) -> None:
    norm, x = make(shape, "cpu", torch.float16)
    check_close(row_norm.rms_norm(x, norm.weight, norm.eps, pdl=pdl), torch_ops(norm, x))


def test_fits_only_half_precision_rows_of_the_weights_dtype() -> None:
    w = torch.ones(64, dtype=torch.bfloat16)
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    fits = row_norm.triton is not None
    assert row_norm.fits(x, w) is fits
    assert not row_norm.fits(x.float(), w.float()) and not row_norm.fits(x, w.half())
    assert not row_norm.fits(torch.ones(2, 64, 2, dtype=torch.bfloat16)[..., 0], w)  # strided columns
    assert not row_norm.fits(torch.ones(1, row_norm.MAX_COLUMNS * 2, dtype=torch.bfloat16),
                             torch.ones(row_norm.MAX_COLUMNS * 2, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("shape", (*SHAPES, (8192, 4096)))
def test_module_on_the_gpu_runs_the_kernel_with_its_own_numerics(shape: tuple[int, ...]) -> None:
    norm, x = make(shape, "cuda")
    with mock.patch.object(row_norm, "rms_norm", wraps=row_norm.rms_norm) as kernel:
        out = norm(x)
    assert kernel.called, "the eager GPU call went through the kernel"
    check_close(out, torch_ops(norm, x))


def _add_case(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> tuple[RMSNorm, torch.Tensor, torch.Tensor]:
    norm, x = make(shape, device, dtype)
    delta = (2 * torch.randn(*shape, device=device)).to(dtype)
    return norm, x, delta


def test_add_on_the_cpu_is_the_add_then_the_norm() -> None:
    norm, x, delta = _add_case((3, 64), "cpu", torch.float32)
    total, out = norm.add(x, delta)
    assert torch.equal(total, x + delta) and torch.equal(out, norm(x + delta))


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pdl", (False, True))
def test_add_kernel_rounds_the_sum_as_torch_and_norms_it_interpreted(shape: tuple[int, ...], pdl: bool) -> None:
    norm, x, delta = _add_case(shape, "cpu", torch.float16)
    total, out = row_norm.add_rms_norm(x, delta, norm.weight, norm.eps, pdl=pdl)
    assert torch.equal(total, x + delta), "the residual sum, rounded once as torch's add"
    check_close(out, torch_ops(norm, x + delta))


def test_add_fits_only_two_rows_of_one_shape() -> None:
    w = torch.ones(64, dtype=torch.bfloat16)
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    assert row_norm.add_fits(x, x, w) is (row_norm.triton is not None)
    assert not row_norm.add_fits(x, torch.ones(1, 64, dtype=torch.bfloat16), w)
    assert not row_norm.add_fits(x, x.float(), w)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("shape", (*SHAPES, (8192, 4096)))
def test_module_add_on_the_gpu_runs_the_fused_kernel(shape: tuple[int, ...]) -> None:
    norm, x, delta = _add_case(shape, "cuda", torch.bfloat16)
    with mock.patch.object(row_norm, "add_rms_norm", wraps=row_norm.add_rms_norm) as kernel:
        total, out = norm.add(x, delta)
    assert kernel.called, "the eager GPU call went through the fused kernel"
    assert torch.equal(total, x + delta)
    check_close(out, torch_ops(norm, x + delta))


@pytest.mark.interpreter
@pytest.mark.parametrize("add", (False, True))
def test_rows_scaled_to_e4m3_in_the_norm_equal_the_token_scaling_kernels_interpreted(add: bool) -> None:
    """`e4m3=True`: the output carries its rows scaled to e4m3 and their scales, equal to what the FP8 GEMM's
    own scaling kernel (`fp8_tokens.tokens_e4m3`) makes of the output; the output itself unchanged."""
    from serving.engine import fp8_tokens
    from serving.engine.prescaled import E4M3_MAX, prescaled_rows

    norm, x, delta = _add_case((6, 96), "cpu", torch.float16)
    if add:
        plain = row_norm.add_rms_norm(x, delta, norm.weight, norm.eps)[1]
        out = row_norm.add_rms_norm(x, delta, norm.weight, norm.eps, e4m3=True)[1]
    else:
        plain, out = (row_norm.rms_norm(x, norm.weight, norm.eps, e4m3=e4m3) for e4m3 in (False, True))
    assert torch.equal(out, plain) and prescaled_rows(plain, 6) is None
    q, scale = prescaled_rows(out, 6)
    want_q, want_scale = fp8_tokens.tokens_e4m3(out, E4M3_MAX)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
