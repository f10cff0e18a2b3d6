"""The Phi-3 / Phi-4 family (`Phi3ForCausalLM`, which Phi-4 uses too): Llama's computation, with the
checkpoint's projections already packed as the engine packs them.

Phi-3's `qkv_proj` is `[q; k; v]` (H hd + 2 Hkv hd rows, q's first) and its `gate_up_proj` `[gate; up]` (the
MLP computes `up * silu(gate)`): the engine's fused `wqkv` and `w13` in the same row order, so each is copied
whole (part 0 of 1 in the weight table); nothing is split. No bias on any projection. The model is
`models.llama.Transformer` itself: the layer computation is written once, there.

The 128k-context Phi-3 and Phi-3.5 configs scale the rotary embedding with `longrope` (formerly `su`): HF
applies its short factors (and an attention factor on cos and sin) up to `original_max_position_embeddings`
and switches every position to the long factors past it. The engine applies the short factors and refuses a
build past the original context (`EngineLimits.check`), so it computes what HF computes wherever it runs.
Config options the engine does not reproduce are refused by `read_config`, naming the value and what is
supported: a rotary embedding on part of each head (`partial_rotary_factor` < 1, Phi-4-mini), rope types
other than none and longrope.

Registered in `models.registry.ARCHITECTURES`. Imports: stdlib and torch only.
"""

from __future__ import annotations

import dataclasses
import math
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
SUPPORTED_ROPE_TYPES = ("default", "longrope", "su")  # "su": longrope's name in older Phi-3 configs


def read_config(config: dict[str, Any], *, architecture: str, source: str = "config.json") -> ModelArgs:
    """The `ModelArgs` of a Phi-3 / Phi-4 `config.json` dict: Llama's reader, after the options Phi-3 adds
    are checked (see the module doc), with longrope's short factors and attention factor read here."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} in {source} ({architecture}) is not supported; supported: "
            f"{list(SUPPORTED_ROPE_TYPES)}")
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedArchitectureError(
            f"partial_rotary_factor={partial} in {source} ({architecture}) is not supported: the engine rotates "
            "every dimension of a head (partial_rotary_factor 1.0)")
    if rope_type == "default":
        return llama.read_config(config, architecture=architecture, source=source)
    plain = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": rope.get(
        "rope_theta", config.get("rope_theta", 10000.0))}}
    return _with_longrope(llama.read_config(plain, architecture=architecture, source=source), config, rope, source)


def _with_longrope(args: ModelArgs, config: dict[str, Any], rope: dict[str, Any], source: str) -> ModelArgs:
    """`args` with longrope's short factors and attention factor, as HF's `_compute_longrope_parameters` reads
    them: the factor defaults to max_position_embeddings / original_max_position_embeddings, the attention
    factor to sqrt(1 + ln(factor) / ln(original)) (1 where the factor is <= 1). The long factors, which HF
    switches to past the original context, are not read: builds stop there (`EngineLimits.check`)."""
    original = int(rope.get("original_max_position_embeddings")
                   or config.get("original_max_position_embeddings") or args.max_position_embeddings)
    short = rope.get("short_factor")
    if not isinstance(short, list) or len(short) != args.head_dim // 2:
        raise UnsupportedArchitectureError(
            f"rope short_factor={short!r} in {source}: longrope needs a list of head_dim / 2 = {args.head_dim // 2} "
            "numbers")
    factor = float(rope.get("factor") or args.max_position_embeddings / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return dataclasses.replace(args, rope_type="longrope", rope_short_factor=tuple(float(f) for f in short),
                               rope_attention_factor=float(attention), rope_original_max_position_embeddings=original)
