"""Attention of the eager prompt steps through SDPA, without cuDNN's backend.

For bf16 prompts on the H200 (torch 2.11) SDPA picks cuDNN's attention, which builds and compiles (NVRTC,
the `cudnn_generated_fort_native_sdpa` kernels) an execution plan for every new shape it meets. A prefill's
shape is how many prompts of one length it holds, which changes from batch to batch, so plans keep being
built while serving: in one run of 1,024 requests the paged engine's 9 prompt steps took 7.3 s where the
same steps took 4.1 s once a first run had met their shapes. FlashAttention's and the memory-efficient
backends need no plan.

`causal_band`: the mask of a prompt's attention under a sliding window.

Imports: torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, **options)`; on CUDA from `BACKENDS` only."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **options)
    with sdpa_kernel(BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **options)


def causal_band(n: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """The mask [n, n] (True: attend) of n tokens from position 0 under a sliding `window`: each query's own key
    and the window - 1 before it; None where the window covers every row (plain causal attention)."""
    if window is None or window >= n:
        return None
    i = torch.arange(n, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
