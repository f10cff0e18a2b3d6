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

As in `llama.py`, `Transformer.forward(tokens [B, S])` is the reference (whole sequences, no cache) and
`Transformer.step(tokens [T], ctx)` what serves over the paged KV cache with a `model.StepContext`.

Registered in `models.registry.ARCHITECTURES`. Imports: stdlib and torch only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.errors import UnsupportedArchitectureError as Unsupported
from serving.engine.linear_float import FloatLinear, TiedHead
from serving.engine.model import (
    SUPPORTED_ROPE_TYPES,
    ModelArgs,
    StepContext,
    apply_rope,
    rope_cos_sin,
    windows_of_layer_types,
)
from serving.engine.models import llama
from serving.engine.options import EngineOptions
from serving.engine.prefill_attention import causal_band

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
    """RMSNorm scaled by `(1 + weight)`, all in float32, cast back at the end (HF's `Gemma3RMSNorm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, pdl: bool = False, e4m3: bool = False) -> torch.Tensor:
        # x: [..., D]; `pdl`, `e4m3`: the engine's norm kernel's options (model.RMSNorm), not used here: a GEMM
        # after this norm scales its own rows
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor, pdl: bool = False, e4m3: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it), as `model.RMSNorm.add`."""
        x = x + delta
        return x, self(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.args = args
        self.window = args.window(layer)  # None: a global layer
        self.wqkv = FloatLinear(args.dim, args.qkv_size, bias=args.qkv_bias)
        self.wo = FloatLinear(args.q_size, args.dim, bias=args.o_bias)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.norm_eps)

    def normed(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [..., (H + 2 Hkv) hd] with each q and k head through its RMSNorm (v as it is)."""
        a = self.args
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = self.q_norm(q.unflatten(-1, (a.n_heads, a.head_dim))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (a.n_kv_heads, a.head_dim))).flatten(-2)
        return torch.cat((q, k, v), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The reference attention over whole sequences, causal (banded on a local layer), no cache. x: [B, S, D];
        cos, sin: [B, S, hd] of this layer's rope."""
        a = self.args
        bsz, seqlen, _ = x.shape
        q, k, v = self.normed(self.wqkv(x)).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = apply_rope(q.view(bsz, seqlen, a.n_heads, a.head_dim), cos, sin)  # [B, S, H, hd]
        k = apply_rope(k.view(bsz, seqlen, a.n_kv_heads, a.head_dim), cos, sin)  # [B, S, Hkv, hd]
        v = v.view(bsz, seqlen, a.n_kv_heads, a.head_dim)
        band = causal_band(seqlen, self.window, x.device)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=band is None, attn_mask=band, scale=a.softmax_scale,
                                           enable_gqa=a.n_heads != a.n_kv_heads)  # [B, H, S, hd]
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, a.q_size))


class FeedForward(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused in `w13`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w13 = FloatLinear(args.dim, 2 * args.intermediate_size, bias=False)  # [gate; up]
        self.w2 = FloatLinear(args.intermediate_size, args.dim, bias=False)

    def gelu_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gelu_gated(self.w13(x)))

    def step(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return ctx.linear(self.w2, self.gelu_gated(ctx.linear(self.w13, x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.attention = Attention(args, layer)
        self.feed_forward = FeedForward(args)
        self.attention_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.post_attention_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.post_ffn_norm = GemmaRMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The reference layer: x [B, S, D], whole sequences, no cache."""
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))

    def step(self, index: int, x: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer (number `index`) in a serving step: x [T, D] -> (x plus the attention's normed output, the
        MLP's normed output); the caller adds the second."""
        qkv = self.attention.normed(ctx.linear(self.attention.wqkv, self.attention_norm(x)))
        y = ctx.attend(index, qkv)  # [T, H hd]: rotated by this layer's rope, windowed on a local layer
        x = x + self.post_attention_norm(ctx.linear(self.attention.wo, y))
        return x, self.post_ffn_norm(self.feed_forward.step(self.ffn_norm(x), ctx))


class Transformer(nn.Module):
    """Scaled embeddings, `n_layers` blocks, final norm, LM head (the embedding matrix when tied)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = llama.embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_word_embeddings else FloatLinear(args.dim, args.vocab_size, bias=False)
        self.tied_head = (TiedHead(self.tok_embeddings),) if args.tie_word_embeddings else ()
        self.options = EngineOptions()  # how it runs (`linears.apply_options` sets them at load)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(dim), the factor rounded to float32, then to the weights' dtype (as HF), and
        applied as a Python number: no host-to-device copy in a step that CUDA graphs capture."""
        scale = torch.tensor(math.sqrt(self.args.dim)).to(self.tok_embeddings.weight.dtype).item()
        return self.tok_embeddings(tokens) * scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reference forward: tokens [B, S], each row a whole sequence from position 0, causal (banded on the
        local layers), no cache -> final hidden states [B, S, D]."""
        bsz, seqlen = tokens.shape
        dtype = self.tok_embeddings.weight.dtype
        ropes = [tuple(t.to(dtype).expand(bsz, -1, -1) for t in rope_cos_sin(self.args, seqlen, tokens.device,
                                                                               local=local))
                 for local in (False, True)]
        x = self.embed(tokens)  # [B, S, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, *ropes[self.args.local_rope(i)])
        return self.norm(x)

    def step(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Every layer of one serving step over the KV cache: tokens [T] -> the final norm of the rows `ctx`
        returns [N, D] (`StepContext.last_hidden`)."""
        x, ff = self.embed(tokens), None  # [T, D]
        for i, layer in enumerate(self.layers):
            x, ff = layer.step(i, x if ff is None else x + ff, ctx)
        return ctx.last_hidden(self.norm, x, ff)

    def head(self) -> nn.Module:
        """The LM head's layer: over the embedding matrix when tied."""
        return self.tied_head[0] if self.output is None else self.output

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> float32 logits [..., V], through the head's GEMM for h's rows."""
        return self.head()(h).float()
