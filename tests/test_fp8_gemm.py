"""The split-K FP8 tensor-core decode kernel (`serving.engine.fp8_gemm`) against `fp8_emulated_linear`.

- CPU, every run: the fit rules, the table lookup (no config on the CPU, or off the table), a refused launch.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the kernel on CPU tensors, every
  split, 1..64 rows, N not a multiple of the block, against the emulation (the same e4m3 inputs).
- CUDA (`gpu`): the kernel at the Llama-1B / 8B shapes against the emulation (float32 sums in another order,
  one bf16 rounding), per token within e4m3's rounding of the weight-only reference, and through the PDL op.

Errors are relative, ||out - ref|| / ||ref||, fresh random inputs per check.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from serving.engine import fp8_gemm, fp8_tokens
from serving.engine.fp8_gemm import fits, fp8_config_for, fp8_linear
from serving.engine.gemm_config import parse_table
from serving.engine.quantize import (
    FP8,
    dequantize_weight,
    fp8_emulated_linear,
    quantize_tokens_fp8,
    quantize_weight,
)
from serving.engine.skinny_gemm import GemmConfig, triton_available

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if triton_available() else "needs a CUDA GPU and the triton package"
E4M3_ROUNDING = 2.0**-4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


def test_fit_rules():
    config = GemmConfig.parse("dott:n64:k128:s4:w4:st3")
    assert fits(config, 64, 4096, 4096) and fits(config, 1, 4096, 512)
    assert not fits(config, 65, 4096, 4096)  # more rows than a decode batch: `_scaled_mm`
    assert not fits(config, 8, 4096, 4096 + 128)  # K slices must tile K
    assert not fits(GemmConfig.parse("dot:n64:k128:s1:w4:st3"), 8, 4096, 4096)  # the transposed kernel only
    assert not fits(GemmConfig.parse("dott:n64:k16:s1:w4:st3"), 8, 4096, 4096)  # e4m3 MMAs take K of 32


def test_lookup_needs_the_table_a_cuda_bf16_input_and_an_e4m3_weight(monkeypatch):
    w = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    table = parse_table({(64, 256, 512): "dott:n64:k128:s2:w4:st3"})
    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    assert fp8_config_for(x, w, table) is None  # a CPU tensor: the dequantizing reference
    if triton_available():
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert fp8_config_for(x, w, table).key() == "dott:n64:k128:s2:w4:st3"
        assert fp8_config_for(x[:1], w, table) is None  # one row is another bucket, not in this table
        assert fp8_config_for(x.float(), w, table) is None
        assert fp8_config_for(x, w.to(torch.int8), table) is None  # int8 weight-only keeps its kernels
        assert fp8_config_for(torch.zeros(65, 512, dtype=torch.bfloat16), w, table) is None


def test_a_sweep_replaces_only_the_entries_of_the_shapes_it_timed(tmp_path):
    import json

    from bench.quant_tables import install_fp8
    from serving.engine.tuned_tables import read_file, write_table

    write_table("NVIDIA H200", "9.0", "fp8", {(64, 4096, 4096): "dott:n64:k256:s2:w4:st5",
                                             (1, 4096, 4096): "dott:n64:k256:s4:w4:st3"}, directory=tmp_path)
    cell = {"rows": 64, "n": 4096, "k": 4096, "baseline_us": 10.0,
            "best": [{"config": "dott:n64:k128:s4:w4:st4", "us": 7.0}]}
    report = tmp_path / "fp8-sweep.json"
    report.write_text(json.dumps({"cells": [cell]}))
    path = install_fp8(str(report), device=("NVIDIA H200", "9.0"), directory=tmp_path)
    assert path == tmp_path / "NVIDIA_H200.json"
    assert {k: c.key() for k, c in read_file(path).fp8.items()} == {(64, 4096, 4096): "dott:n64:k128:s4:w4:st4",
                                                                    (1, 4096, 4096): "dott:n64:k256:s4:w4:st3"}


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_a_config_that_does_not_fit_is_refused_naming_it():
    xq, xs = quantize_tokens_fp8(torch.randn(4, 96))
    w, s = quantize_weight(torch.randn(32, 96), FP8)
    with pytest.raises(ValueError, match="dott:n32:k64:s1:w4:st2 does not fit M=4, N=32, K=96"):
        fp8_gemm.launch_fp8(xq, xs, w, s, GemmConfig.parse("dott:n32:k64:s1:w4:st2"))


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_token_scales_need_the_transposed_kernel_and_weight_scales():
    from serving.engine.skinny_gemm import launch

    xq, xs = quantize_tokens_fp8(torch.randn(4, 256))
    w, s = quantize_weight(torch.randn(64, 256), FP8)
    with pytest.raises(ValueError, match="token scales needs a 'dott' config.*dot:n64:k128:s1:w4:st3"):
        launch(xq, w, GemmConfig.parse("dot:n64:k128:s1:w4:st3"), scale=s, x_scale=xs)
    with pytest.raises(ValueError, match=r"token scales \[M=4\], got dott:n64:k128:s1:w4:st3, torch.float32 \(3, 1\)"):
        launch(xq, w, GemmConfig.parse("dott:n64:k128:s1:w4:st3"), scale=s, x_scale=xs[:3])


@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("config", ["dott:n32:k32:s1:w4:st2", "dott:n16:k32:s4:w4:st2"])
def test_kernel_matches_the_emulation_interpreted(rows, config):
    w, s = quantize_weight(torch.randn(40, 128) * 0.02, FP8)  # N = 40: not a multiple of the blocks
    x = torch.randn(rows, 128) * torch.logspace(-1, 1, rows)[:, None]
    xq, xs = quantize_tokens_fp8(x)
    parts = fp8_gemm.launch_fp8(xq, xs, w, s, GemmConfig.parse(config))
    assert parts.shape == (GemmConfig.parse(config).split, rows, 40)
    ref = F.linear(xq.double() * xs.double(), dequantize_weight(w, s, torch.float64))
    assert rel_err(parts.double().sum(0), ref) < 1e-2, (rows, config)  # bf16 output rounding at one slice


@pytest.mark.interpreter
def test_token_scaling_kernel_gives_the_torch_ops_values_interpreted():
    x = torch.randn(5, 2500) * torch.logspace(-3, 3, 5)[:, None]  # K: two passes and a ragged end
    x[3] = 0.0  # an all-zero token keeps scale 1
    q, s = fp8_tokens.tokens_e4m3(x, 448.0)
    want_q, want_s = quantize_tokens_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1) and s[3].item() == 1.0
    assert torch.equal(s, want_s)
    # Triton 3.6's interpreter rounds to e4m3 in software, wrongly at times (it drops the carry when a value
    # rounds up to the next power of two, 125.9 -> 64, and truncates subnormals): within a step of 2^-3
    # relative here (or one subnormal unit, 2^-9); the GPU converts in hardware, and its test asks for equality
    got, want = q.float(), want_q.float()
    near = (got - want).abs() <= torch.maximum(want.abs() * 2.0**-3, torch.full_like(want, 2.0**-9))
    carried = (got == want / 2) & (want.abs().log2() == want.abs().log2().round())
    assert (near | carried).all() and (got == want).float().mean() > 0.95


# ---------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.interpreter
@pytest.mark.parametrize("config", ["dott:n32:k32:s1:w4:st2", "dott:n16:k64:s4:w4:st2"])
def test_one_token_scaled_in_the_kernel_equals_the_two_step_path_interpreted(config):
    """`_fp8_one_row_kernel` (the row's scale found by every program, K past two `ROW_BLOCK`s with a ragged
    end) gives the partial products of the token scaled by the scaling kernel, then the "dott" kernel, bit for
    bit (both interpreted: the interpreter's e4m3 rounding is its own, on both sides)."""
    config = GemmConfig.parse(config)
    w, s = quantize_weight(torch.randn(40, 4608) * 0.02, FP8)
    for x in (torch.randn(1, 4608).bfloat16() * 3, torch.zeros(1, 4608, dtype=torch.bfloat16)):
        xq, xs = fp8_tokens.tokens_e4m3(x, 448.0)
        want = fp8_gemm.launch_fp8(xq, xs, w, s, config)
        got = fp8_gemm.launch_fp8_one_row(x, w, s, config)
        assert got.dtype == want.dtype and got.shape == (config.split, 1, 40)
        assert torch.equal(got, want), config.key()


@pytest.mark.interpreter
def test_one_token_goes_to_the_scaling_kernel_only_when_asked_interpreted(monkeypatch):
    config = GemmConfig.parse("dott:n32:k64:s2:w4:st2")
    w, s = quantize_weight(torch.randn(64, 512) * 0.02, FP8)
    x = torch.randn(3, 512).bfloat16()
    calls: list[int] = []
    one_row = fp8_gemm.launch_fp8_one_row
    monkeypatch.setattr(fp8_gemm, "launch_fp8_one_row", lambda x, *a, **k: calls.append(x.shape[0]) or one_row(x, *a, **k))
    fp8_gemm.fp8_partials(x[:1], w, s, config)
    assert calls == []
    on = fp8_gemm.fp8_partials(x[:1], w, s, config, row_scaling_in_kernel=True)
    fp8_gemm.fp8_partials(x, w, s, config, row_scaling_in_kernel=True)  # more rows: scaled before, as always
    assert calls == [1]
    assert torch.equal(on, fp8_gemm.launch_fp8(*fp8_tokens.tokens_e4m3(x[:1], 448.0), w, s, config))


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_the_in_kernel_scaling_takes_one_bf16_token_and_says_so():
    w, s = quantize_weight(torch.randn(64, 256), FP8)
    config = GemmConfig.parse("dott:n64:k128:s1:w4:st3")
    with pytest.raises(ValueError, match="dott:n64:k128:s1:w4:st3 with the token scaled in the kernel does not fit M=2"):
        fp8_gemm.launch_fp8_one_row(torch.zeros(2, 256, dtype=torch.bfloat16), w, s, config)
    with pytest.raises(ValueError, match=r"needs a bf16 token \[1, K\].*got torch.float32"):
        fp8_gemm.launch_fp8_one_row(torch.zeros(1, 256), w, s, config)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("config", ["dott:n64:k128:s2:w4:st3", "dott:n64:k256:s4:w4:st4"])
def test_one_token_scaled_in_the_kernel_on_the_gpu_equals_the_two_step_path(config):
    """At the Llama shapes: the same e4m3 token (correctly rounded division, as torch and inductor divide) and
    the same MMAs, so the same partial products, with and without PDL."""
    config = GemmConfig.parse(config)
    for n, k in LLAMA_SHAPES:
        w, s = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, FP8)
        x = (torch.randn(1, k, device="cuda") * 4).bfloat16()
        xq, xs = quantize_tokens_fp8(x)
        want = fp8_gemm.launch_fp8(xq, xs, w, s, config)
        for pdl in (False, True):
            assert torch.equal(fp8_gemm.launch_fp8_one_row(x, w, s, config, pdl=pdl), want), (n, k, pdl)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_token_scaling_kernel_on_the_gpu_gives_the_torch_ops_values_but_at_rounding_ties():
    from serving.engine.quantize import tokens_to_e4m3

    for rows, k in ((300, 4096), (8192, 14336)):
        x = (torch.randn(rows, k, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]).bfloat16()
        q, s = tokens_to_e4m3(x)  # more rows than a decode batch: the kernel
        want_q, want_s = quantize_tokens_fp8(x)
        assert torch.equal(s, want_s), rows
        # Triton's float32 `/` is not correctly rounded (div.full): on the H200, 19 of the 117M values of the
        # 8192 x 14336 case landed one e4m3 step from torch's, at rounding ties; the 300-row case was exact
        got, want = q.float(), want_q.float()
        differ = got != want
        assert differ.float().mean() < 1e-6, (rows, int(differ.sum()))
        assert ((got - want).abs()[differ] <= want.abs()[differ] * 2.0**-3 + 2.0**-9).all(), rows

