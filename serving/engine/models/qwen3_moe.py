"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (`models.qwen3`: an RMSNorm over each query and key head
before the rotary embedding) with a mixture of experts as the MLP (`models.moe`: softmax over the router logits,
top-k, the k weights renormalized only when `norm_topk_prob`).

Dense layers: a layer listed in `mlp_only_layers`, or one whose number plus one is not a multiple of
`decoder_sparse_step`, has the dense MLP (`intermediate_size` wide, Llama's `FeedForward`), as Hugging Face builds
it; the others a mixture of `num_experts` experts of `moe_intermediate_size`. The layer computation is Qwen3's
(`qwen3.Qwen3Block`, Llama's reference `forward` and serving `step`). Weight names: the published checkpoints hold
each expert apart (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`) and the router as `mlp.gate`; the
converter stacks the experts (`convert.map_hf_name`). transformers >= 5's stacked layout (`mlp.experts.gate_up_proj`
[E, 2I, D], `mlp.experts.down_proj` [E, D, I]) is read too.

Registered in `models.registry.ARCHITECTURES`. Imports: stdlib and torch only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.engine.model import ModelArgs
from serving.engine.models import qwen3
from serving.engine.models.moe import MoETransformer, moe_fields, moe_param_names

HF_TO_ENGINE: dict[str, tuple[str, int, int]] = {
    **qwen3.HF_TO_ENGINE,  # (its MLP rows: the dense layers')
    "model.layers.{i}.mlp.gate.weight": ("layers.{i}.feed_forward.gate.weight", 0, 1),
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": ("layers.{i}.feed_forward.w13.weight", 0, 2),
    "model.layers.{i}.mlp.experts.{e}.up_proj.weight": ("layers.{i}.feed_forward.w13.weight", 1, 2),
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight": ("layers.{i}.feed_forward.w2.weight", 0, 1),
    # transformers >= 5's own layout
    "model.layers.{i}.mlp.experts.gate_up_proj": ("layers.{i}.feed_forward.w13.weight", 0, 1),
    "model.layers.{i}.mlp.experts.down_proj": ("layers.{i}.feed_forward.w2.weight", 0, 1),
}
IGNORED_HF_TENSORS = qwen3.IGNORED_HF_TENSORS


def read_config(config: dict[str, Any], *, architecture: str, source: str = "config.json") -> ModelArgs:
    """Qwen3's fields (`qwen3.read_config`) and the experts': `num_experts` (`num_local_experts` as transformers 5
    writes it), `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`, and the dense layers
    (`mlp_only_layers`, `decoder_sparse_step`)."""
    args = qwen3.read_config(config, architecture=architecture, source=source)
    step = int(config.get("decoder_sparse_step") or 1)
    only = {int(i) for i in config.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(args.n_layers) if i in only or (i + 1) % step != 0)
    n_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return dataclasses.replace(args, **moe_fields(
        n_experts=int(n_experts), top_k=int(config["num_experts_per_tok"]), inter=int(config["moe_intermediate_size"]),
        renormalize=bool(config.get("norm_topk_prob", False)), dense_layers=dense, source=source))


def engine_param_names(args: ModelArgs) -> list[str]:
    """Qwen3's tensors, and each mixture-of-experts layer's router."""
    return qwen3.engine_param_names(args) + [n for i in range(args.n_layers) for n in moe_param_names(args, i)]


class Transformer(MoETransformer):
    """Qwen3's layers, with a mixture of experts as the MLP of the sparse ones."""

    block_class = qwen3.Qwen3Block
