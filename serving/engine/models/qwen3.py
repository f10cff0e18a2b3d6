"""The Qwen3 family (`Qwen3ForCausalLM`): Llama's layer with an RMSNorm over each query and key head before the
rotary embedding, no q/k/v bias by default, a `head_dim` of its own (not hidden_size / heads).

The layer loop, the reference `forward` and the serving `step` are `models.llama`'s: only the attention differs
(`Qwen3Attention.norm_heads`), and both paths go through it, the reference on [B, S, H, hd] and every serving
step (`step.MixedStep`, `cuda_graphs.DecodeStep`, CUDA graphs included) on the projection [T, (H + 2 Hkv) hd]
before `StepContext.attend` rotates it (`Qwen3Attention.qkv`). The norms are `model.RMSNorm`s of `head_dim`;
on eager half-precision GPU work a step runs both as one kernel, in place on the projection (`head_norm`),
elsewhere as the modules' torch ops.

Families built on Qwen3's attention (Qwen3-MoE; Gemma 3, with norms of its own) import `Qwen3Attention` from here.

Registered in `models.registry.ARCHITECTURES`. Imports: stdlib and torch only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from serving.engine import head_norm
from serving.engine.model import ModelArgs, RMSNorm, StepContext
from serving.engine.models import llama
from serving.engine.parallel import SINGLE, ParallelConfig

HF_TO_ENGINE: dict[str, tuple[str, int, int]] = {
    **llama.HF_TO_ENGINE,
    "model.layers.{i}.self_attn.q_norm.weight": ("layers.{i}.attention.q_norm.weight", 0, 1),
    "model.layers.{i}.self_attn.k_norm.weight": ("layers.{i}.attention.k_norm.weight", 0, 1),
}
IGNORED_HF_TENSORS = llama.IGNORED_HF_TENSORS


def read_config(config: dict[str, Any], *, architecture: str, source: str = "config.json") -> ModelArgs:
    """The `ModelArgs` of a Qwen3 `config.json` dict: Llama's reader, with the sliding window only where
    `use_sliding_window` turns it on (Qwen3 configs carry a `sliding_window` value either way)."""
    if not config.get("use_sliding_window", False):
        config = {**config, "sliding_window": None}
    return llama.read_config(config, architecture=architecture, source=source)


def engine_param_names(args: ModelArgs) -> list[str]:
    """Every tensor name an engine checkpoint of `args` must hold: Llama's and each layer's two head norms."""
    names = llama.engine_param_names(args)
    for i in range(args.n_layers):
        names += [f"layers.{i}.attention.q_norm.weight", f"layers.{i}.attention.k_norm.weight"]
    return names


class Qwen3Attention(llama.Attention):
    """Llama's attention with `q_norm` and `k_norm`, RMSNorms of `head_dim` applied to every head of q and k
    before the rotary embedding."""

    head_norm_class: type[nn.Module] = RMSNorm  # a family of other head norms overrides it (`models.gemma3`)
    head_norm_unit_offset = False  # the kernel's norm by `1 + w` (`head_norm`), for such a family's norms

    def __init__(self, args: ModelArgs, parallel: ParallelConfig = SINGLE) -> None:
        super().__init__(args, parallel)
        self.q_norm = self.head_norm_class(args.head_dim, args.norm_eps)
        self.k_norm = self.head_norm_class(args.head_dim, args.norm_eps)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q, pdl=pdl), self.k_norm(k, pdl=pdl)

    def qkv(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        a = self.args
        qkv = super().qkv(h, ctx)  # [T, (H + 2 Hkv) hd]
        if qkv.is_cuda and not torch.compiler.is_compiling() and head_norm.fits(qkv, self.q_norm.weight,
                                                                                 self.k_norm.weight):
            return head_norm.norm_heads_(qkv, self.q_norm.weight, self.k_norm.weight, n_heads=a.n_heads,
                                         n_kv_heads=a.n_kv_heads, eps=self.q_norm.eps, pdl=ctx.pdl,
                                         unit_offset=self.head_norm_unit_offset)  # one kernel
        return self.norm_projection(qkv, ctx.pdl)

    def norm_projection(self, qkv: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """The projection qkv [T, (H + 2 Hkv) hd] with each q and k head through its norm module (`norm_heads`), v
        as it is."""
        a = self.args
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)  # [T, H hd], [T, Hkv hd] x2
        q, k = self.norm_heads(q.unflatten(-1, (a.n_heads, a.head_dim)), k.unflatten(-1, (a.n_kv_heads, a.head_dim)),
                               pdl=pdl)
        return torch.cat([q.flatten(-2), k.flatten(-2), v], dim=-1)  # [T, (H + 2 Hkv) hd]


class Qwen3Block(llama.TransformerBlock):
    attention_class = Qwen3Attention


class Qwen3Transformer(llama.Transformer):
    """Llama's model over Qwen3's layers."""

    block_class = Qwen3Block
