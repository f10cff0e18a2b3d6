"""The tokens' e4m3 scaling of an FP8 tensor-core GEMM in one Triton kernel, for eager prefills.

`tokens_e4m3(x [T, K], qmax)` -> (e4m3 [T, K], float32 scales [T, 1]): each row divided by its own largest
magnitude over `qmax`, clamped to +-qmax, rounded to e4m3 (`quantize.quantize_tokens_fp8`'s values, but
at rounding ties: Triton's float32 division is not correctly rounded, so a few values in a hundred million
land one e4m3 step from torch's (tests/test_fp8_gemm.py bounds them); the scales are equal). Eagerly,
those torch ops are ten launches and as many passes over x per GEMM (an 8B prefill of 128 tokens has 128
such GEMMs); the compiled decode step keeps the torch ops, which inductor fuses into the kernel that
produces x. A program per row reads it twice (the max, then the scaling; the second read from cache).
What it saves a prefill: docs/decisions.md.

Registered as `torch.ops.enginewright.tokens_e4m3` (a `triton_op`, what a torch.compile traces); eagerly
`tokens_e4m3` launches the kernel itself. Checked under TRITON_INTERPRET=1 and on
the GPU (tests/test_fp8_gemm.py).

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

BLOCK_K = 1024  # columns per pass

if triton is not None:

    @triton.jit
    def _tokens_e4m3_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, QMAX: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """One row: its largest magnitude, then every element divided by max / QMAX, clamped, to e4m3."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        peak = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            peak = tl.maximum(peak, tl.abs(x.to(tl.float32)))
        amax = tl.max(peak, 0)
        scale = tl.where(amax > 0, amax * (1.0 / QMAX), 1.0)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(x / scale, -QMAX), QMAX)
            tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)
        tl.store(scale_ptr + row, scale)

    def _launch(x: torch.Tensor, qmax: float, kernel: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        rows, k = x.shape
        q = x.new_empty((rows, k), dtype=torch.float8_e4m3fn)
        scale = x.new_empty((rows, 1), dtype=torch.float32)
        kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), QMAX=qmax, BLOCK_K=BLOCK_K, num_warps=4)
        return q, scale

    @triton_op("enginewright::tokens_e4m3", mutates_args=())
    def _tokens_e4m3_op(x: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch(x, qmax, wrap_triton(_tokens_e4m3_kernel))


def available() -> bool:
    return triton is not None


def tokens_e4m3(x2: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]), `quantize.quantize_tokens_fp8`'s values. Eagerly the
    kernel is launched directly: the registered op's dispatch costs host time at every GEMM of an eager
    prefill, which a prefill of a few tokens waits for. Traced (torch.compile), the registered op."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the token scaling kernel")
    if torch.compiler.is_compiling():
        return torch.ops.enginewright.tokens_e4m3(x2, qmax)
    return _launch(x2, qmax, _tokens_e4m3_kernel)


def tokens_e4m3_op(x2: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens_e4m3` through the registered op, also eagerly (the bench times both)."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the token scaling kernel")
    return torch.ops.enginewright.tokens_e4m3(x2, qmax)
