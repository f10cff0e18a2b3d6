"""The decode kernels on quantized weights (int8 / e4m3 with per-row scales) against the dequantized reference.

- CPU, every run: the quantized config lookup (tuned, bf16 table, default) and the reference fallback.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the skinny "dot" and "gemv"
  kernels, the transposed "dott" one and the fused gate/up kernels on quantized weights, every split, rows 1..64.
- CPU, every run: tokens scaled to e4m3 row by row, and the FP8 tensor cores' numerics emulated
  (`fp8_emulated_linear`) against the dequantized reference.
- CUDA (`gpu`): the kernels at the Llama-1B / 8B shapes, the FP8 tensor-core GEMM (`torch._scaled_mm`,
  activations scaled per token) at decode rows and in prefill, and a quantized engine's compiled decode
  step in CUDA graphs against its own dequantizing reference path (relative error of the logits, greedy
  tokens).

Errors are relative, ||out - ref|| / ||ref||, fresh random inputs per check (METHOD.md): the kernels
convert the weights exactly to the activations' dtype, so they differ from the reference only by the
accumulation order (fp32) and one rounding. The FP8 tensor-core path rounds each activation to e4m3 too:
3 mantissa bits, a relative error of at most 2^-4 per element (round to nearest; the tokens' scales keep
every value but the smallest ~1/28,000 of a row's max in e4m3's normal range), about 2.5% RMS. A product's
relative error is about that RMS for random data, so the per-token bound against the dequantized
reference is 2^-4; against the emulation (the same e4m3 inputs) it is the bf16 output rounding.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from serving.engine.gate_up import gate_up
from serving.engine.linear_fp8 import Fp8Linear
from serving.engine.linear_routes import Dequantized, SplitKFp8, TensorCores, pick
from serving.engine.options import EngineOptions, resolve_options
from serving.engine.quantize import (
    FP8,
    FP8_TENSOR_CORE_MIN_N,
    FP8_TENSOR_CORE_MIN_ROWS,
    INT8_WEIGHT_ONLY,
    dequantize_weight,
    fp8_emulated_linear,
    fp8_scaled_linear,
    quantize_tokens_fp8,
    quantize_weight,
)
from serving.engine.skinny_gemm import (
    GemmConfig,
    default_quantized_config,
    quantized_config_for,
    skinny_linear,
    triton_available,
)
from serving.engine.tuned_tables import TUNED_DIR, read_file

H200 = read_file(TUNED_DIR / "NVIDIA_H200.json")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if triton_available() else "needs a CUDA GPU and the triton package"
METHODS = (INT8_WEIGHT_ONLY, FP8)
E4M3_ROUNDING = 2.0**-4  # half a unit in the last place of 3 mantissa bits, relative


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
    (rows, n, k), config = next(iter(H200.skinny_fp8.items()))
    assert quantized_config_for(rows, n, k, H200) == config
    (rows, n, k), config = next((key, c) for key, c in H200.skinny.items() if key not in H200.skinny_fp8)
    assert quantized_config_for(rows, n, k, H200) == config  # the bf16 table's (an LM head)
    config = default_quantized_config(1000, 4096)
    assert config is not None and config.kernel == "dot" and config.fits(64, 1000, 4096)
    assert -(-1000 // 64) * config.split <= 264  # about two programs per SM
    assert default_quantized_config(100, 24) is None  # K not a multiple of 16: the reference path
    assert quantized_config_for(65, n, k, H200) is None


def test_int8_weights_take_their_own_table_first():
    """An int8 weight runs `skinny_int8`'s config where it has one; e4m3 weights never do."""
    import dataclasses

    (rows, n, k), config = next(iter(H200.skinny_fp8.items()))
    other = GemmConfig("dott", 32, 64, 1, 4, 3)
    tables = dataclasses.replace(H200, skinny_int8={(rows, n, k): other})
    assert quantized_config_for(rows, n, k, tables, int8=True) == other
    assert quantized_config_for(rows, n, k, tables) == config


@pytest.mark.parametrize("method", METHODS)
def test_fallback_dequantizes_on_the_cpu(method):
    q, s, w = quantized(24, 32, method)
    x = torch.randn(3, 32)
    torch.testing.assert_close(skinny_linear(x, q, None, scale=s), F.linear(x, w), rtol=0, atol=1e-6)


def test_tokens_to_e4m3_each_by_its_own_max():
    x = torch.randn(6, 256) * torch.logspace(-3, 3, 6)[:, None]
    x[5] = 0
    q, scale = quantize_tokens_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.all(q[:5].float().abs().amax(dim=1) == 448) and scale[5].item() == 1.0 and not q[5].float().any()
    normal = x.abs() >= scale * 2.0**-6  # e4m3's smallest normal, in each row's units
    rel = ((q.float() * scale - x).abs() / x.abs())[normal]
    assert rel.max() <= E4M3_ROUNDING and 0.005 < rel.mean() < 0.04, (rel.max(), rel.mean())


