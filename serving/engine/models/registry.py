"""Hugging Face architecture name -> the engine's model class, its HF -> engine weight-name table and its config
reader (as vLLM's `model_executor/models/registry.py`).

A new family is one file in this package (its model class with a reference `forward` and a serving `step`, its
weight table, its config reader) and one entry in `ARCHITECTURES`. `architecture_of(config)` picks the entry of
a checkpoint's `config.json` (`architectures[0]`, or `model_type` when that is absent) and refuses anything else
with `UnsupportedArchitectureError` naming what it found and what is supported (`SUPPORTED_ARCHITECTURES`).

Imports: stdlib and torch only (the families' files, at import).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from serving.engine.errors import UnsupportedArchitectureError
from serving.engine.model import ModelArgs
from serving.engine.models import gemma3, llama, mixtral, phi3, qwen3, qwen3_moe

# An HF tensor name (`{i}`: the layer index; `{e}`: an expert's index, its parts stacked after those of the experts
# before it) -> (engine tensor name, part of a fused tensor, number of parts)
WeightTable = dict[str, tuple[str, int, int]]


@dataclass(frozen=True)
class Architecture:
    """One entry of the registry: what the converter and the loader need to know about a family."""

    name: str  # `architectures[0]` of config.json
    model_type: str  # config.json's `model_type` that goes with it
    model_class: Callable[[ModelArgs], nn.Module]  # builds the (meta-device) model the weights load into
    weights: WeightTable  # HF -> engine weight names (`convert.map_hf_name`)
    param_names: Callable[[ModelArgs], list[str]]  # every engine tensor name a checkpoint of these args holds
    read_config: Callable[..., ModelArgs]  # (config dict, *, architecture, source) -> ModelArgs
    ignored_weights: re.Pattern[str] = field(default=re.compile(r"(?!)"))  # HF tensors the engine drops
    tensor_parallel: bool = False  # model_class takes a `parallel.ParallelConfig` (sharded across ranks)


ARCHITECTURES: dict[str, Architecture] = {
    name: Architecture(name=name, model_type=model_type, model_class=llama.Transformer, weights=llama.HF_TO_ENGINE,
                       param_names=llama.engine_param_names, read_config=llama.read_config,
                       ignored_weights=llama.IGNORED_HF_TENSORS, tensor_parallel=True)
    for name, model_type in (("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"),
                             ("Qwen2ForCausalLM", "qwen2"))
}
ARCHITECTURES["Qwen3ForCausalLM"] = Architecture(
    name="Qwen3ForCausalLM", model_type="qwen3", model_class=qwen3.Qwen3Transformer, weights=qwen3.HF_TO_ENGINE,
    param_names=qwen3.engine_param_names, read_config=qwen3.read_config, ignored_weights=qwen3.IGNORED_HF_TENSORS)
ARCHITECTURES["Phi3ForCausalLM"] = Architecture(
    name="Phi3ForCausalLM", model_type="phi3", model_class=phi3.Transformer, weights=phi3.HF_TO_ENGINE,
    param_names=phi3.engine_param_names, read_config=phi3.read_config, ignored_weights=phi3.IGNORED_HF_TENSORS)
ARCHITECTURES["MixtralForCausalLM"] = Architecture(
    name="MixtralForCausalLM", model_type="mixtral", model_class=mixtral.Transformer, weights=mixtral.HF_TO_ENGINE,
    param_names=mixtral.engine_param_names, read_config=mixtral.read_config, ignored_weights=llama.IGNORED_HF_TENSORS)
ARCHITECTURES["Qwen3MoeForCausalLM"] = Architecture(
    name="Qwen3MoeForCausalLM", model_type="qwen3_moe", model_class=qwen3_moe.Transformer,
    weights=qwen3_moe.HF_TO_ENGINE, param_names=qwen3_moe.engine_param_names, read_config=qwen3_moe.read_config,
    ignored_weights=qwen3_moe.IGNORED_HF_TENSORS)
ARCHITECTURES[gemma3.ARCHITECTURE] = Architecture(
    name=gemma3.ARCHITECTURE, model_type=gemma3.MODEL_TYPE, model_class=gemma3.Transformer, weights=gemma3.HF_TO_ENGINE,
    param_names=gemma3.engine_param_names, read_config=gemma3.read_config, ignored_weights=gemma3.IGNORED_HF_TENSORS)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def _supported() -> str:
    return ", ".join(f"{a.name} (model_type {a.model_type!r})" for a in ARCHITECTURES.values())


def architecture_of(config: dict[str, Any], *, source: str = "config.json") -> Architecture:
    """The registry entry of an HF `config.json` dict (see the module doc)."""
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    name = archs[0] if archs else next((a.name for a in ARCHITECTURES.values() if a.model_type == model_type), None)
    if name not in ARCHITECTURES or len(archs) > 1:
        raise UnsupportedArchitectureError(f"unsupported architecture architectures={archs!r} model_type={model_type!r} "
                                           f"in {source}; supported: {_supported()}")
    arch = ARCHITECTURES[name]
    if model_type is not None and model_type != arch.model_type:
        raise UnsupportedArchitectureError(f"architecture {name!r} with model_type={model_type!r} in {source}: "
                                           f"expected model_type {arch.model_type!r}; supported: {_supported()}")
    return arch


def model_args_of(config: dict[str, Any], *, source: str = "config.json") -> ModelArgs:
    """An HF `config.json` dict read by its family's reader; unsupported architectures and options raise."""
    arch = architecture_of(config, source=source)
    return arch.read_config(config, architecture=arch.name, source=source)


def registered(name: str) -> Architecture:
    """The entry of an engine's recorded `ModelArgs.architecture`."""
    if name not in ARCHITECTURES:
        raise UnsupportedArchitectureError(f"architecture {name!r} is not one this runtime serves; supported: "
                                           f"{_supported()}")
    return ARCHITECTURES[name]
