"""RMSNorm in one Triton kernel for the engine's eager GPU work: prefills, the mixed steps and
its decode graphs (captured eagerly).

`model.RMSNorm.forward` in torch is seven launches and as many passes over the rows (the float32 copy, its
square, the mean, the scaling, the cast back, the weight), each writing float32 temporaries, and a prefill
runs one per layer and two more. `rms_norm` reads each row once and writes the
result once, with the module's numerics: the row in float32, times rsqrt(mean of squares + eps), rounded to
the row's dtype, then times the weight, rounded again (the module's `weight * h.to(x.dtype)`). Only the sum's
order and the rsqrt differ, so a value can land one step of the dtype away (tests/test_row_norm.py).

`add_rms_norm(x, delta, weight, eps)` is a residual add and the next norm in one kernel (vLLM's
`fused_add_rms_norm`): it returns `x + delta` rounded to the row's dtype, as torch's add rounds it, and that
sum's `rms_norm`, where the separate add was a launch and one more pass over the rows (docs/decisions.md).

`unit_offset=True` norms as Gemma does (HF's `GemmaRMSNorm`): the row in float32, times rsqrt(mean of squares +
eps), times `1 + weight` in float32, rounded once; the weight stays as the checkpoint holds it (`w`, not `1 + w`).
`add_rms_norm(..., delta_weight=w)` first norms `delta` itself with `w` and rounds it to the dtype (Gemma's norm
of the attention's or the MLP's output before the residual add), so a post-norm, the add and the next norm are one
kernel.

With `e4m3=True` either kernel also writes its result's rows scaled to e4m3 and their scales, as an FP8
GEMM's own scaling kernel would from the written row (`fp8_tokens`), and hands them over on the result
(`serving.engine.prescaled`).

Code under torch.compile keeps the torch ops, which inductor fuses itself.

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

from serving.engine.pdl import gdc, launch_options
from serving.engine.prescaled import E4M3_MAX, with_prescaled_rows

try:
    import triton
    import triton.language as tl

    from serving.engine.pdl import gdc_enter
except ImportError:  # CPU-only installs
    triton = None

MAX_COLUMNS = 16384  # a row held in registers at once (Llama's hidden sizes are 2048-8192)
DTYPES = (torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, q_ptr, scale_ptr, D, stride_x, stride_o, eps,
                         BLOCK_D: tl.constexpr, GDC: tl.constexpr = False, E4M3: tl.constexpr = False,
                         QMAX: tl.constexpr = 448.0, UNIT_OFFSET: tl.constexpr = False):
        if GDC:
            gdc_enter()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        _norm_row(x, w_ptr, out_ptr, q_ptr, scale_ptr, row, offs, mask, D, stride_o, eps, E4M3, QMAX, UNIT_OFFSET)

    @triton.jit
    def _normed(x, w_ptr, offs, mask, D, eps, dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """The row x (float32) normed as `model.RMSNorm` norms it, or with `UNIT_OFFSET` as Gemma's norm (by
        `1 + w`, in float32, rounded once), in `dtype`."""
        inv = tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            y = (x * inv * (1.0 + w)).to(dtype)
        else:
            h = (x * inv).to(dtype).to(tl.float32)
            y = (w * h).to(dtype)
        return y

    @triton.jit
    def _norm_row(x, w_ptr, out_ptr, q_ptr, scale_ptr, row, offs, mask, D, stride_o, eps, E4M3: tl.constexpr,
                  QMAX: tl.constexpr, UNIT_OFFSET: tl.constexpr = False):
        """Store the row x (float32) normed (`_normed`), and with `E4M3` also scaled to e4m3."""
        y = _normed(x, w_ptr, offs, mask, D, eps, out_ptr.dtype.element_ty, UNIT_OFFSET)
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
        if E4M3:
            _store_e4m3(y, row, offs, mask, q_ptr, scale_ptr, D, QMAX)

    @triton.jit
    def _store_e4m3(y, row, offs, mask, q_ptr, scale_ptr, D, QMAX: tl.constexpr):
        """The row y (in the output dtype) scaled to e4m3 by its largest magnitude, as fp8_tokens does."""
        yf = tl.where(mask, y.to(tl.float32), 0.0)
        amax = tl.max(tl.abs(yf), 0)
        scale = tl.where(amax > 0, amax * (1.0 / QMAX), 1.0)
        q = tl.minimum(tl.maximum(yf / scale, -QMAX), QMAX)
        tl.store(q_ptr + row * D + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, q_ptr, scale_ptr, D, stride_x, stride_d,
                             stride_s, stride_o, eps, BLOCK_D: tl.constexpr, GDC: tl.constexpr = False,
                             E4M3: tl.constexpr = False, QMAX: tl.constexpr = 448.0,
                             UNIT_OFFSET: tl.constexpr = False, dw_ptr=None, NORM_DELTA: tl.constexpr = False):
        if GDC:
            gdc_enter()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM_DELTA:  # delta through its own norm first, rounded as that norm's output
            d = _normed(d, dw_ptr, offs, mask, D, eps, sum_ptr.dtype.element_ty, UNIT_OFFSET).to(tl.float32)
        total = (x + d).to(sum_ptr.dtype.element_ty)  # rounded once, as torch's add
        tl.store(sum_ptr + row * stride_s + offs, total, mask=mask)
        _norm_row(total.to(tl.float32), w_ptr, out_ptr, q_ptr, scale_ptr, row, offs, mask, D, stride_o, eps, E4M3,
                  QMAX, UNIT_OFFSET)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes x [..., D] with this weight: Triton importable, a half-precision x of the
    weight's dtype, D within a row's registers, rows contiguous."""
    return (triton is not None and x.dtype in DTYPES and weight.dtype == x.dtype and x.shape[-1] <= MAX_COLUMNS
            and x.stride(-1) == 1 and weight.is_contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False, e4m3: bool = False,
             unit_offset: bool = False) -> torch.Tensor:
    """`model.RMSNorm`'s result for x [..., D] in one kernel (a program per row); see the module doc. `pdl`:
    launched with programmatic dependent launch (`serving.engine.pdl`); `e4m3`: the result carries its rows
    scaled to e4m3 for an FP8 GEMM (`serving.engine.prescaled`); `unit_offset`: Gemma's norm, by `1 + weight`."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    out = torch.empty_like(x2)
    q, scale = _e4m3_outputs(x2, e4m3)
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, q, scale, d, x2.stride(0), out.stride(0), eps, BLOCK_D=block,
                                     GDC=gdc(pdl), E4M3=e4m3, QMAX=E4M3_MAX, UNIT_OFFSET=unit_offset,
                                     num_warps=max(1, min(16, block // 512)), **launch_options(pdl))
    return _carrying(out.view(x.shape), q, scale, e4m3)


def add_fits(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, delta_weight: torch.Tensor | None = None
             ) -> bool:
    """Whether `add_rms_norm` takes x + delta: `fits` for both, of one shape and dtype (and for `delta_weight`,
    where delta is normed first)."""
    return (fits(x, weight) and fits(delta, weight) and delta.shape == x.shape
            and (delta_weight is None or (delta_weight.shape == weight.shape and fits(delta, delta_weight))))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False,
                 e4m3: bool = False, unit_offset: bool = False, delta_weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, `model.RMSNorm`'s result for it) in one kernel; see the module doc. `pdl`, `e4m3` and
    `unit_offset` as `rms_norm`'s; `delta_weight`: delta normed by it first (with the same eps and offset)."""
    d = x.shape[-1]
    x2, d2 = x.reshape(-1, d), delta.reshape(-1, d)
    total, out = torch.empty_like(x2), torch.empty_like(x2)
    q, scale = _e4m3_outputs(x2, e4m3)
    block = triton.next_power_of_2(d)
    _add_rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, total, out, q, scale, d, x2.stride(0), d2.stride(0),
                                         total.stride(0), out.stride(0), eps, BLOCK_D=block, GDC=gdc(pdl), E4M3=e4m3,
                                         QMAX=E4M3_MAX, UNIT_OFFSET=unit_offset, dw_ptr=delta_weight,
                                         NORM_DELTA=delta_weight is not None, num_warps=max(1, min(16, block // 512)),
                                         **launch_options(pdl))
    return total.view(x.shape), _carrying(out.view(x.shape), q, scale, e4m3)


def _e4m3_outputs(x2: torch.Tensor, e4m3: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the kernel writes the rows scaled to e4m3 and their scales (with `e4m3`; else placeholders it
    never touches)."""
    if not e4m3:
        return x2, x2
    return (torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x2.device),
            torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x2.device))


def _carrying(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, e4m3: bool) -> torch.Tensor:
    return with_prescaled_rows(out, q, scale) if e4m3 else out
