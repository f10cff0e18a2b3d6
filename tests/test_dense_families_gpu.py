"""Qwen3 and Phi-3 on CUDA: Qwen3's per-head q/k norms run their kernel (`head_norm`) in every step and give the
same tokens under CUDA graphs as eagerly, and bf16 and fp8 engines of both (and of Gemma 3) pass the validation
gate against HF on the GPU. Gemma 3 in bf16: its layer's kernels run, and the same tokens under CUDA graphs as
eagerly. (The float32 engines of both equal the CPU engine: tests/test_engine_gpu.py.)

Runs only where CUDA is present (the lead's GPU run); skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from serving.engine import (
    EngineLimits,
    build_engine,
    convert_checkpoint,
    head_norm,
    load_engine,
    row_norm,
    silu_mul,
)
from serving.engine.quantize import FP8, QuantInfo
from tasks.tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 14, 15], [0, 100]]
LIMITS = {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128}


def engine(tmp_path: Path, arch: str, dtype: str, quantization: QuantInfo | None = None) -> tuple[Path, Path]:
    hf = tmp_path / f"hf-{arch}"
    if not hf.exists():
        make_tiny_model(hf, arch=arch)
    name = f"{arch}-{dtype}-{quantization.method if quantization else 'none'}"
    ckpt = convert_checkpoint(hf, tmp_path / f"ckpt-{name}", dtype=dtype, quantization=quantization)
    return hf, Path(build_engine(ckpt, tmp_path / f"engine-{name}", limits=EngineLimits(dtype=dtype, **LIMITS)).path)


def test_qwen3_head_norms_run_the_kernel_and_graphs_equal_eager_steps_in_bf16(tmp_path):
    _, path = engine(tmp_path, "qwen3", "bfloat16")
    graphs, eager = load_engine(path, device="cuda"), load_engine(path, device="cuda")
    eager.decode.use_graphs = False  # the same decode step, run eagerly
    with mock.patch.object(head_norm, "norm_heads_", wraps=head_norm.norm_heads_) as kernel:
        want = [g.token_ids for g in eager.generate(PROMPTS, max_new_tokens=16)]
    # every layer of the prompts' step and of each of the 15 decode steps
    assert kernel.call_count >= 16 * eager.info.model.n_layers, "the q/k head norms went through their kernel"
    got = [g.token_ids for g in graphs.generate(PROMPTS, max_new_tokens=16)]
    assert graphs.decode.graphs, "decode steps ran under CUDA graphs"
    assert got == want


def test_gemma3_decode_graphs_capture_and_equal_eager_steps_in_bf16(tmp_path):
    """Gemma 3 on llama.py's layer: its norms, GELU MLP and embedding scale (a Python number: a CPU tensor in the
    step broke capture) run under CUDA graphs and give the eager steps' tokens; every layer's q/k norms, output
    norms with their residual adds, and GELU * up run their kernels (tests/test_gemma_kernels.py)."""
    _, path = engine(tmp_path, "gemma3", "bfloat16")
    graphs, eager = load_engine(path, device="cuda"), load_engine(path, device="cuda")
    eager.decode.use_graphs = False
    with mock.patch.object(head_norm, "norm_heads_", wraps=head_norm.norm_heads_) as heads, \
            mock.patch.object(row_norm, "add_rms_norm", wraps=row_norm.add_rms_norm) as adds, \
            mock.patch.object(silu_mul, "silu_mul", wraps=silu_mul.silu_mul) as gelu:
        want = [g.token_ids for g in eager.generate(PROMPTS, max_new_tokens=16)]
    steps_layers = 16 * eager.info.model.n_layers  # the prompts' step and each of the 15 decode steps
    assert heads.call_count >= steps_layers and gelu.call_count >= steps_layers
    assert adds.call_count >= 2 * steps_layers - 16, "both output norms of a layer fused with their adds"
    got = [g.token_ids for g in graphs.generate(PROMPTS, max_new_tokens=16)]
    assert graphs.decode.graphs, "decode steps ran under CUDA graphs"
    assert got == want


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3"])
@pytest.mark.parametrize("quantization", [None, QuantInfo(FP8)], ids=["bf16", "fp8"])
def test_the_gate_passes_bf16_and_fp8_on_cuda(tmp_path, arch, quantization):
    from tasks.validate import ValidationSpec, validate_engine

    hf, path = engine(tmp_path, arch, "bfloat16", quantization)
    spec = ValidationSpec(prompts=["Once upon a time", "The quick brown"], max_new_tokens=8,
                          passages=["The quick brown fox jumps over the lazy dog."])
    result = validate_engine(path, hf, spec)
    print(f"{arch} {result.precision}: {result.metrics}")
    assert result.passed, result.failures
