"""A decode step's routing and alignment in one launch (`moe_routing.route_and_align`) against the torch ops it
replaces (`models.moe.route`, then `moe_gemm.align`): the same experts and order, ties to the lowest index, the
same weights to float32 rounding, and the same alignment, position for position.

- TRITON_INTERPRET=1 (`make test-kernels`): CPU tensors, one to 40 tokens, 4 to 128 experts, top-1 to top-8,
  with and without renormalizing, router rows with exact ties.
- CUDA (`gpu`): Qwen3-30B-A3B's routing (128 experts, top-8) at decode batches, and the MoE layer's output with the
  option on and off. On the device: `.venv/bin/pytest -q -m gpu tests/test_moe_routing.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from serving.engine import moe_gemm, moe_routing
from serving.engine.models.moe import route

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and moe_routing.triton is not None
HAS_CUDA = torch.cuda.is_available() and moe_routing.triton is not None and not INTERPRET


def router_logits(tokens: int, n_experts: int, device: str, *, ties: bool = False) -> torch.Tensor:
    logits = torch.randn(tokens, n_experts, device=device)
    if ties:  # experts 1 and 2 (and the last two) equal for every token, near the top
        logits[:, 2] = logits[:, 1] = logits.max(dim=1).values + 0.5
        logits[:, -1] = logits[:, -2]
    return logits


def assert_same_routing(logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int, *,
                        rtol: float = 1e-6) -> None:
    weights, ids, sorted_ids, block_expert, padded = moe_routing.route_and_align(
        logits, top_k, renormalize=renormalize, block_m=block_m)
    want_weights, want_ids = route(logits, top_k, renormalize=renormalize)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=rtol, atol=1e-7)
    want = moe_gemm.align(want_ids, logits.shape[1], block_m)
    for name, got, expected in zip(("sorted_ids", "block_expert", "padded"), (sorted_ids, block_expert, padded), want):
        assert got.dtype == expected.dtype and torch.equal(got, expected), (name, got, expected)


def test_fits_bounds_one_programs_cells():
    if moe_routing.triton is None:
        pytest.skip("needs the triton package")
    assert moe_routing.fits(1, 128) and moe_routing.fits(128, 128) and moe_routing.fits(64, 256)
    assert not moe_routing.fits(129, 128) and not moe_routing.fits(512, 128)
    assert moe_routing.sorted_length(1, 8, 128, 16) == 128  # 8 + 8 x 15 rows, in whole blocks


@pytest.mark.interpreter
@pytest.mark.parametrize(("tokens", "n_experts", "top_k", "block_m"),
                         [(1, 8, 2, 16), (5, 8, 2, 4), (40, 4, 2, 16), (3, 128, 8, 16), (7, 60, 4, 16), (2, 6, 1, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_one_launch_routes_and_aligns_as_the_torch_ops_interpreted(tokens, n_experts, top_k, block_m, renormalize):
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 and the triton package (make test-kernels)")
    torch.manual_seed(tokens * 1000 + n_experts)
    assert_same_routing(router_logits(tokens, n_experts, "cpu"), top_k, renormalize, block_m)


@pytest.mark.interpreter
@pytest.mark.parametrize(("tokens", "n_experts", "top_k"), [(4, 8, 2), (9, 16, 3)])
def test_exact_ties_go_to_the_lowest_expert_index_interpreted(tokens, n_experts, top_k):
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 and the triton package (make test-kernels)")
    logits = router_logits(tokens, n_experts, "cpu", ties=True)
    assert_same_routing(logits, top_k, True, 4)
    ids = moe_routing.route_and_align(logits, top_k, renormalize=True, block_m=4)[1]
    assert bool((ids[:, 0] == 1).all()) and bool((ids[:, 1] == 2).all())  # 1 before 2, at the top for every token


def test_a_batch_past_one_program_is_refused_naming_the_fallback():
    if moe_routing.triton is None:
        pytest.skip("needs the triton package")
    with pytest.raises(ValueError, match=r"at most 16384 tokens x experts .* got 200 x 128: route with"):
        moe_routing.route_and_align(torch.zeros(200, 128), 8, renormalize=True, block_m=16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the triton package")
@pytest.mark.parametrize("tokens", [1, 8, 64, 128])
def test_qwen3_moe_routing_at_decode_batches_on_the_gpu(tokens):
    torch.manual_seed(tokens)
    logits = router_logits(tokens, 128, "cuda").to(torch.bfloat16)
    assert_same_routing(logits, 8, True, moe_gemm.config_for(tokens, 128).block_m, rtol=1e-5)  # the GPU's fast exp


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the triton package")
def test_the_moe_layer_gives_the_same_output_with_the_fused_routing_on_and_off():
    import dataclasses

    from serving.engine.model import ModelArgs
    from serving.engine.models.moe import MoEFeedForward
    from serving.engine.options import resolve_options

    args = ModelArgs(architecture="Qwen3MoeForCausalLM", vocab_size=64, dim=256, n_layers=1, n_heads=2,
                     n_kv_heads=2, head_dim=128, intermediate_size=512, norm_eps=1e-6, max_position_embeddings=64,
                     n_experts=128, n_experts_per_tok=8, moe_intermediate_size=128, moe_renormalize=True)
    torch.manual_seed(0)
    ff = MoEFeedForward(args).cuda().to(torch.bfloat16)
    for p in ff.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    options = dataclasses.replace(resolve_options(torch.device("cuda")), moe_fused_routing=True)
    ff.apply_options(options)
    assert ff.fused_routing
    fused = ff(x)
    ff.apply_options(dataclasses.replace(options, moe_fused_routing=False))
    assert not ff.fused_routing
    torch.testing.assert_close(fused, ff(x))  # the same experts; weights within a few ulp (the GPU's fast exp)


@pytest.mark.interpreter
@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_the_moe_layer_on_the_grouped_kernels_equals_its_reference_either_routing_interpreted(tokens):
    """The layer's grouped path end to end (routing, alignment, both GEMMs) on CPU tensors, with the one-launch
    routing and with the torch ops (40 tokens x 16 experts: one program; the torch ops either way past it)."""
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 and the triton package (make test-kernels)")
    from serving.engine.model import ModelArgs
    from serving.engine.models.moe import MoEFeedForward

    args = ModelArgs(architecture="Qwen3MoeForCausalLM", vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=2,
                     head_dim=16, intermediate_size=48, norm_eps=1e-6, max_position_embeddings=64, n_experts=16,
                     n_experts_per_tok=4, moe_intermediate_size=24, moe_renormalize=True)
    torch.manual_seed(tokens)
    ff = MoEFeedForward(args)
    for p in ff.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(tokens, 32)
    want = ff.reference(x)
    for fused in (True, False):
        ff.grouped, ff.fused_routing = True, fused
        torch.testing.assert_close(ff(x), want, rtol=1e-5, atol=1e-5)
