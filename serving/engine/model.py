"""The transformer of the `torch` engine: model args, rotary embeddings, static KV cache, forward.

A Llama-family decoder (Llama 2/3, Mistral, Qwen2) in the layout of pytorch-labs/gpt-fast: fused
`wqkv` and `w13` projections, a preallocated `KVCache` per layer, rotary embeddings in the
Hugging Face "rotate half" layout (so HF weights need no permutation). The engine speaks token ids,
not text: tokenization lives with the caller.

Three entry points share the weights and the cache:

- `Transformer.forward(tokens [B, S], input_pos [B, S], kv_len)`: the general masked forward (teacher-
  forced logits for validation, the reference the fast paths are tested against).
- `prefill_packed`: prompts of unequal lengths packed into one `[T]` row (no padding): projections
  and MLP run on the packed tokens, attention runs per prompt (flash SDPA, causal), K/V go into each
  prompt's cache slot (row). Nothing is computed for padding.
- `decode_step(tokens [B], input_pos [B], kv_len)`: one token per cache row; attention reads only
  the first `kv_len` cache positions (a bucket covering the filled prefix), so its shapes depend only
  on (B, kv_len): `cuda_graphs.DecodeGraphs` captures one CUDA graph per (batch bucket, kv bucket).

Imports: stdlib and torch only (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine import row_norm, silu_mul
from serving.engine.errors import UnsupportedArchitectureError
from serving.engine.linear_float import FloatLinear, TiedHead
from serving.engine.linear_quantized import QuantLinear, prescale_rows_for
from serving.engine.options import EngineOptions
from serving.engine.partials import sum_partials
from serving.engine.prefill_attention import sdpa

# architectures[0] of config.json -> (model_type, whether q/k/v carry a bias by default)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    """Shape and numerics of the model; everything `Transformer` needs, nothing else."""

    architecture: str  # "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM"
    vocab_size: int
    dim: int  # hidden_size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # not implemented: builds require max_seq_len <= sliding_window

    # derived -------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown model args {unknown} (known: {sorted(names)})")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, source: str = "config.json") -> ModelArgs:
        """Read a Hugging Face `config.json` dict; unsupported architectures/options raise."""
        archs = config.get("architectures") or []
        model_type = config.get("model_type")
        supported = ", ".join(f"{a} (model_type {t!r})" for a, (t, _) in SUPPORTED_ARCHITECTURES.items())
        arch = archs[0] if archs else None
        if arch is None:  # fall back to model_type when `architectures` is absent
            arch = next((a for a, (t, _) in SUPPORTED_ARCHITECTURES.items() if t == model_type), None)
        if arch not in SUPPORTED_ARCHITECTURES or len(archs) > 1:
            raise UnsupportedArchitectureError(
                f"unsupported architecture architectures={archs!r} model_type={model_type!r} in {source}; "
                f"supported: {supported}"
            )
        expected_type, default_qkv_bias = SUPPORTED_ARCHITECTURES[arch]
        if model_type is not None and model_type != expected_type:
            raise UnsupportedArchitectureError(
                f"architecture {arch!r} with model_type={model_type!r} in {source}: expected model_type "
                f"{expected_type!r}; supported: {supported}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"hidden_act={act!r} in {source}: only 'silu' is supported")
        if config.get("mlp_bias"):
            raise UnsupportedArchitectureError(f"mlp_bias=true in {source} is not supported")

        dim = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or dim // n_heads
        attention_bias = bool(config.get("attention_bias", False))

        # rope: transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`
        rope = dict(config.get("rope_parameters") or {})
        if not rope:
            rope = dict(config.get("rope_scaling") or {})
            rope["rope_theta"] = config.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope type {rope_type!r} in {source} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
            )

        sliding_window = config.get("sliding_window")
        if expected_type == "qwen2" and not config.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            intermediate_size=int(config["intermediate_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
            qkv_bias=default_qkv_bias or attention_bias,
            o_bias=attention_bias,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
        )


# ---------------------------------------------------------------------------------------------
# rotary embeddings


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (float32), with linear or llama3 scaling applied."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if args.rope_type == "linear":
        return inv_freq / args.rope_factor
    if args.rope_type == "llama3":
        factor, low, high = args.rope_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
        old_ctx = args.rope_original_max_position_embeddings
        low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(args: ModelArgs, max_seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables: `[max_seq_len, head_dim]` float32 (HF layout: the half-table repeated)."""
    inv_freq = rope_inv_freq(args).to(device)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [T, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, S, H, hd]; cos, sin: [B, S, hd] (already in x.dtype)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# static KV cache