LLAMA_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (6144, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("config", ["dott:n64:k128:s1:w4:st3", "dott:n128:k256:s4:w8:st3"])
def test_kernel_at_llama_shapes(rows, config):
    config = GemmConfig.parse(config)
    for n, k in LLAMA_SHAPES:
        w, s = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, FP8)
        x = (torch.randn(rows, k, device="cuda") * torch.logspace(-2, 2, rows, device="cuda")[:, None]).bfloat16()
        for pdl in (False, True):
            out = fp8_linear(x, w, s, config=config, pdl=pdl)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            assert rel_err(out, fp8_emulated_linear(x, w, s, None)) < 5e-3, (rows, n, k, pdl)
        ref = F.linear(x.double(), dequantize_weight(w, s, torch.float64))
        per_token = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)
        assert per_token.max() < E4M3_ROUNDING, (rows, n, k, per_token.max())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("row_scaling", [False, True], ids=["scaled-before", "scaled-in-gemm"])
def test_decode_on_the_fp8_kernel_matches_its_reference_path(monkeypatch, row_scaling):
    """Every projection of a 2-layer Llama-1B-wide fp8 engine on the kernel (one config for all), in the decode-only
    step: logits within e4m3's rounding of weight-only numerics; also with one token scaled inside its GEMMs
    (`EngineOptions.fp8_row_scaling_in_kernel`)."""
    import dataclasses

    from engine_reference import decode_step_logits

    from bench.quantized import random_runner
    from serving.engine.linear_routes import SplitKFp8, pick
    from serving.engine.linears import apply_options
    from serving.engine.options import with_tuned

    shapes = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
    table = parse_table({(bucket, n, k): "dott:n64:k128:s2:w4:st3" for bucket in (1, 64) for n, k in shapes})
    runner = random_runner("llama-3.2-1b", FP8, max_batch_size=64, max_seq_len=256, n_layers=2)
    options = with_tuned(dataclasses.replace(runner.model.options, fp8_row_scaling_in_kernel=row_scaling), fp8=table)
    apply_options(runner.model, options)
    layer = runner.model.layers[0]
    x = torch.zeros(16, 2048, device="cuda", dtype=torch.bfloat16)
    assert isinstance(pick(layer.attention.wqkv.routes, x), SplitKFp8)
    assert isinstance(pick(layer.feed_forward.w2.routes, x[:1]), SplitKFp8)
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(20 + i)] for i in range(16)]
    tokens = [p[-1] for p in prompts]
    for rows in (1, 16):
        fast = decode_step_logits(runner, prompts[:rows], tokens[:rows])
        slow = decode_step_logits(runner, prompts[:rows], tokens[:rows], reference=True)
        print(f"fp8 kernel, {rows} rows: logits rel err against the dequantizing reference {rel_err(fast, slow):.2e}")
        assert rel_err(fast, slow) < E4M3_ROUNDING