def test_fp8_tensor_core_numerics_emulated_on_the_cpu():
    """Per-token e4m3 activations against the weight-only reference: the error is the activations' rounding."""
    q, s, w = quantized(512, 2048, FP8)
    x = torch.randn(64, 2048) * torch.logspace(-2, 2, 64)[:, None]
    out = fp8_emulated_linear(x, q, s, None)
    ref = F.linear(x.double(), w.double())
    per_token = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
    print(f"per-token relative error: mean {per_token.mean():.4f}, max {per_token.max():.4f}")
    assert per_token.max() < E4M3_ROUNDING and per_token.mean() > 0.005  # it does change the numerics
    layer = Fp8Linear(2048, 512, bias=False, dtype=torch.float32)
    layer.weight.data, layer.weight_scale.data = q, s
    layer.apply_options(resolve_options(torch.device("cpu")))
    assert {type(route) for _, route in layer.routes} == {Dequantized}  # the CPU keeps weight-only numerics
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=0, atol=1e-5)


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_quantized_kernels_at_llama_shapes(method, rows):
    for n, k in LLAMA_SHAPES:
        q, s, w = quantized(n, k, method, "cuda")
        x = torch.randn(rows, k, device="cuda").bfloat16()
        ref = F.linear(x.double(), w.double())
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        out.copy_(skinny_linear(x, q, None, tables=H200, scale=s))
        assert rel_err(out, ref) < 1e-2, (method, rows, n, k)
    for inter, dim in ((8192, 2048), (14336, 4096)):
        q, s, w = quantized(2 * inter, dim, method, "cuda")
        x = torch.randn(rows, dim, device="cuda").bfloat16()
        gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)
        assert rel_err(gate_up(x, q, tables=H200, scale=s), F.silu(gate) * up) < 2e-2, (method, rows, inter)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("rows", [FP8_TENSOR_CORE_MIN_ROWS, 64, 300])
def test_fp8_tensor_core_gemm_scales_tokens(rows):
    """Decode rows (16, 64) and a prefill (300) at the Llama shapes: against the emulation (same e4m3 inputs:
    bf16 output rounding, 2^-9, twice), and per token against the dequantized reference (e4m3's 2^-4)."""
    for n, k in LLAMA_SHAPES:
        q, s, w = quantized(n, k, FP8, "cuda")
        layer = Fp8Linear(k, n, bias=False, dtype=torch.bfloat16).cuda()
        layer.weight.data, layer.weight_scale.data = q, s
        layer.apply_options(EngineOptions(decode_gemm="torch"))  # decode rows from 16 and prompts: `_scaled_mm`
        # tokens of very different magnitudes: per-token scales keep each one's relative error
        x = (torch.randn(rows, k, device="cuda") * torch.logspace(-2, 2, rows, device="cuda")[:, None]).bfloat16()
        assert isinstance(pick(layer.routes, x), TensorCores), (rows, n)
        assert isinstance(pick(layer.routes, x[:FP8_TENSOR_CORE_MIN_ROWS - 1]), Dequantized)
        out = layer(x)
        torch.testing.assert_close(out, fp8_scaled_linear(x, q, s, None), rtol=0, atol=0)
        triton = Fp8Linear(k, n, bias=False, dtype=torch.bfloat16).cuda()
        triton.weight.data, triton.weight_scale.data = q, s
        triton.apply_options(resolve_options(torch.device("cuda"), overrides={"decode_gemm": "triton"}))
        wide = rows > 64 or n >= FP8_TENSOR_CORE_MIN_N  # at decode rows only wide outputs, if not split-K tuned
        assert not wide or isinstance(pick(triton.routes, x), (TensorCores, SplitKFp8)), (rows, n)
        assert rel_err(out, fp8_emulated_linear(x, q, s, None)) < 5e-3, (rows, n, k)
        ref = F.linear(x.double(), w.double())
        per_token = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
        assert per_token.max() < E4M3_ROUNDING, (rows, n, k, per_token.max())


def _random_quantized_runner(method: str):
    """A Llama-1B-wide, 2-layer bf16 model with random weights, quantized in memory, loaded as an engine."""
    from bench.quantized import random_runner

    return random_runner("llama-3.2-1b", method, max_batch_size=64, max_seq_len=256, n_layers=2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("method", METHODS)
def test_quantized_decode_matches_its_reference_path(method):
    from engine_reference import decode_step_logits

    runner = _random_quantized_runner(method)
    assert runner.model.options.decode_gemm == "triton"
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(20 + i)] for i in range(16)]
    tokens = [p[-1] for p in prompts]
    # 16 rows: fp8's w13 on the FP8 tensor cores (per-token e4m3 activations), the rest on the decode kernels
    fast = decode_step_logits(runner, prompts, tokens)
    slow = decode_step_logits(runner, prompts, tokens, reference=True)  # weight-only numerics
    print(f"{method}: logits rel err against the dequantizing reference {rel_err(fast, slow):.2e}")
    assert rel_err(fast, slow) < (E4M3_ROUNDING if method == FP8 else 2e-2)


def test_the_bench_checks_an_engine_of_one_row_at_one_row(monkeypatch):
    from types import SimpleNamespace

    from bench import quantized

    checked = []
    monkeypatch.setattr(quantized, "check_step", lambda runner, batch, context: checked.append(batch) or {"err": 0.0})
    runner = SimpleNamespace(info=SimpleNamespace(limits=SimpleNamespace(max_batch_size=1)))
    assert quantized.check_kernels(runner) == {"err@1": 0.0}
    runner.info.limits.max_batch_size = 64
    assert quantized.check_kernels(runner) == {"err@8": 0.0, "err@64": 0.0} and checked == [1, 8, 64]
