"""The quantized peer computes what the engine computes on the device: weight-only on the CPU, tokens rounded
to e4m3 as well where an fp8 engine runs on FP8 tensor cores (tasks.validate.quantize_hf_linears)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from serving.engine.quantize import dequantize_weight, fp8_emulated_linear, quantize_weight
from tasks.validate import engine_scales_tokens, quantize_hf_linears


def tiny_hf(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def test_only_an_fp8_bf16_engine_on_fp8_tensor_cores_scales_tokens() -> None:
    assert not engine_scales_tokens("fp8", torch.bfloat16, "cpu")
    assert not engine_scales_tokens("int8-weight-only", torch.bfloat16, "cpu")
    assert not engine_scales_tokens("fp8", torch.float32, "cpu")


@torch.no_grad()
def test_the_cpu_peer_is_weight_only_and_the_tensor_core_peer_rounds_tokens_too() -> None:
    ids = torch.randint(0, 96, (1, 12))
    weight_only, scaled, plain = tiny_hf(), tiny_hf(), tiny_hf()
    quantize_hf_linears(weight_only, "fp8", lm_head=True)  # on the CPU: the default is weight-only
    quantize_hf_linears(scaled, "fp8", lm_head=True, scale_tokens=True)

    q_proj = plain.model.layers[0].self_attn.q_proj
    q, scale = quantize_weight(q_proj.weight, "fp8")
    assert torch.equal(weight_only.model.layers[0].self_attn.q_proj.weight, dequantize_weight(q, scale, torch.float32))
    x = torch.randn(3, 64)
    assert torch.equal(scaled.model.layers[0].self_attn.q_proj(x), fp8_emulated_linear(x, q, scale, None))
    assert sum(isinstance(m, torch.nn.Linear) for m in scaled.modules()) == 0  # every projection and the head

    reference = plain(ids).logits
    weight_only_error = (weight_only(ids).logits - reference).abs().max().item()
    scaled_error = (scaled(ids).logits - reference).abs().max().item()
    assert 0 < weight_only_error < scaled_error
