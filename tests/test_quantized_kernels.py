"""The decode kernels on quantized weights (int8 / e4m3 with per-row scales) against the dequantized reference.

- CPU, every run: the quantized config lookup (tuned, bf16 table, default) and the reference fallback.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the skinny "dot" and "gemv"
  kernels, the transposed "dott" one and the fused gate/up kernels on quantized weights, every split, rows 1..64.
- CUDA (`gpu`): the kernels at the Llama-1B / 8B shapes, the FP8 prefill GEMM (`torch._scaled_mm`,
  activations scaled per token), and a quantized engine's compiled decode step in CUDA graphs against
  its own eager reference path (relative error of the logits, greedy tokens).

Errors are relative, ||out - ref|| / ||ref||, fresh random inputs per check (METHOD.md): the kernels
convert the weights exactly to the activations' dtype, so they differ from the reference only by the
accumulation order (fp32) and one rounding.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from serving.engine.gate_up import gate_up
from serving.engine.quantize import FP8, INT8_WEIGHT_ONLY, dequantize_weight, quantize_weight
from serving.engine.skinny_gemm import (
    TUNED,
    TUNED_QUANTIZED,
    GemmConfig,
    default_quantized_config,
    quantized_config_for,
    skinny_linear,
    triton_available,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
METHODS = (INT8_WEIGHT_ONLY, FP8)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


def quantized(n: int, k: int, method: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Q, scales, the dequantized float32 reference weight) of a fresh random [n, k] weight."""
    w = torch.randn(n, k, device=device) * 0.02
    q, s = quantize_weight(w, method)
    return q, s, dequantize_weight(q, s, torch.float32)


def test_quantized_config_lookup():
    (rows, n, k), text = next(iter(TUNED_QUANTIZED.items()))
    assert quantized_config_for(rows, n, k) == GemmConfig.parse(text)
    (rows, n, k), text = next((key, t) for key, t in TUNED.items() if key not in TUNED_QUANTIZED)
    assert quantized_config_for(rows, n, k) == GemmConfig.parse(text)  # the bf16 table's (an LM head)
    config = default_quantized_config(1000, 4096)
    assert config is not None and config.kernel == "dot" and config.fits(64, 1000, 4096)
    assert -(-1000 // 64) * config.split <= 264  # about two programs per SM
    assert default_quantized_config(100, 24) is None  # K not a multiple of 16: the reference path
    assert quantized_config_for(65, n, k) is None


@pytest.mark.parametrize("method", METHODS)
def test_fallback_dequantizes_on_the_cpu(method):
    q, s, w = quantized(24, 32, method)
    x = torch.randn(3, 32)
    torch.testing.assert_close(skinny_linear(x, q, None, scale=s), F.linear(x, w), rtol=0, atol=1e-6)


@pytest.mark.skipif(not INTERPRET, reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("config", ["dot:n32:k32:s1:w4:st2", "dot:n16:k16:s4:w4:st2", "gemv:n8:k32:s2:w4:st2",
                                    "dott:n32:k32:s1:w4:st2", "dott:n16:k16:s4:w4:st2"])
def test_skinny_kernels_on_quantized_weights_interpreted(method, rows, config):
    config = GemmConfig.parse(config)
    if not config.fits(rows, 40, 128):
        pytest.skip("the gemv kernel is for one row")
    q, s, w = quantized(40, 128, method)  # N = 40: not a multiple of the blocks
    # float32 activations only: Triton 3.6's interpreter converts to bf16 wrongly (a 16 x 16 int8 tile
    # converted to bf16 and dotted with bf16 gave errors of 1e10); the GPU tests cover bf16
    x = torch.randn(rows, 128)
    out = skinny_linear(x, q, None, config=config, scale=s)
    assert out.dtype == torch.float32 and out.shape == (rows, 40)
    assert rel_err(out, F.linear(x.double(), w.double())) < 1e-5, (method, rows, config)


@pytest.mark.skipif(not INTERPRET, reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("kernel", ["dot", "dott"])
def test_gate_up_on_quantized_weights_interpreted(method, rows, kernel):
    q, s, w = quantized(2 * 48, 64, method)
    x = torch.randn(rows, 64)
    gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = gate_up(x, q, config=GemmConfig.parse(f"{kernel}:n16:k32:s1:w4:st2"), scale=s)
    assert out.shape == (rows, 48) and rel_err(out, ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# CUDA


LLAMA_SHAPES = [(3072, 2048), (2048, 8192), (128256 // 8, 2048), (6144, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_quantized_kernels_at_llama_shapes(method, rows):
    for n, k in LLAMA_SHAPES:
        q, s, w = quantized(n, k, method, "cuda")
        x = torch.randn(rows, k, device="cuda").bfloat16()
        ref = F.linear(x.double(), w.double())
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        out.copy_(skinny_linear(x, q, None, scale=s))
        assert rel_err(out, ref) < 1e-2, (method, rows, n, k)
    for inter, dim in ((8192, 2048), (14336, 4096)):
        q, s, w = quantized(2 * inter, dim, method, "cuda")
        x = torch.randn(rows, dim, device="cuda").bfloat16()
        gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)
        assert rel_err(gate_up(x, q, scale=s), F.silu(gate) * up) < 2e-2, (method, rows, inter)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
def test_fp8_prefill_gemm_scales_tokens():
    from serving.engine.quantize import fp8_scaled_linear, scaled_mm_fits

    q, s, w = quantized(4096, 2048, FP8, "cuda")
    # tokens of very different magnitudes: per-token scales keep each one's relative error
    x = (torch.randn(300, 2048, device="cuda") * torch.logspace(-2, 2, 300, device="cuda")[:, None]).bfloat16()
    assert scaled_mm_fits(x, q)
    out = fp8_scaled_linear(x, q, s, None)
    ref = F.linear(x.double(), w.double())
    per_token = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert per_token.max() < 0.06, per_token.max()


def _random_quantized_runner(method: str):
    """A Llama-1B-wide, 2-layer bf16 model with random weights, quantized in memory, loaded as an engine."""
    from serving.bench.quantized import random_runner

    return random_runner("llama-3.2-1b", method, max_batch_size=64, max_seq_len=256, n_layers=2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("method", METHODS)
def test_compiled_quantized_decode_matches_its_reference_path(method):
    runner = _random_quantized_runner(method)
    assert runner.model.decode_gemm_impl == "triton"
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(20 + i)] for i in range(16)]
    ref = runner.generate(prompts, max_new_tokens=12, top_logprobs=1)  # CUDA graphs of the eager step
    runner.compile_decode()
    got = runner.generate(prompts, max_new_tokens=12, top_logprobs=1)
    agree = sum(a == b for r, g in zip(ref, got) for a, b in zip(r.token_ids, g.token_ids))
    assert agree >= 0.9 * 16 * 12, agree
    tokens = torch.tensor([p[-1] for p in prompts], device="cuda")
    pos = torch.tensor([len(p) for p in prompts], device="cuda")
    from serving.engine.model import decode_step

    fast = decode_step(runner.model, tokens, pos, 256, gemm="triton").float()
    slow = decode_step(runner.model, tokens, pos, 256, gemm="torch").float()  # the dequantizing path
    assert rel_err(fast, slow) < 2e-2
