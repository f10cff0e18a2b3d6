"""Gemma 3 text (`Gemma3ForCausalLM`, model_type `gemma3_text`): the model, its HF -> engine weight names, its
config reader.

What sets it apart from the Llama family (`models/llama.py`, whose layout it keeps: fused `wqkv` and `w13`, the
same module names, so quantization and the serving steps treat it alike):
- local sliding-window layers interleaved with global ones (`layer_types`, or the older `sliding_window_pattern`:
  every n-th layer global), the local layers rotating by their own rope base (`rope_local_base_freq`, no scaling)
  and the global ones by `rope_theta` with the checkpoint's scaling (`ModelArgs.layer_windows`,
  `ModelArgs.local_rope_theta`: the serving steps read each layer's window and rope from them);
- RMSNorms that scale by `(1 + w)`, computed in float32 as HF does (`GemmaRMSNorm`): before and after the
  attention and the MLP (four a layer), the final norm, and per head on q and k before the rotation;
- a gated MLP with tanh-approximated GELU;
- the embeddings scaled by `sqrt(hidden_size)` rounded to the model's dtype (as HF's scaled embedding);
- attention scaled by `query_pre_attn_scalar ** -0.5` (`ModelArgs.attn_scale`), not `head_dim ** -0.5`;
- tied embeddings (an untied `lm_head.weight` is read too).
Logit soft-capping (`final_logit_softcapping`, `attn_logit_softcapping`: Gemma 2's, None in Gemma 3's configs) and
bidirectional attention are refused when the config is read.

The model is `llama.py`'s with Gemma's parts (`GemmaBlock`: the attention of `models.qwen3` with Gemma's head
norms, the GELU MLP, the four norms; `Transformer.embed`: the scale), so the layer computation is written once, in
`llama.py`, for the reference `Transformer.forward(tokens [B, S])` and the serving `Transformer.step(tokens [T], ctx)`.
Each layer's window and rope are read from `ModelArgs` by both (`ModelArgs.window`, `model.layer_rope`). On eager
half-precision GPU work Gemma's parts are the engine's fused kernels (`row_norm`'s and `head_norm`'s `unit_offset`,
`silu_mul`'s `gelu_tanh`; a step's output norm, residual add and next norm in one `row_norm.add_rms_norm`), elsewhere
the torch ops of the modules below, the reference they are tested against (tests/test_gemma_kernels.py).

Registered in `models.registry.ARCHITECTURES`. Imports: stdlib and torch only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from serving.engine import row_norm, silu_mul
from serving.engine.errors import UnsupportedArchitectureError as Unsupported
from serving.engine.linear_quantized import prescale_rows_for
from serving.engine.model import (
    SUPPORTED_ROPE_TYPES,
    ModelArgs,
    StepContext,
    windows_of_layer_types,
)
from serving.engine.models import llama, qwen3
from serving.engine.parallel import SINGLE, ParallelConfig

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
HIDDEN_ACTIVATIONS = ("gelu_pytorch_tanh",)  # GELU, tanh approximation: what Gemma 3 checkpoints set

# Llama's names, and the norms Gemma adds: per head on q and k, after attention, before and after the MLP
HF_TO_ENGINE: dict[str, tuple[str, int, int]] = {
    **llama.HF_TO_ENGINE,
    "model.layers.{i}.self_attn.q_norm.weight": ("layers.{i}.attention.q_norm.weight", 0, 1),
    "model.layers.{i}.self_attn.k_norm.weight": ("layers.{i}.attention.k_norm.weight", 0, 1),
    "model.layers.{i}.post_attention_layernorm.weight": ("layers.{i}.post_attention_norm.weight", 0, 1),
    "model.layers.{i}.pre_feedforward_layernorm.weight": ("layers.{i}.ffn_norm.weight", 0, 1),
    "model.layers.{i}.post_feedforward_layernorm.weight": ("layers.{i}.post_ffn_norm.weight", 0, 1),
}
IGNORED_HF_TENSORS = llama.IGNORED_HF_TENSORS
DEFAULT_SLIDING_WINDOW_PATTERN = 6  # transformers' default: five local layers, then a global one


def _ropes(config: dict[str, Any], source: str) -> tuple[dict[str, Any], float]:
    """(the global layers' rope parameters, the local layers' rope base) of either config style: transformers
    >= 5's `rope_parameters` per layer type, or `rope_theta` + `rope_scaling` + `rope_local_base_freq`."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(config.get("rope_scaling") or params)
        full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise Unsupported(f"rope type {local_type!r} of the sliding-window layers in {source} is not "
                          "supported; supported: 'default'")
    return full, float(local.get("rope_theta", 10_000.0))


