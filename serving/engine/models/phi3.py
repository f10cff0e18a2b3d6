"""The Phi-3 / Phi-4 family (`Phi3ForCausalLM`, which Phi-4 uses too): Llama's computation, with the
checkpoint's projections already packed as the engine packs them.

Phi-3's `qkv_proj` is `[q; k; v]` (H hd + 2 Hkv hd rows, q's first) and its `gate_up_proj` `[gate; up]` (the
MLP computes `up * silu(gate)`): the engine's fused `wqkv` and `w13` in the same row order, so each is copied
whole (part 0 of 1 in the weight table); nothing is split. No bias on any projection. The model is
`models.llama.Transformer` itself: the layer computation is written once, there.

Config options the engine does not reproduce are refused by `read_config`, naming the value and what is
supported: a rotary embedding on part of each head (`partial_rotary_factor` < 1, Phi-4-mini), and rope scaling
other than none (`longrope`, formerly `su`, in the 128k-context Phi-3 and Phi-3.5 configs).

Registered in `models.registry.ARCHITECTURES`. Imports: stdlib and torch only.
"""

from __future__ import annotations

from typing import Any

from serving.engine.errors import UnsupportedArchitectureError
from serving.engine.model import ModelArgs
from serving.engine.models import llama

HF_TO_ENGINE: dict[str, tuple[str, int, int]] = {
    "model.embed_tokens.weight": ("tok_embeddings.weight", 0, 1),
    "model.norm.weight": ("norm.weight", 0, 1),
    "lm_head.weight": ("output.weight", 0, 1),
    "model.layers.{i}.self_attn.qkv_proj.weight": ("layers.{i}.attention.wqkv.weight", 0, 1),  # packed [q; k; v]
    "model.layers.{i}.self_attn.o_proj.weight": ("layers.{i}.attention.wo.weight", 0, 1),
    "model.layers.{i}.mlp.gate_up_proj.weight": ("layers.{i}.feed_forward.w13.weight", 0, 1),  # packed [gate; up]
    "model.layers.{i}.mlp.down_proj.weight": ("layers.{i}.feed_forward.w2.weight", 0, 1),
    "model.layers.{i}.input_layernorm.weight": ("layers.{i}.attention_norm.weight", 0, 1),
    "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.ffn_norm.weight", 0, 1),
}
IGNORED_HF_TENSORS = llama.IGNORED_HF_TENSORS
engine_param_names = llama.engine_param_names  # the same engine tensors as Llama's
Transformer = llama.Transformer  # the same model
SUPPORTED_ROPE_TYPES = ("default",)


def read_config(config: dict[str, Any], *, architecture: str, source: str = "config.json") -> ModelArgs:
    """The `ModelArgs` of a Phi-3 / Phi-4 `config.json` dict: Llama's reader, after the options Phi-3 adds
    are checked (see the module doc)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} in {source} ({architecture}) is not supported; supported: "
            f"{list(SUPPORTED_ROPE_TYPES)} (rope_scaling: null, as Phi-4's and the 4k-context Phi-3 configs)")
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor={partial} in {source} ({architecture}) is not supported: the engine rotates "
            "every dimension of a head (partial_rotary_factor 1.0)")
    return llama.read_config(config, architecture=architecture, source=source)
