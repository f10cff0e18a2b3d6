"""A model's linear layers: the quantized ones put in place before the weights load
(`install_quantized_linears`), then the options applied (`apply_options`): every linear layer picks its GEMMs
for them (`linear_float`, `linear_fp8`, `linear_int8`), and the model keeps them for its step
(`Transformer.options`).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.engine.linear_float import Routed
from serving.engine.linear_fp8 import Fp8Linear
from serving.engine.linear_fp8_block import Fp8BlockLinear
from serving.engine.linear_int8 import Int8Linear
from serving.engine.models.llama import Transformer
from serving.engine.models.moe import ExpertWeights, MoEFeedForward
from serving.engine.options import EngineOptions
from serving.engine.quantize import FP8, INT8_WEIGHT_ONLY, QuantInfo


def apply_options(model: Transformer, options: EngineOptions) -> Transformer:
    """Set `options` on `model` and on each of its linear layers (the tied LM head too), after its weights are
    loaded and on their device. Returns the model."""
    layers: list[Routed] = [m for m in model.modules() if isinstance(m, Routed)]
    if model.output is None:
        layers.append(model.head())
    for layer in layers:
        layer.apply_options(options)
    for moe in (m for m in model.modules() if isinstance(m, MoEFeedForward)):  # how its experts run
        moe.apply_options(options)
    model.options = options
    return model


def install_quantized_linears(model: nn.Module, info: QuantInfo, *, n_layers: int, tie_word_embeddings: bool,
                              dtype: torch.dtype) -> None:
    """Replace the modules that `info` quantizes with the method's layer (`linear_fp8.Fp8Linear`,
    `linear_int8.Int8Linear`; `linear_fp8_block.Fp8BlockLinear` for block scales; stacked experts: their
    quantized twin) of the same shape (on the model's device, meta included), before the quantized state dict is
    loaded."""
    layer_of = {FP8: Fp8Linear, INT8_WEIGHT_ONLY: Int8Linear}
    for name in info.quantized_modules(n_layers, tie_word_embeddings=tie_word_embeddings):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        if isinstance(old, ExpertWeights):  # a mixture of experts' stacked weights (`models.moe`)
            setattr(parent, child, old.quantized(info.method, dtype))
            continue
        with torch.device(old.weight.device):
            if info.block is not None:  # a block-wise FP8 checkpoint's scales
                new = Fp8BlockLinear(old.in_features, old.out_features, block=info.block, bias=old.bias is not None,
                                     dtype=dtype)
            else:
                new = layer_of[info.method](old.in_features, old.out_features, bias=old.bias is not None,
                                            dtype=dtype)
        setattr(parent, child, new)
