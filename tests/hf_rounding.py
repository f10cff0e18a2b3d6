"""How far HF's own float32 logits are from its float64 ones (their rounding): an engine that adds in another order
than HF is as right as HF float32 when it is no farther from HF float32 than that. A model whose norms amplify
rounding (Gemma's post-norms) moves HF float32 itself by ~1e-3 on the tiny checkpoints, where others move ~1e-4."""

from __future__ import annotations

import copy

import torch


def hf_rounding(hf: torch.nn.Module, prompt: list[int]) -> tuple[torch.Tensor, float]:
    """(HF's float32 logits of `prompt` [S, V], their largest distance from HF's float64 logits; 0.0 where HF has
    no float64 kernel, as its grouped expert GEMM)."""
    with torch.no_grad():
        hf32 = hf(torch.tensor([prompt])).logits[0]
        try:
            exact = copy.deepcopy(hf).double()(torch.tensor([prompt])).logits[0]
        except RuntimeError:
            return hf32, 0.0
    return hf32, (hf32.double() - exact).abs().max().item()


def within_rounding(got: torch.Tensor, want: torch.Tensor, rounding: float) -> bool:
    """Whether `got` equals HF float32's `want` within 1e-4 (absolute and relative), or within twice HF float32's
    own rounding (`hf_rounding`)."""
    return (torch.allclose(got, want, atol=1e-4, rtol=1e-4)
            or (got.double() - want.double()).abs().max().item() <= 2 * rounding)