class KVCache(nn.Module):
    """Preallocated keys/values of one layer: `[max_batch, n_kv_heads, max_seq, head_dim]` each.

    Slot `p` of row `b` holds the key/value of the token at position `p` of sequence `b`.
    """

    def __init__(self, max_batch: int, n_kv_heads: int, max_seq: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (max_batch, n_kv_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # input_pos: [B, S]; k, v: [B, S, Hkv, hd] -> cache views [B, Hkv, kv_len, hd]
        bsz = k.shape[0]
        rows = torch.arange(bsz, device=k.device).unsqueeze(1)  # [B, 1]
        # advanced indices on dims 0 and 2 -> the indexed view is [B, S, Hkv, hd], like k
        self.k_cache[rows, :, input_pos] = k
        self.v_cache[rows, :, input_pos] = v
        return self.k_cache[:bsz, :, :kv_len], self.v_cache[:bsz, :, :kv_len]


# ---------------------------------------------------------------------------------------------
# the transformer


REFERENCE_GEMM = "reference"  # a decode `gemm`: quantized layers dequantized at every row count (the checks' reference)
LinearFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (a linear layer, x) -> x W^T + b


def torch_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own forward: the GEMM it picked at load for x's rows (`linear_float`, `linear_fp8`,
    `linear_int8`)."""
    return module(x)


def reference_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's dequantizing reference (F.linear on a float layer): what the decode step is checked against
    (`decode_step(..., gemm=REFERENCE_GEMM)`)."""
    return module.reference(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, pdl: bool = False, e4m3: bool = False) -> torch.Tensor:
        # x: [B, S, D]; normalise in float32 like HF, cast back before the weight. `pdl`: the kernel launched
        # with programmatic dependent launch (serving.engine.pdl); `e4m3`: the kernel's result also carries its
        # rows scaled for an FP8 GEMM (serving.engine.prescaled)
        if x.is_cuda and not torch.compiler.is_compiling() and row_norm.fits(x, self.weight):
            return row_norm.rms_norm(x, self.weight, self.eps, pdl=pdl, e4m3=e4m3)  # one kernel, not seven
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor, pdl: bool = False, e4m3: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it): a residual add and the norm after it, in one kernel on eager GPU work
        (`pdl`, `e4m3` as `forward`'s)."""
        if x.is_cuda and not torch.compiler.is_compiling() and row_norm.add_fits(x, delta, self.weight):
            return row_norm.add_rms_norm(x, delta, self.weight, self.eps, pdl=pdl, e4m3=e4m3)
        x = x + delta
        return x, self(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.wqkv = FloatLinear(args.dim, args.qkv_size, bias=args.qkv_bias)
        self.wo = FloatLinear(args.q_size, args.dim, bias=args.o_bias)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        a = self.args
        bsz, seqlen, _ = x.shape  # x: [B, S, D]
        q, k, v = self.wqkv(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = apply_rope(q.view(bsz, seqlen, a.n_heads, a.head_dim), cos, sin)  # [B, S, H, hd]
        k = apply_rope(k.view(bsz, seqlen, a.n_kv_heads, a.head_dim), cos, sin)  # [B, S, Hkv, hd]
        v = v.view(bsz, seqlen, a.n_kv_heads, a.head_dim)
        assert self.kv_cache is not None, "setup_caches() was not called"
        keys, values = self.kv_cache.update(input_pos, k, v, kv_len)  # [B, Hkv, L, hd]
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=a.n_heads != a.n_kv_heads
        )  # [B, H, S, hd]
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, a.q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w13 = FloatLinear(args.dim, 2 * args.intermediate_size, bias=False)  # [gate; up]
        self.w2 = FloatLinear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        return self.w2(self.gated(x, pdl), pdl=pdl)

    def gated(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """silu(gate) * up, the input of w2 (w13's `gated`: one kernel where it picked one); its rows scaled to
        e4m3 as well where w2's FP8 GEMM would scale them in a kernel of its own (`prescale_rows_for`)."""
        return self.w13.gated(x, pdl, e4m3=prescale_rows_for(self.w2, x.numel() // x.shape[-1], x.device))

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP through its layers' dequantizing references."""
        return self.w2.reference(silu_mul.gated(self.w13.reference(x), self.intermediate_size))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos, kv_len)
        return h + self.feed_forward(self.ffn_norm(h))


def embedding(vocab_size: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its random init where the weights are on the meta device (an engine about to load
    its own): normal_ on meta runs a python decomposition that imports torch._dynamo, 2.5 s of CPU in every
    process that loads an engine (each Triton `llm` stub), where nothing else would import it."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))
    return nn.Embedding(vocab_size, dim)


class Transformer(nn.Module):
    """Embeddings, `n_layers` blocks, final norm, LM head (the embedding matrix when tied)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_word_embeddings else FloatLinear(args.dim, args.vocab_size, bias=False)
        # the tied LM head over the embedding table (a tuple: not a submodule, the state dict holds the table once)
        self.tied_head = (TiedHead(self.tok_embeddings),) if args.tie_word_embeddings else ()
        self.max_batch_size = 0
        self.options = EngineOptions()  # how it runs (`linears.apply_options` sets them at load)
        self.max_seq_len = 0

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the KV caches and rope tables on the weights' device and dtype."""
        w = self.tok_embeddings.weight
        a = self.args
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, a.n_kv_heads, max_seq_len, a.head_dim,
                                               w.dtype, w.device)
        cos, sin = rope_cos_sin(a, max_seq_len, w.device)
        self.register_buffer("rope_cos", cos.to(w.dtype), persistent=False)  # [T, hd]
        self.register_buffer("rope_sin", sin.to(w.dtype), persistent=False)
        self.register_buffer("slots", torch.arange(max_seq_len, device=w.device), persistent=False)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """tokens, input_pos: [B, S] -> final hidden states [B, S, D].

        Attends over cache slots `[0, kv_len)`; slot j is visible to a query at position p iff j <= p.
        """
        mask = (self.slots[:kv_len].view(1, 1, kv_len) <= input_pos.unsqueeze(-1)).unsqueeze(1)  # [B,1,S,L]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [B, S, hd]
        x = self.tok_embeddings(tokens)  # [B, S, D]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos, kv_len)
        return self.norm(x)

    def head(self) -> nn.Module:
        """The LM head's layer: over the embedding matrix when tied."""
        return self.tied_head[0] if self.output is None else self.output

    def logits(self, h: torch.Tensor, linear: LinearFn = torch_linear) -> torch.Tensor:
        # h: [..., D] -> float32 logits [..., V]
        return linear(self.head(), h).float()


def engine_param_names(args: ModelArgs) -> list[str]:
    """Every tensor name an engine checkpoint of `args` must hold."""
    names = ["tok_embeddings.weight", "norm.weight"]
    if not args.tie_word_embeddings:
        names.append("output.weight")
    for i in range(args.n_layers):
        p = f"layers.{i}."
        names += [p + "attention.wqkv.weight", p + "attention.wo.weight", p + "feed_forward.w13.weight",
                  p + "feed_forward.w2.weight", p + "attention_norm.weight", p + "ffn_norm.weight"]
        if args.qkv_bias:
            names.append(p + "attention.wqkv.bias")
        if args.o_bias:
            names.append(p + "attention.wo.bias")
    return names


def prefill(model: Transformer, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Batched prefill from position 0 of right-padded prompts -> logits of each last token [B, V].

    tokens: [B, S] (row b real for its first lengths[b] tokens); padding writes cache slots that
    decode overwrites before they become visible.
    """
    bsz, seqlen = tokens.shape
    input_pos = torch.arange(seqlen, device=tokens.device).expand(bsz, seqlen)  # [B, S]
    h = model(tokens, input_pos, seqlen)  # [B, S, D]
    last = h[torch.arange(bsz, device=tokens.device), lengths - 1]  # [B, D]
    return model.logits(last)


def _rope_1(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, H, hd]; cos, sin: [N, hd]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _linear_of(gemm_impl: str, pdl: bool) -> LinearFn:
    """The static step's products: the layers' references for `REFERENCE_GEMM`, else the layers themselves."""
    if gemm_impl == REFERENCE_GEMM:
        return reference_linear
    return lambda module, x: module(x, pdl=pdl)


def _parts_of(gemm_impl: str, pdl: bool) -> LinearFn:
    """`_linear_of` as split-K partial products [P, M, N] (P = 1 for the references)."""
    if gemm_impl == REFERENCE_GEMM:
        return lambda module, x: module.reference(x).unsqueeze(0)
    return lambda module, x: module.parts(x, pdl=pdl)


def gemm_impl_of(model: Transformer, gemm: str | None = None) -> str:
    """How the decode step multiplies by its weights: `gemm` if given, else the model's options' `decode_gemm`
    (the layers' own GEMMs; `REFERENCE_GEMM`: their references)."""
    return gemm or model.options.decode_gemm


def decode_step(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int,
                gemm: str | None = None, pdl: bool = False) -> torch.Tensor:
    """One decode step of cache rows [0, B): tokens, input_pos: [B] -> float32 logits [B, V]
    (`decode_hidden`, then the LM head)."""
    hidden = decode_hidden(model, tokens, input_pos, kv_len, gemm, pdl)
    return model.logits(hidden, _linear_of(gemm_impl_of(model, gemm), pdl))


class DecodeInputs(NamedTuple):
    """What every layer of one decode step reads beside its weights and its input (`decode_start`)."""

    input_pos: torch.Tensor  # [B]
    rows: torch.Tensor  # [B] arange: the cache rows written
    lengths: torch.Tensor | None  # [B] visible positions of each row (the fused attention)
    cos: torch.Tensor | None  # [B, hd] (the rotary embedding outside the attention kernel)
    sin: torch.Tensor | None
    neg: torch.Tensor | None  # [B, 1, 1, L] additive mask (the matmul attention)
    rope_cos: torch.Tensor  # [T, hd] tables (the rotary embedding inside the attention kernel)
    rope_sin: torch.Tensor
    fused: bool  # attention by `decode_attention`
    rope_fused: bool  # ... with the rotary embedding and the K/V write inside its kernel


LayerFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
HeadFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
StartFn = Callable[..., tuple[DecodeInputs, torch.Tensor]]


def decode_start(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int
                 ) -> tuple[DecodeInputs, torch.Tensor]:
    """The per-step tensors every layer of `decode_layers` reads, computed once, and the tokens' embeddings
    [B, D] (the first layer's input)."""
    bsz = tokens.shape[0]
    rows = torch.arange(bsz, device=tokens.device)
    fused = model.options.decode_attention == "triton"
    rope_fused = False
    lengths = cos = sin = neg = None
    if fused:
        from serving.engine.decode_attention import triton_available

        lengths = input_pos + 1
        rope_fused = tokens.is_cuda and triton_available() and model.options.decode_rope_fused
    else:
        visible = model.slots[:kv_len].unsqueeze(0) <= input_pos.unsqueeze(1)  # [B, L]
        neg = torch.zeros(visible.shape, dtype=torch.float32, device=tokens.device).masked_fill(
            ~visible, float("-inf")).view(bsz, 1, 1, kv_len)
    if not rope_fused:
        cos, sin = model.rope_cos[input_pos], model.rope_sin[input_pos]  # [B, hd]
    inputs = DecodeInputs(input_pos, rows, lengths, cos, sin, neg, model.rope_cos, model.rope_sin, fused, rope_fused)
    # F.embedding of the weight, not the module: dynamo traces nn.Embedding's unused float `norm_type` as a
    # tensor, fails to, and restarts the whole trace (one more trace of the step at every load)
    return inputs, F.embedding(tokens, model.tok_embeddings.weight)


def decode_layer(layer: TransformerBlock, x: torch.Tensor, delta: torch.Tensor | None, inputs: DecodeInputs,
                 kv_len: int, gemm_impl: str, pdl: bool, gate_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a decode step, its bounds moved by one residual add: (x, delta) -> (x', delta'), where the
    layer's input is x + the sum of delta (the previous layer's MLP output as split-K partial products
    [P, B, D], the layers' `parts`; None for the first layer), x' is that plus the attention output and
    delta' the MLP's partials, so the layer's output is x' + sum(delta').

    When each layer is compiled on its own (`cuda_graphs.compiled_parts`), the partials' sum and the residual add
    at the start stay in one kernel with this layer's RMSNorm, as they are when the whole step is compiled; the
    additions are the ones `forward` makes, in its order and precision."""
    if delta is not None:
        x = x + sum_partials(delta, x.dtype)
    a = layer.attention.args
    bsz = x.shape[0]
    scale = 1.0 / math.sqrt(a.head_dim)
    attn, cache = layer.attention, layer.attention.kv_cache
    linear, partials = _linear_of(gemm_impl, pdl), _parts_of(gemm_impl, pdl)
    h = layer.attention_norm(x)
    if inputs.rope_fused:  # the kernel sums the projection's split-K partials itself
        from serving.engine.decode_attention import decode_attention_rope

        qkv = partials(attn.wqkv, h)  # [P, B, (H + 2 Hkv) hd]
        y = decode_attention_rope(qkv, inputs.rope_cos, inputs.rope_sin, cache.k_cache, cache.v_cache,
                                  inputs.lengths, kv_len, scale, pdl=pdl)
    else:
        q, k, v = linear(attn.wqkv, h).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = _rope_1(q.view(bsz, a.n_heads, a.head_dim), inputs.cos, inputs.sin)  # [B, H, hd]
        k = _rope_1(k.view(bsz, a.n_kv_heads, a.head_dim), inputs.cos, inputs.sin)  # [B, Hkv, hd]
        cache.k_cache[inputs.rows, :, inputs.input_pos] = k
        cache.v_cache[inputs.rows, :, inputs.input_pos] = v.view(bsz, a.n_kv_heads, a.head_dim)
        qg = q.view(bsz, a.n_kv_heads, a.n_heads // a.n_kv_heads, a.head_dim)  # [B, Hkv, G, hd]
        if inputs.fused:  # reads each row's filled prefix only
            from serving.engine.decode_attention import decode_attention

            y = decode_attention(qg, cache.k_cache, cache.v_cache, inputs.lengths, kv_len, scale)
        else:
            keys = cache.k_cache[:bsz, :, :kv_len]  # [B, Hkv, L, hd] (strided view, no copy)
            values = cache.v_cache[:bsz, :, :kv_len]
            scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale + inputs.neg  # [B, Hkv, G, L]
            probs = scores.softmax(dim=-1).to(values.dtype)
            y = torch.matmul(probs, values)  # [B, Hkv, G, hd]
    x = x + linear(attn.wo, y.reshape(bsz, a.q_size))
    mlp, h = layer.feed_forward, layer.ffn_norm(x)
    if gemm_impl == REFERENCE_GEMM:
        return x, mlp.reference(h).unsqueeze(0)
    return x, mlp.w2.parts(mlp.gated(h, pdl), pdl)


def decode_layers(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int,
                  gemm_impl: str, pdl: bool, layer_fn: LayerFn = decode_layer, start_fn: StartFn = decode_start
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of one decode step of cache rows [0, B): tokens, input_pos: [B] -> (x, delta) of the last
    layer (`decode_layer`; its output is x + delta).

    Row b writes its K/V at `input_pos[b]` and attends over cache positions `[0, kv_len)` masked to
    `<= input_pos[b]`; `kv_len` must exceed every `input_pos`. Shapes depend only on (B, kv_len) and
    there is no host sync: CUDA-graph and torch.compile friendly. `gemm_impl` ("torch" | "triton") is how
    the step multiplies by its weights (`gemm_impl_of`). `pdl` launches the step's own Triton kernels (skinny
    GEMMs, the attention with its rotary embedding) with programmatic dependent launch (CUDA, compute
    capability 9.0 or later: `serving.engine.pdl`). `layer_fn` runs one layer (`decode_layer`, or a compile
    of it), `start_fn` the step's start (`decode_start`, or a compile of it)."""
    inputs, x = start_fn(model, tokens, input_pos, kv_len)
    gate_up, delta = model.options.decode_gate_up, None
    for layer in model.layers:
        x, delta = layer_fn(layer, x, delta, inputs, kv_len, gemm_impl, pdl, gate_up)
    return x, delta


def decode_hidden(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int,
                  gemm: str | None = None, pdl: bool = False) -> torch.Tensor:
    """The layers and the final norm of one decode step (`decode_layers`) -> hidden states [B, D]. `gemm`
    (`REFERENCE_GEMM`: the layers' references) overrides the model's options."""
    x, delta = decode_layers(model, tokens, input_pos, kv_len, gemm_impl_of(model, gemm), pdl)
    return model.norm(x + sum_partials(delta, x.dtype))


def greedy_tokens(logits: torch.Tensor, chunks: int = 64) -> torch.Tensor:
    """logits.argmax(-1) of [B, V] in two reductions: the max of each of `chunks` slices of the vocabulary,
    then the best slice. One argmax kernel gives each row one program: 30 us for a row of 128256 on an
    H200, where the two stages spread over B x chunks programs. Ties go to the lowest index, as argmax's."""
    bsz, vocab = logits.shape
    per = -(-vocab // chunks)
    padded = F.pad(logits, (0, per * chunks - vocab), value=float("-inf")).view(bsz, chunks, per)
    best, where = padded.max(dim=-1)  # [B, chunks]
    chunk = best.argmax(dim=-1, keepdim=True)  # [B, 1]
    return (chunk * per + where.gather(-1, chunk)).squeeze(-1)


def decode_head(norm: RMSNorm, head: nn.Module, x: torch.Tensor, delta: torch.Tensor, gemm_impl: str, pdl: bool,
                lm_greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The final norm of the last layer's output x + delta and the LM head -> (logits [B, V], greedy tokens
    [B]). Where the LM head has a tuned one-slice kernel (`lm_head`), its logits stay in the model's dtype
    and the kernel finds the tokens; else they are float32 and `greedy_tokens` finds them."""
    hidden = norm(x + sum_partials(delta, x.dtype))
    if gemm_impl == "triton" and lm_greedy and not isinstance(head, QuantLinear):
        from serving.engine.linear_routes import Skinny, pick
        from serving.engine.lm_head import lm_head_greedy

        route = pick(head.routes, hidden)  # the head's tuned kernel, if it is a one-slice "dot" config
        config = route.config if isinstance(route, Skinny) and route.config.kernel == "dot" else None
        if config is not None and config.split == 1:
            return lm_head_greedy(hidden, head.weight, config, pdl=pdl)
    logits = _linear_of(gemm_impl, pdl)(head, hidden).float()
    return logits, greedy_tokens(logits)


class StepParts(NamedTuple):
    """How `decode_step_greedy` runs its start, a layer and the head: the plain functions, or a compile of each."""

    start: StartFn = decode_start
    layer: LayerFn = decode_layer
    head: HeadFn = decode_head


PLAIN_STEP = StepParts()


def decode_step_greedy(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int,
                       gemm: str | None = None, pdl: bool = False, parts: StepParts = PLAIN_STEP
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_step` -> (logits [B, V], each row's greedy next token [B]) (`decode_head`), compiled as one
    function or, through `parts`, one layer and the head on their own (aten's argmax after the compiled
    step took 27-37 us on an H200, up to 2.8% of a Llama-1B step)."""
    gemm_impl = gemm_impl_of(model, gemm)
    x, delta = decode_layers(model, tokens, input_pos, kv_len, gemm_impl, pdl, parts.layer, parts.start)
    return parts.head(model.norm, model.head(), x, delta, gemm_impl, pdl, model.options.decode_lm_greedy)


def packed_index(prompts: list[list[int]] | list[tuple[int, ...]], rows: list[int]) -> torch.Tensor:
    """The inputs of `prefill_packed` as one host tensor (one copy to the device, no host sync):
    [tokens (T) | position of each token (T) | cache row of each token (T) | each prompt's last token (N)]."""
    lengths = [len(p) for p in prompts]
    total = sum(lengths)
    out = torch.empty(3 * total + len(lengths), dtype=torch.long)
    out[:total] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    out[total:2 * total] = torch.cat([torch.arange(n) for n in lengths])
    out[2 * total:3 * total] = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor(lengths))
    out[3 * total:] = torch.cumsum(torch.tensor(lengths), 0) - 1
    return out


def prefill_packed(model: Transformer, index: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Prefill prompts packed back to back, each from position 0 into its own cache row.

    index: `packed_index` of the prompts and their cache rows, on the model's device -> float32 logits
    of each prompt's last token [N, V]. Attention is per prompt (causal), so no work is spent on
    padding; nothing here waits for the device.
    """
    a = model.args
    n = len(lengths)
    total = sum(lengths)
    tokens, pos, row_of, last = index.split([total, total, total, n])
    group = a.n_heads // a.n_kv_heads
    equal = all(length == lengths[0] for length in lengths)
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]  # [T, hd]
    x = model.tok_embeddings(tokens)  # [T, D]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    for layer in model.layers:
        attn = layer.attention
        h = layer.attention_norm(x)
        q, k, v = attn.wqkv(h).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = _rope_1(q.view(total, a.n_heads, a.head_dim), cos, sin)  # [T, H, hd]
        k = _rope_1(k.view(total, a.n_kv_heads, a.head_dim), cos, sin)  # [T, Hkv, hd]
        v = v.view(total, a.n_kv_heads, a.head_dim)
        attn.kv_cache.k_cache[row_of, :, pos] = k
        attn.kv_cache.v_cache[row_of, :, pos] = v
        if group > 1:  # expand K/V heads so SDPA can take its flash kernel
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if equal:
            s = lengths[0]
            y = sdpa(
                q.view(n, s, a.n_heads, a.head_dim).transpose(1, 2), k.view(n, s, a.n_heads, a.head_dim).transpose(1, 2),
                v.view(n, s, a.n_heads, a.head_dim).transpose(1, 2), is_causal=True,
            ).transpose(1, 2).reshape(total, a.q_size)  # [T, H * hd]
        else:
            parts = []
            for i in range(n):
                lo, hi = bounds[i], bounds[i + 1]
                parts.append(sdpa(
                    q[lo:hi].transpose(0, 1).unsqueeze(0), k[lo:hi].transpose(0, 1).unsqueeze(0),
                    v[lo:hi].transpose(0, 1).unsqueeze(0), is_causal=True,
                )[0].transpose(0, 1).reshape(hi - lo, a.q_size))
            y = torch.cat(parts, dim=0)
        x = x + attn.wo(y)
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.logits(model.norm(x[last]))


def decode_one_token(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """One decode step for the whole batch: tokens, input_pos: [B] -> logits [B, V].

    Static shapes for a given B (attends over the whole cache): compile/CUDA-graph friendly.
    """
    h = model(tokens.unsqueeze(1), input_pos.unsqueeze(1), model.max_seq_len)  # [B, 1, D]
    return model.logits(h[:, 0])
