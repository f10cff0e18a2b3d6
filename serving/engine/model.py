"""What every model family of the `torch` engine shares: model args, rotary embeddings, RMSNorm, how a step
multiplies by a weight, and the step's context (the attention metadata).

The families themselves live in `serving.engine.models` (one file each, registered by architecture name in
`models.registry`); `models/llama.py` serves Llama, Mistral and Qwen2. A family's model has a reference
`forward(tokens [B, S])` (whole sequences, no cache: what the tests compare against) and a serving
`step(tokens [T], ctx)`, which every serving step runs with its `StepContext`: `step.MixedStep` (prompt chunks and
decodes packed) or `cuda_graphs.DecodeStep` (one token a row, under CUDA graphs). The engine speaks token ids,
not text.

Imports: stdlib and torch only (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from serving.engine import row_norm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    """Shape and numerics of the model; everything `Transformer` needs, nothing else."""

    architecture: str  # a key of models.registry.ARCHITECTURES
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
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES, or "longrope" (models.phi3)
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # keys a query sees: its own position and the window - 1 before it
    layer_windows: tuple[int | None, ...] = ()  # per layer: its window (None: global); empty: sliding_window for all
    local_rope_theta: float | None = None  # windowed layers' rope base, default rope (Gemma 3); None: the global rope
    attn_scale: float | None = None  # the softmax scale (Gemma's query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    rope_short_factor: tuple[float, ...] = ()  # longrope: each frequency's divisor (HF's up to the original context)
    rope_attention_factor: float = 1.0  # cos and sin scaled by it (longrope)
    # mixtures of experts (`models.moe`): n_experts 0 is a dense model
    n_experts: int = 0
    n_experts_per_tok: int = 0  # the top-k each token is routed to
    moe_intermediate_size: int = 0  # each expert's MLP width
    moe_renormalize: bool = True  # the top-k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model whose MLP is dense (intermediate_size)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_short_factor", tuple(self.rope_short_factor))  # a JSON list when read back
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer not in self.dense_layers

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

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`: a query at position p sees keys at (p - window, p]; None: all."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window every layer's keys stay visible in (the largest layer window), when every layer has one: a
        sequence's positions older than that are read by no layer (their blocks can go back to the pool); None
        when some layer is global."""
        windows = [self.window(i) for i in range(self.n_layers)]
        return None if None in windows else max(windows)

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` rotates by the local rope (`local_rope_theta`) rather than the global one."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown model args {unknown} (known: {sorted(names)})")
        return cls(**d)


LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's `layer_types` entries the engine serves


def windows_of_layer_types(layer_types: list[str], window: int, n_layers: int, *, source: str
                           ) -> tuple[int | None, ...]:
    """HF's `layer_types` (one a layer) -> `ModelArgs.layer_windows`: `window` for a sliding layer, None for a
    global one; another type or count raises ValueError naming it."""
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types in {source} has {len(layer_types)} entries for num_hidden_layers={n_layers}")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} in {source} are not supported; supported: {list(LAYER_TYPES)}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


# ---------------------------------------------------------------------------------------------
# rotary embeddings


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (float32), with linear, llama3 or longrope scaling applied."""
    d = args.head_dim
    if args.rope_type == "longrope":  # its short factors, computed as HF computes them
        factors = torch.tensor(args.rope_short_factor, dtype=torch.float32)
        return 1.0 / (factors * args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
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


def rope_cos_sin(args: ModelArgs, max_seq_len: int, device: torch.device, *, local: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables: `[max_seq_len, head_dim]` float32 (HF layout: the half-table repeated), times the
    attention factor (longrope's; 1 otherwise); `local`: of the windowed layers' own rope
    (`ModelArgs.local_rope_theta`, no scaling)."""
    if local:
        args = dataclasses.replace(args, rope_theta=args.local_rope_theta, rope_type="default", rope_short_factor=(),
                                   rope_attention_factor=1.0)
    inv_freq = rope_inv_freq(args).to(device)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [T, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos() * args.rope_attention_factor, emb.sin() * args.rope_attention_factor


def layer_rope(args: ModelArgs, layer: int, rope: tuple[torch.Tensor, torch.Tensor],
               local_rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos, sin tables layer `layer` rotates by: `rope`, or for a layer of the local rope `local_rope`."""
    if not args.local_rope(layer):
        return rope
    if local_rope is None:
        raise ValueError(f"layer {layer} of {args.architecture} rotates by the local rope (theta "
                         f"{args.local_rope_theta}) but the step was given no local_rope tables")
    return local_rope


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, S, H, hd]; cos, sin: [B, S, hd] (already in x.dtype)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# the transformer


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


@dataclass
class StepContext:
    """What the layers of one serving step read besides their weights (the attention metadata): whether they
    multiply through the GEMMs their layers picked at load or through the layers' dequantizing references
    (`reference`: what the decode step is checked against), whether the engine's kernels launch with
    programmatic dependent launch (`pdl`) and leave their rows scaled for an FP8 GEMM (`qkv_e4m3`, `w13_e4m3`:
    `linear_quantized.prescale_rows_for`), and the attention path: `attend` and `last_hidden`, a subclass's
    (`step.MixedStep`: prompt chunks and decodes packed; `cuda_graphs.DecodeStep`: one token a row,
    capturable)."""

    reference: bool
    pdl: bool
    qkv_e4m3: bool
    w13_e4m3: bool

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x through `layer`: its own GEMM for x's rows, or its reference."""
        return layer.reference(x) if self.reference else layer(x, pdl=self.pdl)

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """The step's tokens' qkv projection [T, (H + 2 Hkv) hd] of layer `layer` -> attention output [T, H hd]
        (rotary embedding applied, K/V written to the cache)."""
        raise NotImplementedError

    def last_hidden(self, norm: RMSNorm, x: torch.Tensor, ff: torch.Tensor) -> torch.Tensor:
        """The last layer's residual stream x and MLP output ff [T, D] -> the final norm of the rows whose
        logits the step returns."""
        raise NotImplementedError


def _rope_1(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, H, hd]; cos, sin: [N, hd]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
