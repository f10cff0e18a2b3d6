"""Split-K partial products: the [split, M, N] float32 sums the decode GEMM kernels leave for their consumer.

`sum_partials` adds them in float32 in split order and rounds once, as cuBLAS rounds its float32 accumulators.
Traced by torch.compile it is pointwise adds, which inductor fuses into the consumer's kernel (a residual add
and RMSNorm), where a sum over dim 0 would run alone. Run eagerly on CUDA (the paged decode graphs, the static
engine's eager step) those adds were a kernel each plus the cast: a GEMM split 8 ways took nine kernels for
one row's sum. There one Triton kernel does it, with the same additions in the same order (bit-equal);
`EngineOptions.partial_sums_one_kernel` off keeps the adds (what it gains: docs/decisions.md).

Imports: torch; Triton only if importable.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

SUM_BLOCK = 1024  # elements a program

if triton is not None:

    @triton.jit
    def _sum_partials_kernel(parts_ptr, out_ptr, numel, PARTS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.load(parts_ptr + offs, mask=mask, other=0.0)
        for i in tl.static_range(1, PARTS):
            acc += tl.load(parts_ptr + i * numel + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials(parts: torch.Tensor, dtype: torch.dtype, *, one_kernel: bool = True) -> torch.Tensor:
    """[split, M, N] float32 -> [M, N] in `dtype` (module doc: pointwise adds when traced, one kernel when
    eager on CUDA, unless `one_kernel` is off: `EngineOptions.partial_sums_one_kernel`)."""
    if parts.shape[0] > 1 and one_kernel and one_kernel_fits(parts):
        return sum_partials_triton(parts, dtype)
    out = parts[0]
    for i in range(1, parts.shape[0]):
        out = out + parts[i]
    return out.to(dtype)


def one_kernel_fits(parts: torch.Tensor) -> bool:
    """Whether `sum_partials` may sum `parts` in one Triton kernel: eager (not traced), CUDA, contiguous float32."""
    return (not torch.compiler.is_compiling() and triton is not None and parts.is_cuda
            and parts.dtype == torch.float32 and parts.is_contiguous())


def sum_partials_triton(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one-kernel sum on any device Triton runs on (CUDA; CPU tensors under TRITON_INTERPRET=1)."""
    parts = parts.contiguous()
    out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device)
    numel = out.numel()
    _sum_partials_kernel[(triton.cdiv(numel, SUM_BLOCK),)](parts, out, numel, PARTS=parts.shape[0], BLOCK=SUM_BLOCK)
    return out
