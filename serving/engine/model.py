"""The transformer of the `torch` engine: model args, rotary embeddings, the layers and a reference forward.

A Llama-family decoder (Llama 2/3, Mistral, Qwen2) in the layout of pytorch-labs/gpt-fast: fused `wqkv` and
`w13` projections, rotary embeddings in the Hugging Face "rotate half" layout (so HF weights need no
permutation). The engine speaks token ids, not text: tokenization lives with the caller.

The layer computation is written twice, on purpose: `Transformer.forward(tokens [B, S])` is the reference
(whole sequences from position 0, causal, no cache: the plain computation the steps are tested against), and
`Transformer.step(tokens [T], ctx)` / `TransformerBlock.step` is what serves, over the paged KV cache. Every
serving step runs the same `step`; its `StepContext` (the attention metadata) decides the attention path and
how the layers multiply: `step.MixedStep` for prompt chunks and decodes packed together (`step.paged_forward`),
`cuda_graphs.DecodeStep` for one token a row under CUDA graphs (`cuda_graphs.paged_decode_logits`).

Imports: stdlib and torch only (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine import row_norm, silu_mul
from serving.engine.errors import UnsupportedArchitectureError
from serving.engine.partials import sum_partials
from serving.engine.quantize import QuantLinear, prescale_rows_for

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
# the transformer


MAX_DECODE_KERNEL_ROWS = 64  # skinny_gemm.MAX_ROWS: more rows and a quantized layer runs its own GEMM
REFERENCE_GEMM = "reference"  # a decode `gemm`: F.linear, quantized layers dequantized (the checks' reference)
LinearFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (nn.Linear or tied nn.Embedding, x) -> x W^T + b


def torch_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x W^T (+ b) by F.linear, for an nn.Linear or the tied embedding matrix (no bias); a quantized
    layer's own forward (`QuantLinear`: dequantized, or FP8 tensor-core GEMMs)."""
    if isinstance(module, QuantLinear):
        return module(x)
    return F.linear(x, module.weight, getattr(module, "bias", None))


