"""RMSNorm folded into the GEMM that consumes it: the decode step's norms without kernels of their own.

At 64 rows a Llama layer ran two small kernels between its GEMMs: the residual add with the RMSNorm of
the attention's input, and the same before the MLP (Llama-1B on the H200: 5.7 us per layer without
PDL, about 8% of the step). Here the GEMM that writes the residual stream (wo, w2: `residual.py`) also
leaves each row's sum of squares per column tile, and the GEMM that reads the normalized rows (wqkv,
gate/up, the LM head) normalizes each x tile as it loads it:

    h = g * bf16(x * rsqrt(sum of squares / D + eps))

rounded as `model.RMSNorm` rounds (float32 normalization, rounded to x's dtype, times the weight,
rounded again). Only the sum of squares is summed in another order than the unfused step's, so the
folded step is equal to it up to float32 rounding of that sum.

`RowNorm` carries what the consuming kernel needs; `row_rstd` and `rms_normalize` are its two Triton
helpers. Imports: stdlib and torch; Triton only if importable (this module runs inside Triton's python
backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only installs)
    triton = None


@dataclass(frozen=True)
class RowNorm:
    """The RMSNorm of rows x [M, D] that a consuming GEMM applies as it loads x.

    sumsq: [M, T] float32, each row's sum of squares in T column tiles (any T >= 1); weight: [D], of x's
    dtype; eps: the norm's epsilon."""

    sumsq: torch.Tensor
    weight: torch.Tensor
    eps: float

    def check(self, x: torch.Tensor) -> None:
        """Raise unless this norm fits rows x [M, D]."""
        m, d = x.shape
        if self.sumsq.dim() != 2 or self.sumsq.shape[0] != m or self.sumsq.dtype != torch.float32:
            raise ValueError(f"RowNorm.sumsq must be float32 [M={m}, T], got {tuple(self.sumsq.shape)} {self.sumsq.dtype}")
        if self.weight.shape != (d,) or self.weight.dtype != x.dtype:
            raise ValueError(f"RowNorm.weight must be [{d}] of {x.dtype}, got {tuple(self.weight.shape)} "
                             f"{self.weight.dtype}")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The normalized rows in torch (the reference the kernels are tested against)."""
        rstd = torch.rsqrt(self.sumsq.sum(-1, keepdim=True) / x.shape[-1] + self.eps)
        return self.weight * (x.float() * rstd).to(x.dtype)


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """[M, 1] float32 sums of squares of rows x [M, D]: the `RowNorm.sumsq` of rows no GEMM wrote (the
    embeddings)."""
    return x.float().pow(2).sum(-1, keepdim=True)


def norm_arguments(norm: RowNorm | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(sumsq, weight, eps, tiles) of a kernel launch: the norm's, checked against x, or placeholders that
    a kernel launched without a norm never reads (tensors of their own: torch.compile does not handle a
    traced kernel's arguments that alias)."""
    if norm is None:
        return x.new_empty(1), x.new_empty(1), 0.0, 1
    norm.check(x)
    return norm.sumsq.contiguous(), norm.weight.contiguous(), norm.eps, norm.sumsq.shape[1]


def tiles_pad(tiles: int) -> int:
    """The power of two >= tiles that the kernels load the sums of squares as."""
    return 1 << max(0, tiles - 1).bit_length()


if triton is not None:

    @triton.jit
    def row_rstd(sumsq_ptr, offs_m, m_mask, tiles, dim, eps, T_PAD: tl.constexpr):
        """1 / rms of each row [BLOCK_M], from its sums of squares at sumsq_ptr [M, tiles]."""
        offs_t = tl.arange(0, T_PAD)
        ptrs = sumsq_ptr + offs_m[:, None] * tiles + offs_t[None, :]
        sumsq = tl.sum(tl.load(ptrs, mask=m_mask[:, None] & (offs_t < tiles)[None, :], other=0.0), 1)
        return tl.rsqrt(sumsq / dim + eps)

    @triton.jit
    def rms_normalize(x, rstd, g_ptrs):
        """x [BLOCK_M, BLOCK_K] normalized by rstd [BLOCK_M] and scaled by the norm weight at g_ptrs
        [BLOCK_K], rounded as `model.RMSNorm`: to x's dtype after the normalization, again after the
        weight."""
        h = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        return (tl.load(g_ptrs).to(tl.float32)[None, :] * h.to(tl.float32)).to(x.dtype)