def read_config(config: dict[str, Any], *, architecture: str, source: str = "config.json") -> ModelArgs:
    """The `ModelArgs` of a Gemma 3 text `config.json` dict; options the engine does not implement raise
    `UnsupportedArchitectureError` naming the option, its value and what is supported."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in HIDDEN_ACTIVATIONS:
        raise Unsupported(f"hidden_activation={act!r} in {source}: only {list(HIDDEN_ACTIVATIONS)} is "
                          "supported")
    for option in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(option) is not None:
            raise Unsupported(f"{option}={config[option]!r} in {source}: logit soft-capping is not "
                              "supported (Gemma 3 sets it to null)")
    if config.get("use_bidirectional_attention"):
        raise Unsupported(f"use_bidirectional_attention=true in {source} is not supported (causal "
                          "attention only)")

    dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    n_layers = int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or dim // n_heads)
    full, local_theta = _ropes(config, source)
    rope_type = full.get("rope_type", full.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise Unsupported(f"rope type {rope_type!r} in {source} is not supported; supported: "
                          f"{list(SUPPORTED_ROPE_TYPES)}")
    window = config.get("sliding_window")
    if window is None or int(window) < 1:
        raise Unsupported(f"sliding_window={window!r} in {source}: Gemma 3 needs a window >= 1 for its "
                          "local layers")
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
                  or DEFAULT_SLIDING_WINDOW_PATTERN)
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    try:
        layer_windows = windows_of_layer_types(types, int(window), n_layers, source=source)
    except ValueError as e:
        raise Unsupported(str(e)) from None
    attention_bias = bool(config.get("attention_bias", False))
    return ModelArgs(
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        intermediate_size=int(config["intermediate_size"]),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
        rope_theta=float(full["rope_theta"]),
        rope_type=rope_type,
        rope_factor=float(full.get("factor", 1.0)),
        rope_low_freq_factor=float(full.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(full.get("high_freq_factor", 4.0)),
        rope_original_max_position_embeddings=int(full.get("original_max_position_embeddings", 8192)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        sliding_window=int(window),
        layer_windows=layer_windows,
        local_rope_theta=local_theta,
        attn_scale=float(config.get("query_pre_attn_scalar", head_dim)) ** -0.5,
    )


def engine_param_names(args: ModelArgs) -> list[str]:
    """Every tensor name an engine checkpoint of `args` must hold: Llama's, and the norms Gemma adds."""
    extra = ("attention.q_norm.weight", "attention.k_norm.weight", "post_attention_norm.weight",
             "post_ffn_norm.weight")
    return llama.engine_param_names(args) + [f"layers.{i}.{name}" for i in range(args.n_layers) for name in extra]


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by `(1 + weight)`, all in float32, cast back at the end (HF's `Gemma3RMSNorm`). The weight is
    the checkpoint's `w`; on eager half-precision GPU work one kernel computes the same (`row_norm`'s
    `unit_offset`: `1 + w` in float32, the normed row not rounded before it), elsewhere the torch ops below."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, pdl: bool = False, e4m3: bool = False) -> torch.Tensor:
        # x: [..., D]; `pdl`, `e4m3`: the kernel's options, as model.RMSNorm's
        if x.is_cuda and not torch.compiler.is_compiling() and row_norm.fits(x, self.weight):
            return row_norm.rms_norm(x, self.weight, self.eps, pdl=pdl, e4m3=e4m3, unit_offset=True)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor, pdl: bool = False, e4m3: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it), as `model.RMSNorm.add` (one kernel on eager GPU work)."""
        if x.is_cuda and not torch.compiler.is_compiling() and row_norm.add_fits(x, delta, self.weight):
            return row_norm.add_rms_norm(x, delta, self.weight, self.eps, pdl=pdl, e4m3=e4m3, unit_offset=True)
        x = x + delta
        return x, self(x)

    def add_normed(self, x: torch.Tensor, delta: torch.Tensor, delta_norm: GemmaRMSNorm, pdl: bool = False,
                   e4m3: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta_norm(delta), this norm of it): a layer's output norm, the residual add and the next norm, in
        one kernel on eager GPU work (`row_norm.add_rms_norm`'s `delta_weight`); the norms share their eps."""
        if (x.is_cuda and not torch.compiler.is_compiling() and delta_norm.eps == self.eps
                and row_norm.add_fits(x, delta, self.weight, delta_norm.weight)):
            return row_norm.add_rms_norm(x, delta, self.weight, self.eps, pdl=pdl, e4m3=e4m3, unit_offset=True,
                                         delta_weight=delta_norm.weight)
        return self.add(x, delta_norm(delta, pdl=pdl), pdl=pdl, e4m3=e4m3)


