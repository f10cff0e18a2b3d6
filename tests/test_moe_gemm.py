"""The grouped expert GEMMs (`moe_gemm.fused_experts`, one launch a projection for all experts) against the loop
over experts (`moe.expert_loop`, what the CPU runs and the references are).

- `align` (torch ops, any device): every (token, expert) pair once, in its expert's padded run.
- TRITON_INTERPRET=1 (`make test-kernels`): CPU tensors, float32 activations (Triton 3.6's interpreter converts
  quantized tiles to bf16 wrongly: tests/test_quantized_kernels.py), weights float32, e4m3 and int8 with their
  row scales; row counts below, at and above the row block, experts that get no token.
- CUDA (`gpu`): bf16 and fp8 at Qwen3-30B-A3B's expert shape, the MoE layer taking the kernels at load, and a
  decode step of them captured in a CUDA graph. On the device:
  `.venv/bin/pytest -q -m gpu tests/test_moe_gemm.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from serving.engine import moe_gemm
from serving.engine.models.moe import ExpertWeights, MoEFeedForward, expert_loop, route
from serving.engine.quantize import NONE, quantize_weight

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and moe_gemm.triton is not None
HAS_CUDA = torch.cuda.is_available() and moe_gemm.triton is not None and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if moe_gemm.triton is not None else "needs a CUDA GPU and the triton package"


def experts(n_experts: int, d: int, inter: int, method: str, device: str, dtype: torch.dtype
            ) -> tuple[ExpertWeights, ExpertWeights]:
    """Random w13 [E * 2I, D] and w2 [E * D, I], stored as `method`."""
    pair = []
    for out_features, in_features in ((2 * inter, d), (d, inter)):
        w = torch.randn(n_experts * out_features, in_features, device=device) / in_features**0.5
        layer = ExpertWeights(n_experts, in_features, out_features, method=method, dtype=dtype).to(device)
        if method == NONE:
            layer.weight.data = w.to(dtype)
        else:
            layer.weight.data, layer.weight_scale.data = quantize_weight(w, method)
        pair.append(layer)
    return pair[0], pair[1]


def routed(tokens: int, n_experts: int, top_k: int, d: int, device: str, dtype: torch.dtype):
    x = torch.randn(tokens, d, device=device).to(dtype)
    weights, ids = route(torch.randn(tokens, n_experts, device=device), top_k, renormalize=True)
    return x, weights, ids


@pytest.mark.parametrize(("tokens", "n_experts", "top_k", "block_m"), [(1, 8, 2, 16), (5, 8, 2, 4), (40, 4, 2, 16),
                                                                       (3, 128, 8, 16)])
def test_align_puts_every_pair_once_in_its_experts_padded_run(tokens, n_experts, top_k, block_m):
    _, _, ids = routed(tokens, n_experts, top_k, 8, "cpu", torch.float32)
    sorted_ids, block_expert, padded = moe_gemm.align(ids, n_experts, block_m)
    total, used = tokens * top_k, int(padded)
    assert used % block_m == 0 and used <= sorted_ids.numel() == block_expert.numel() * block_m
    rows = sorted_ids[:used]
    assert sorted(rows[rows < total].tolist()) == list(range(total)) and bool((sorted_ids[used:] == total).all())
    flat = ids.flatten()
    for b in range(used // block_m):
        block = rows[b * block_m:(b + 1) * block_m]
        real = block[block < total].long()
        assert real.numel() and bool((flat[real] == block_expert[b]).all())  # no block is all padding
    assert bool((block_expert[used // block_m:] == n_experts).all())


def test_the_cpu_keeps_the_loop_over_experts():
    from serving.engine.model import ModelArgs
    from serving.engine.options import resolve_options

    args = ModelArgs(architecture="MixtralForCausalLM", vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2,
                     head_dim=16, intermediate_size=48, norm_eps=1e-6, max_position_embeddings=64, n_experts=4,
                     n_experts_per_tok=2, moe_intermediate_size=48)
    ff = MoEFeedForward(args)
    ff.apply_options(resolve_options(torch.device("cpu")))
    assert not ff.grouped


@pytest.mark.interpreter
@pytest.mark.parametrize("method", ["none", "fp8", "int8-weight-only"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_grouped_kernels_equal_the_expert_loop_interpreted(method, tokens):
    torch.manual_seed(tokens)
    w13, w2 = experts(8, 64, 48, method, "cpu", torch.float32)  # I = 48: a masked tail of the 32-column blocks
    x, weights, ids = routed(tokens, 8, 2, 64, "cpu", torch.float32)
    config = moe_gemm.GroupedConfig(16, 32, 32)
    got = moe_gemm.fused_experts(x, weights, ids, w13, w2, config)
    want = expert_loop(x, weights, ids, w13, w2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# CUDA

QWEN3_30B_A3B = (128, 8, 2048, 768)  # experts, top-k, hidden size, expert width


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("method", ["none", "fp8"])
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_grouped_kernels_equal_the_expert_loop_on_the_gpu(method, tokens):
    n_experts, top_k, d, inter = QWEN3_30B_A3B
    torch.manual_seed(tokens)
    w13, w2 = experts(n_experts, d, inter, method, "cuda", torch.bfloat16)
    x, weights, ids = routed(tokens, n_experts, top_k, d, "cuda", torch.bfloat16)
    got = moe_gemm.fused_experts(x, weights, ids, w13, w2).float()
    want = expert_loop(x.float(), weights, ids, *experts_in_float(w13, w2))
    err = (got - want).abs().max() / want.abs().max()
    print(f"{method} tokens={tokens}: max error {err.item():.2e} of the largest output")
    assert err < 2e-2


def experts_in_float(w13: ExpertWeights, w2: ExpertWeights) -> tuple[ExpertWeights, ExpertWeights]:
    """The same experts dequantized to float32 (the loop's reference at float32)."""
    out = []
    for layer in (w13, w2):
        f = ExpertWeights(layer.n_experts, layer.in_features, layer.out_features, dtype=torch.float32).to("cuda")
        f.weight.data = torch.cat([layer.expert(e, torch.float32).float() for e in range(layer.n_experts)])
        out.append(f)
    return out[0], out[1]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_the_moe_layer_takes_the_kernels_at_load_and_runs_in_a_cuda_graph():
    from serving.engine.model import ModelArgs
    from serving.engine.options import resolve_options

    n_experts, top_k, d, inter = QWEN3_30B_A3B
    args = ModelArgs(architecture="Qwen3MoeForCausalLM", vocab_size=64, dim=d, n_layers=1, n_heads=32, n_kv_heads=4,
                     head_dim=128, intermediate_size=6144, norm_eps=1e-6, max_position_embeddings=64,
                     n_experts=n_experts, n_experts_per_tok=top_k, moe_intermediate_size=inter)
    ff = MoEFeedForward(args).to("cuda", torch.bfloat16)
    for layer in (ff.w13, ff.w2):
        layer.weight.data.normal_(0, layer.in_features**-0.5)
    ff.apply_options(resolve_options(torch.device("cuda")))
    assert ff.grouped
    x = torch.randn(8, d, device="cuda", dtype=torch.bfloat16)
    ff(x)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ff(x)
    x.copy_(torch.randn_like(x))
    want = ff.reference(x)
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - want.float()).abs().max() < 2e-2 * want.float().abs().max()
