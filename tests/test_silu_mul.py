"""`silu_mul.silu_mul` (one Triton kernel) against `F.silu(gate) * up` on the w13 projection's halves.

- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): CPU tensors in float16 (the
  interpreter's float32 -> bfloat16 cast does not round to nearest; bf16 is checked on the GPU).
- CUDA (`gpu`): bf16, and `FeedForward.gated` taking the kernel eagerly.
The kernel rounds as torch does (SiLU to the dtype, then the product); only the exponential may differ in the
last float32 bit, so a value may land a step of the dtype away (2^-8 relative for bf16, twice that after the
product), almost every value equal.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from serving.engine import silu_mul
from serving.engine.model import ModelArgs
from serving.engine.models.llama import FeedForward

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and silu_mul.triton is not None
HAS_CUDA = torch.cuda.is_available() and silu_mul.triton is not None and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if silu_mul.triton is not None else "needs a CUDA GPU and the triton package"
SHAPES = ((3, 2 * 1500), (2, 4, 2 * 2048))  # the last: two BLOCKs a row; 1500: a masked tail


def torch_ops(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def check_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2.0**-6 + 1e-6).all()), float(diff.max())
    assert float((diff == 0).float().mean()) > 0.97


def make(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(sum(shape))
    return (3 * torch.randn(*shape, device=device)).to(dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_the_torch_ops_interpreted(shape: tuple[int, ...]) -> None:
    x = make(shape, "cpu", torch.float16)
    check_close(silu_mul.silu_mul(x, shape[-1] // 2), torch_ops(x))


@pytest.mark.interpreter
@pytest.mark.parametrize("inter", (1500, 2048, 2600))  # a masked tail; two BLOCKs; three with a tail
def test_rows_scaled_to_e4m3_equal_the_token_scaling_kernels_interpreted(inter: int) -> None:
    """`silu_mul_e4m3`: `silu_mul`'s values, carrying its rows scaled to e4m3 as the FP8 GEMM's own scaling
    kernel (`fp8_tokens.tokens_e4m3`) scales them."""
    from serving.engine import fp8_tokens
    from serving.engine.prescaled import E4M3_MAX, prescaled_rows

    x = make((5, 2 * inter), "cpu", torch.float16)
    out = silu_mul.silu_mul_e4m3(x, inter)
    assert torch.equal(out, silu_mul.silu_mul(x, inter))
    q, scale = prescaled_rows(out, 5)
    want_q, want_scale = fp8_tokens.tokens_e4m3(out, E4M3_MAX)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_fits_only_cuda_half_precision() -> None:
    assert not silu_mul.fits(torch.ones(2, 8, dtype=torch.bfloat16)), "CPU tensors take the torch ops"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("shape", (*SHAPES, (8192, 2 * 14336)))
def test_kernel_matches_the_torch_ops_on_the_gpu(shape: tuple[int, ...]) -> None:
    x = make(shape, "cuda", torch.bfloat16)
    check_close(silu_mul.silu_mul(x, shape[-1] // 2), torch_ops(x))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_feed_forward_takes_the_kernel_eagerly() -> None:
    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=64, dim=256, n_layers=1, n_heads=4, n_kv_heads=4,
                     head_dim=64, intermediate_size=512, norm_eps=1e-5, max_position_embeddings=64)
    ff = FeedForward(args).to("cuda", torch.bfloat16)
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(silu_mul, "silu_mul", wraps=silu_mul.silu_mul) as kernel:
        out = ff.gated(x)
    assert kernel.called
    check_close(out, torch_ops(F.linear(x, ff.w13.weight)))
