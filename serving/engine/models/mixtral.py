"""Mixtral (`MixtralForCausalLM`): Llama's attention and layer with every MLP a mixture of experts (`models.moe`:
softmax over the router logits, top-k, the k weights renormalized to sum to 1).

The layer computation is Llama's (`llama.TransformerBlock`: its reference `forward` and its serving `step`), with
`moe.MoEFeedForward` as its MLP. Weight names: a Hugging Face Mixtral checkpoint holds each expert apart
(`block_sparse_moe.experts.{e}.w1` gate, `w3` up, `w2` down) and the router as `block_sparse_moe.gate`; the
converter stacks the experts (`convert.map_hf_name`: an `{e}` in a table key is the expert index). The layout that
transformers >= 5 writes itself (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]) is read
too: the same rows, already stacked.

Registered in `models.registry.ARCHITECTURES`. Imports: stdlib and torch only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.engine.model import ModelArgs
from serving.engine.models import llama
from serving.engine.models.moe import MoETransformer, moe_fields, moe_param_names

_LLAMA_MLP = ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight",
              "model.layers.{i}.mlp.down_proj.weight")
HF_TO_ENGINE: dict[str, tuple[str, int, int]] = {
    **{k: v for k, v in llama.HF_TO_ENGINE.items() if k not in _LLAMA_MLP},
    "model.layers.{i}.block_sparse_moe.gate.weight": ("layers.{i}.feed_forward.gate.weight", 0, 1),
    "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": ("layers.{i}.feed_forward.w13.weight", 0, 2),
    "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight": ("layers.{i}.feed_forward.w13.weight", 1, 2),
    "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": ("layers.{i}.feed_forward.w2.weight", 0, 1),
    # transformers >= 5's own layout
    "model.layers.{i}.mlp.gate.weight": ("layers.{i}.feed_forward.gate.weight", 0, 1),
    "model.layers.{i}.mlp.experts.gate_up_proj": ("layers.{i}.feed_forward.w13.weight", 0, 1),
    "model.layers.{i}.mlp.experts.down_proj": ("layers.{i}.feed_forward.w2.weight", 0, 1),
}


def read_config(config: dict[str, Any], *, architecture: str, source: str = "config.json") -> ModelArgs:
    """Llama's fields (`llama.read_config`) and the experts': `num_local_experts`, `num_experts_per_tok`, each
    expert `intermediate_size` wide, always renormalized."""
    args = llama.read_config(config, architecture=architecture, source=source)
    return dataclasses.replace(args, **moe_fields(
        n_experts=int(config["num_local_experts"]), top_k=int(config["num_experts_per_tok"]),
        inter=int(config["intermediate_size"]), renormalize=True, source=source))


def engine_param_names(args: ModelArgs) -> list[str]:
    """Llama's tensors, and each layer's router."""
    return llama.engine_param_names(args) + [n for i in range(args.n_layers) for n in moe_param_names(args, i)]


class Transformer(MoETransformer):
    """Llama's model with a mixture of experts as each layer's MLP."""
