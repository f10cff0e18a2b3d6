"""`bench profile`'s variant names (bench/profile_decode.py); the profile itself needs CUDA."""

from __future__ import annotations

import pytest

from bench.profile_decode import attention_knobs, profile_variant


def test_attention_knob_parts_become_launch_keywords():
    parts = ["triton", "kvb64", "pdl", "kvw8", "kvst3", "kvt1024"]
    assert attention_knobs(parts) == {"block": 64, "num_warps": 8, "num_stages": 3, "target_programs": 1024}
    assert attention_knobs(["kvb", "kvx64", "skinny"]) == {}


@pytest.mark.parametrize("part", ["kvb", "gateup", "kvq8"])
def test_an_unknown_part_is_named(part):
    with pytest.raises(ValueError, match=f"unknown parts \\['{part}'\\]"):
        profile_variant(None, variant=f"dynamic+triton+{part}", batch=1, context=8, kv_block=16)


@pytest.mark.parametrize("method", ["fp8", "int8-weight-only"])
def test_a_quantized_profile_counts_the_weights_at_their_stored_precision(method):
    """`bench profile --quantization`: the step's floor reads each quantized projection at one byte a weight."""
    import torch

    from bench.profile_decode import quantized
    from serving.engine.model import ModelArgs
    from serving.engine.models.llama import Transformer

    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=200, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, intermediate_size=128, norm_eps=1e-5, max_position_embeddings=64,
                     tie_word_embeddings=True)
    base = Transformer(args).to(torch.bfloat16)
    bf16_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    weights = [m.weight for name, m in base.named_modules() if name.endswith(("wqkv", "wo", "w13", "w2"))]
    model, step_bytes = quantized(base, method, batch=2, max_seq=16)
    assert model.layers[0].attention.kv_cache.k_cache.shape[0] == 2
    # each projection weight 2 bytes -> 1, plus a float32 scale per output channel; the LM head stays bf16
    assert bf16_bytes - step_bytes == sum(w.numel() - 4 * w.shape[0] for w in weights)