def test_a_layer_timed_on_the_weight_only_kernels_keeps_off_the_fp8_kernel(monkeypatch):
    """The bench's fp8-decode-kernels variant (`fp8_decode_tensor_cores` off) keeps every decode row off the
    FP8 tensor cores: the split-K kernel where tuned, `_scaled_mm` from 16 rows; a layer with a bias never takes
    the split-K kernel."""
    from serving.engine import linear_fp8, skinny_gemm
    from serving.engine.linear_fp8 import Fp8Linear
    from serving.engine.linear_routes import Skinny, SplitKFp8, TensorCores, pick
    from serving.engine.options import EngineOptions, with_tuned

    monkeypatch.setattr(Fp8Linear, "takes_tensor_cores", lambda self: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(skinny_gemm, "triton", object())  # (the routes only; nothing is launched)
    table = parse_table({(b, 16384, 64): "dott:n64:k64:s1:w4:st3" for b in (1, 64)})
    on = with_tuned(EngineOptions(decode_gemm="triton"), fp8=table)
    off = dataclasses.replace(on, fp8_decode_tensor_cores=False)

    def route(options, rows, bias=False, n=16384):
        layer = Fp8Linear(64, n, bias=bias, dtype=torch.bfloat16)
        layer.apply_options(options)
        return pick(layer.routes, torch.zeros(rows, 64))

    assert isinstance(route(on, 1), SplitKFp8) and isinstance(route(on, 64), SplitKFp8)
    assert isinstance(route(on, 16, n=32768), TensorCores)  # wide, no split-K config: `_scaled_mm` from 16 rows
    assert isinstance(route(on, 8, n=32768), Skinny)
    assert isinstance(route(on, 65), TensorCores)  # the prompt rows
    for rows in (1, 16, 64):
        assert isinstance(route(off, rows), Skinny), rows
        assert isinstance(route(on, rows, bias=True), (Skinny, TensorCores)), rows
    assert linear_fp8.FEW_ROWS == 15
