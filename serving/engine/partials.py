"""Split-K partial products: the [split, M, N] float32 sums the decode GEMM kernels leave for their consumer.

Imports: torch only.
"""

from __future__ import annotations

import torch


def sum_partials(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[split, M, N] -> [M, N] in `dtype`: pointwise adds (inductor fuses them into the consumer's kernel, where
    a sum over dim 0 would run alone), rounded once at the end, as cuBLAS rounds its float32 accumulators."""
    out = parts[0]
    for i in range(1, parts.shape[0]):
        out = out + parts[i]
    return out.to(dtype)
