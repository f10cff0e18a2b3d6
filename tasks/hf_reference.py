"""The Hugging Face model the validation gate compares an engine with, for any checkpoint the engine loads.

An unquantized checkpoint loads with `from_pretrained`. A checkpoint already in FP8 (`serving.engine.fp8_checkpoint`:
compressed-tensors, ModelOpt, block-wise fp8) loads as HF's plain model of its config without
`quantization_config`, holding the checkpoint's own weights dequantized (weights * scales, in float32): the same
values the engine multiplies by, so the gate measures the engine, not the quantization (the checkpoint's
author chose that). Its peer (HF at the engine's precision) keeps those weights, and where the engine rounds its
GEMMs' tokens to e4m3 (FP8 tensor cores) rounds them the same way (`round_fp8_checkpoint_tokens`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def fp8_checkpoint_of(checkpoint: Path) -> Any:
    """The checkpoint's FP8 format (`fp8_checkpoint.Fp8Checkpoint`), or None for an unquantized one."""
    from serving.engine.fp8_checkpoint import detect_fp8_checkpoint

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return detect_fp8_checkpoint(Path(checkpoint), config)


def load_hf_model(checkpoint: Path, dtype: str, device: torch.device | str) -> Any:
    """HF's causal LM of `checkpoint` in `dtype` on `device`, eval mode; an FP8 checkpoint dequantized (module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if fp8_checkpoint_of(checkpoint) is None:
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(device).eval()
    from serving.engine.fp8_checkpoint import dequantized_state

    config_dict, state = dequantized_state(Path(checkpoint))
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{checkpoint}: the dequantized FP8 checkpoint does not fit HF's {type(model).__name__}: "
                         f"missing {sorted(set(missing) - tied)[:8]}, unexpected {sorted(unexpected)[:8]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype=getattr(torch, dtype), device=device).eval()


class _TokensRoundedLinear(torch.nn.Module):
    """An HF linear whose input tokens are rounded to e4m3 as the engine's FP8 GEMM rounds them: per token, or
    per token and group of `group` columns (block-wise FP8)."""

    def __init__(self, linear: torch.nn.Linear, group: int | None) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from serving.engine.fp8_block_gemm import tokens_e4m3_groups
        from serving.engine.quantize import quantize_tokens_fp8

        x2 = x.reshape(-1, x.shape[-1])
        if self.group is None:
            q, s = quantize_tokens_fp8(x2)
            tokens = q.float() * s
        else:
            q, s = tokens_e4m3_groups(x2, self.group)
            tokens = q.float() * s.repeat_interleave(self.group, dim=1)[:, :x2.shape[-1]]
        return self.linear(tokens.to(x.dtype).view(x.shape))


@torch.no_grad()
def round_fp8_checkpoint_tokens(model: Any, checkpoint: Path, *, scale_tokens: bool) -> None:
    """The peer of an engine of the FP8 `checkpoint`: its weights already are the checkpoint's, so only the
    engine's rounding of tokens is added, where it has one (`scale_tokens`: `validate.engine_scales_tokens`)."""
    if not scale_tokens:
        return
    block = fp8_checkpoint_of(checkpoint).block
    for layer in model.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, torch.nn.Linear):
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, child, _TokensRoundedLinear(module, block[1] if block else None))