class GemmaAttention(qwen3.Qwen3Attention):
    """Qwen3's attention (q and k normed per head before the rotation) with Gemma's norms: `head_norm`'s kernel
    with its `unit_offset` on eager half-precision GPU work, the norm modules' torch ops elsewhere."""

    head_norm_class = GemmaRMSNorm
    head_norm_unit_offset = True


class GeluFeedForward(llama.FeedForward):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused in `w13`: w13's own GEMM, then GELU * up in one kernel
    on eager GPU work (`silu_mul`'s `gelu_tanh`), its rows scaled to e4m3 too where w2 is an FP8 layer that would
    scale them itself; torch ops elsewhere."""

    def gated(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        e4m3 = prescale_rows_for(self.w2, x.numel() // x.shape[-1], x.device)
        return silu_mul.gated(self.w13(x, pdl=pdl), self.intermediate_size, e4m3=e4m3, gelu_tanh=True)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul.gated(gate_up, self.intermediate_size, gelu_tanh=True)


class GemmaBlock(llama.TransformerBlock):
    """Llama's layer with Gemma's attention, MLP and norms, and a norm on each of the attention's and the MLP's
    outputs before the residual add."""

    attention_class = GemmaAttention
    feed_forward_class = GeluFeedForward
    norm_class = GemmaRMSNorm

    def __init__(self, args: ModelArgs, feed_forward: nn.Module | None = None,
                 parallel: ParallelConfig = SINGLE) -> None:
        super().__init__(args, feed_forward, parallel)
        self.post_attention_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.post_ffn_norm = GemmaRMSNorm(args.dim, args.norm_eps)

    def attention_output(self, o: torch.Tensor) -> torch.Tensor:
        return self.post_attention_norm(o)

    def mlp_output(self, ff: torch.Tensor) -> torch.Tensor:
        return self.post_ffn_norm(ff)

    def add_attention_output(self, x: torch.Tensor, o: torch.Tensor, ctx: StepContext
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ffn_norm.add_normed(x, o, self.post_attention_norm, pdl=ctx.pdl, e4m3=ctx.w13_e4m3)

    def add_mlp_output(self, x: torch.Tensor, ff: torch.Tensor, next_norm: nn.Module, ctx: StepContext
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        return next_norm.add_normed(x, ff, self.post_ffn_norm, pdl=ctx.pdl, e4m3=ctx.qkv_e4m3)


class Transformer(llama.Transformer):
    """Llama's model over Gemma's layers, its embeddings scaled."""

    block_class = GemmaBlock

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(dim), the factor rounded to float32, then to the weights' dtype (as HF), and
        applied as a Python number: no host-to-device copy in a step that CUDA graphs capture."""
        scale = torch.tensor(math.sqrt(self.args.dim)).to(self.tok_embeddings.weight.dtype).item()
        return self.tok_embeddings(tokens) * scale
