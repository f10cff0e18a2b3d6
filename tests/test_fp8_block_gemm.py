"""The block-scaled FP8 GEMM of block-wise FP8 checkpoints (`serving.engine.fp8_block_gemm`) and its layer
(`linear_fp8_block.Fp8BlockLinear`).

- CPU, every run: the tokens' per-group e4m3 scaling, the emulation against the block-dequantized weight, the
  layer's reference path and the route it picks off CUDA.
- TRITON_INTERPRET=1 (`make test-kernels`): the kernel on CPU tensors against the emulation (the same e4m3 inputs),
  rows across a tile, N and K not multiples of the tile or the block, blocks of 128 and 32.
- CUDA (`gpu`): the kernel at Qwen3-8B's projection shapes against the emulation, and a layer's route:
  `python -m pytest -m gpu tests/test_fp8_block_gemm.py`.

Errors are relative, ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import os

import pytest
import torch

from serving.engine.fp8_block_gemm import (
    block_fp8_emulated_linear,
    block_fp8_linear,
    fits,
    tokens_e4m3_groups,
)
from serving.engine.fp8_checkpoint import expand_blocks
from serving.engine.linear_fp8_block import BlockScaled, Fp8BlockLinear
from serving.engine.linear_routes import Dequantized, pick
from serving.engine.options import EngineOptions
from serving.engine.skinny_gemm import triton_available
from tasks.tiny_fp8 import quantize_blocks

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if triton_available() else "needs a CUDA GPU and the triton package"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


def block_weight(n: int, k: int, block: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # blocks of very different magnitudes: a wrong block's scale shows
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None] * torch.logspace(0, -1, k)[None, :]
    return quantize_blocks(w, block)


def test_tokens_are_scaled_per_group_by_their_own_range():
    x = torch.randn(3, 300) * torch.logspace(-3, 2, 300)[None, :]  # groups of very different ranges, ragged end
    x[1, 128:256] = 0.0  # an all-zero group keeps scale 1
    q, s = tokens_e4m3_groups(x, 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (3, 300) and s.shape == (3, 3)
    assert s[1, 1].item() == 1.0
    for g in range(3):
        part = x[:, g * 128:(g + 1) * 128]
        want = torch.where(part.abs().amax(1) > 0, part.abs().amax(1) / 448, torch.ones(3))
        assert torch.allclose(s[:, g], want)
    back = q.float() * s.repeat_interleave(128, dim=1)[:, :300]
    assert torch.all((back - x).abs() <= torch.maximum(x.abs() * 2**-4, s.repeat_interleave(128, 1)[:, :300] * 2**-9))


def test_the_emulation_is_the_block_dequantized_product_of_the_rounded_tokens():
    w, s = block_weight(200, 300, 128)
    assert s.shape == (2, 3)
    x = torch.randn(5, 300)
    y = block_fp8_emulated_linear(x, w, s, (128, 128), None)
    exact = x @ (w.float() * expand_blocks(s, (128, 128), (200, 300))).T
    print(f"rounded tokens against exact: {rel_err(y, exact):.2e}")
    assert rel_err(y, exact) < 2**-4


def test_the_layer_dequantizes_by_block_and_stays_on_the_reference_off_cuda():
    w, s = block_weight(96, 64, 32)
    layer = Fp8BlockLinear(64, 96, block=(32, 32), bias=False, dtype=torch.float32)
    assert layer.weight_scale.shape == (3, 2) and not layer.prescale_rows
    layer.load_state_dict({"weight": w, "weight_scale": s})
    layer.apply_options(EngineOptions())
    x = torch.randn(4, 64)
    assert isinstance(pick(layer.routes, x), Dequantized)
    assert torch.allclose(layer(x), x @ (w.float() * expand_blocks(s, (32, 32), (96, 64))).T, rtol=1e-5, atol=1e-5)


def test_the_kernel_takes_power_of_two_k_blocks_of_16_and_more():
    assert fits((128, 128)) and fits((1, 32)) and fits((7, 16))
    assert not fits((128, 96)) and not fits((128, 8))


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_a_block_the_kernel_cannot_take_is_refused_naming_it():
    w, s = block_weight(32, 96, 96)
    with pytest.raises(ValueError, match="blocks of 96 x 96"):
        block_fp8_linear(torch.randn(2, 96), w, s, (96, 96), None)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize(("n", "k", "block"), [(200, 384, 128), (96, 300, 32)])
def test_kernel_matches_the_emulation_interpreted(rows, n, k, block):
    w, s = block_weight(n, k, block)
    bias = torch.randn(n)
    x = torch.randn(rows, k) * torch.logspace(-1, 1, rows)[:, None]
    y = block_fp8_linear(x, w, s, (block, block), bias)
    ref = block_fp8_emulated_linear(x, w, s, (block, block), bias)
    print(f"rows {rows}, [{n}, {k}] in blocks of {block}: {rel_err(y, ref):.2e}")
    assert y.shape == (rows, n) and rel_err(y, ref) < 1e-5  # float32 out: only the order of the sums differs


@pytest.mark.interpreter
def test_the_registered_op_that_torch_compile_traces_gives_the_same_interpreted():
    w, s = block_weight(96, 64, 32)
    x = torch.randn(3, 64)
    xq, xs = tokens_e4m3_groups(x, 32)
    y = torch.ops.enginewright.block_fp8_linear(xq, xs, w, s, 32, 32, torch.float32)
    assert rel_err(y, block_fp8_emulated_linear(x, w, s, (32, 32), None)) < 1e-5


@pytest.mark.interpreter
def test_kernel_in_bf16_interpreted():
    w, s = block_weight(256, 256, 128)
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = block_fp8_linear(x, w, s, (128, 128), None)
    assert y.dtype == torch.bfloat16
    # the interpreter's float32 -> bf16 store truncates (the GPU rounds): within 2^-7 relative per value
    assert rel_err(y, block_fp8_emulated_linear(x, w, s, (128, 128), None)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)])
def test_kernel_at_qwen3_8b_shapes(rows, n, k):
    """Qwen3-8B's wqkv, wo, w13 and w2 in blocks of 128 x 128, bf16 tokens, against the emulation."""
    w, s = block_weight(n, k, 128)
    w, s = w.cuda(), s.cuda()
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    y = block_fp8_linear(x, w, s, (128, 128), None)
    ref = block_fp8_emulated_linear(x, w, s, (128, 128), None)
    print(f"rows {rows}, [{n}, {k}]: {rel_err(y, ref):.2e}")
    assert rel_err(y, ref) < 5e-3  # bf16 output rounding, float32 sums in another order


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_a_bf16_layer_on_an_fp8_gpu_takes_the_kernel():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores (compute capability 8.9+)")
    w, s = block_weight(512, 256, 128)
    layer = Fp8BlockLinear(256, 512, block=(128, 128), bias=False, dtype=torch.bfloat16)
    layer.load_state_dict({"weight": w, "weight_scale": s})
    layer = layer.cuda()
    layer.apply_options(EngineOptions())
    x = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    assert isinstance(pick(layer.routes, x), BlockScaled)
    assert rel_err(layer(x), layer.reference(x)) < 2**-4  # tokens in e4m3 against weight-only numerics