def reference_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`torch_linear` with a quantized layer's dequantizing reference (weight-only numerics at every row
    count): what the decode step is checked against (`decode_step(..., gemm=REFERENCE_GEMM)`)."""
    if isinstance(module, QuantLinear):
        return module.reference(x)
    return torch_linear(module, x)


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
        self.wqkv = nn.Linear(args.dim, args.qkv_size, bias=args.qkv_bias)
        self.wo = nn.Linear(args.q_size, args.dim, bias=args.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The reference attention: causal over the whole sequences, no cache. x: [B, S, D]; cos, sin: [B, S, hd]."""
        a = self.args
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = apply_rope(q.view(bsz, seqlen, a.n_heads, a.head_dim), cos, sin)  # [B, S, H, hd]
        k = apply_rope(k.view(bsz, seqlen, a.n_kv_heads, a.head_dim), cos, sin)  # [B, S, Hkv, hd]
        v = v.view(bsz, seqlen, a.n_kv_heads, a.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=a.n_heads != a.n_kv_heads)  # [B, H, S, hd]
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, a.q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)  # [gate; up]
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor, linear: LinearFn = torch_linear, gate_up: LinearFn | None = None
                ) -> torch.Tensor:
        """`gate_up`, when given, computes silu(gate) * up from the w13 module and x itself."""
        return linear(self.w2, self.gated(x, linear, gate_up))

    def gated(self, x: torch.Tensor, linear: LinearFn = torch_linear, gate_up: LinearFn | None = None
              ) -> torch.Tensor:
        """silu(gate) * up, the input of w2; its rows scaled to e4m3 as well where w2's FP8 GEMM would scale
        them in a kernel of its own (`prescale_rows_for`: past the decode rows, where `gate_up` would run w13's
        GEMM and then SiLU * up too)."""
        if prescale_rows_for(self.w2, x.numel() // x.shape[-1], x.device):
            return silu_mul.gated(linear(self.w13, x), self.intermediate_size, e4m3=True)
        if gate_up is not None:
            return gate_up(self.w13, x)
        return silu_mul.gated(linear(self.w13, x), self.intermediate_size)


@dataclass
class StepContext:
    """What the layers of one serving step read besides their weights (the attention metadata): how they
    multiply by a weight (`linear`; `gate_up`: silu(gate) * up in one product, or None), whether the engine's
    kernels launch with programmatic dependent launch (`pdl`) and leave their rows scaled for an FP8 GEMM
    (`qkv_e4m3`, `w13_e4m3`: `quantize.prescale_rows_for`), and the attention path: `attend` and `last_hidden`,
    a subclass's (`step.MixedStep`: prompt chunks and decodes packed; `cuda_graphs.DecodeStep`: one token a
    row, capturable)."""

    linear: LinearFn
    gate_up: LinearFn | None
    pdl: bool
    qkv_e4m3: bool
    w13_e4m3: bool

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """The step's tokens' qkv projection [T, (H + 2 Hkv) hd] of layer `layer` -> attention output [T, H hd]
        (rotary embedding applied, K/V written to the cache)."""
        raise NotImplementedError

    def last_hidden(self, norm: RMSNorm, x: torch.Tensor, ff: torch.Tensor) -> torch.Tensor:
        """The last layer's residual stream x and MLP output ff [T, D] -> the final norm of the rows whose
        logits the step returns."""
        raise NotImplementedError


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The reference layer: x [B, S, D], whole sequences, no cache."""
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def step(self, index: int, x: torch.Tensor, h: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer (number `index`) in a serving step: x [T, D] and h = its attention norm of x -> (x plus the
        attention output, the MLP output). The caller adds the MLP output with the next norm in one pass."""
        y = ctx.attend(index, ctx.linear(self.attention.wqkv, h))  # [T, H hd]
        x, h = self.ffn_norm.add(x, ctx.linear(self.attention.wo, y), pdl=ctx.pdl, e4m3=ctx.w13_e4m3)
        return x, self.feed_forward(h, ctx.linear, ctx.gate_up)


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
        self.output = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reference forward (tests, the plain path the steps are checked against): tokens [B, S], each row
        a whole sequence from position 0, causal, no cache -> final hidden states [B, S, D]."""
        cos, sin = rope_cos_sin(self.args, tokens.shape[1], tokens.device)
        w = self.tok_embeddings.weight
        cos, sin = cos.to(w.dtype).expand(tokens.shape[0], -1, -1), sin.to(w.dtype).expand(tokens.shape[0], -1, -1)
        x = self.tok_embeddings(tokens)  # [B, S, D]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def step(self, tokens: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Every layer of one serving step over the KV cache: tokens [T] -> the final norm of the rows `ctx`
        returns [N, D] (`StepContext.last_hidden`). Each layer's residual add and the next layer's norm run in
        one pass (`RMSNorm.add`)."""
        x = self.tok_embeddings(tokens)  # [T, D]
        layers = self.layers
        h = layers[0].attention_norm(x, pdl=ctx.pdl, e4m3=ctx.qkv_e4m3)
        for i, layer in enumerate(layers):
            x, ff = layer.step(i, x, h, ctx)
            if i + 1 < len(layers):
                x, h = layers[i + 1].attention_norm.add(x, ff, pdl=ctx.pdl, e4m3=ctx.qkv_e4m3)
        return ctx.last_hidden(self.norm, x, ff)

    def head(self) -> nn.Module:
        """The LM head's module: the embedding matrix when tied."""
        return self.tok_embeddings if self.output is None else self.output

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


def _rope_1(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, H, hd]; cos, sin: [N, hd]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _linear_fn(gemm: str, *, parts: bool = False, pdl: bool = False) -> LinearFn:
    """How the decode step multiplies by a weight: "torch" F.linear (cuBLAS, or inductor's fused
    reductions), "triton" the tuned skinny Triton kernels where they beat cuBLAS (`skinny_gemm.TUNED`;
    `pdl`: launched with programmatic dependent launch; fp8 layers of 16+ rows: the FP8 tensor cores),
    `REFERENCE_GEMM` F.linear with quantized layers dequantized. With `parts`, the result is left as split-K
    partial products [P, B, N] for a consumer that sums them (P = 1 for F.linear)."""
    if gemm != "triton":
        one = reference_linear if gemm == REFERENCE_GEMM else torch_linear
        return (lambda module, x: one(module, x).unsqueeze(0)) if parts else one
    from serving.engine.fp8_gemm import fp8_config_for, fp8_partials
    from serving.engine.skinny_gemm import kernel_config, skinny_linear, skinny_linear_parts

    product = skinny_linear_parts if parts else skinny_linear

    def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(module, QuantLinear):
            return product(x, module.weight, getattr(module, "bias", None), pdl=pdl)
        if module.decode_tensor_cores and (fp8 := fp8_config_for(x, module.weight)) is not None:  # split-K FP8 MMAs
            y = fp8_partials(x, module.weight, module.weight_scale, fp8, pdl=pdl)
            return y if parts else sum_partials(y, x.dtype)
        if module.tensor_core_shape(x):  # fp8 of 16+ rows: the FP8 tensor cores
            y = module.tensor_core(x)
        elif kernel_config(x, module.weight) is None:  # more rows than the kernels take: the layer's own GEMM
            y = module(x)
        else:
            return product(x, module.weight, module.bias, pdl=pdl, scale=module.weight_scale)
        return y.unsqueeze(0) if parts else y

    return linear


def _gate_up_fn(gemm: str, *, pdl: bool = False) -> LinearFn | None:
    """The MLP's silu(gate) * up: "triton" through `gate_up.gate_up` (one kernel where tuned), else None
    (the step multiplies by w13 and runs SiLU * up itself)."""
    if gemm != "triton":
        return None
    from serving.engine.fp8_gemm import fp8_config_for, fp8_linear
    from serving.engine.gate_up import gate_up

    def product(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(module, QuantLinear):
            return gate_up(x, module.weight, pdl=pdl)
        if module.decode_tensor_cores and (fp8 := fp8_config_for(x, module.weight)) is not None:  # split-K FP8 MMAs
            both = fp8_linear(x, module.weight, module.weight_scale, config=fp8, pdl=pdl)
        elif module.tensor_core_shape(x):  # fp8 of 16+ rows: the FP8 tensor cores, then SiLU * up
            both = module.tensor_core(x)
        elif x.shape[0] > MAX_DECODE_KERNEL_ROWS:  # the layer's own GEMM, then SiLU * up
            both = module(x)
        else:
            return gate_up(x, module.weight, pdl=pdl, scale=module.weight_scale)
        return silu_mul.gated(both, module.out_features // 2)

    return product
