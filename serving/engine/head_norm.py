"""Qwen3's per-head RMSNorm of q and k, in place on the projection, in one Triton kernel (eager GPU work: the
mixed steps and the decode graphs, captured eagerly).

The q/k projection's output `qkv [T, (H + 2 Hkv) hd]` holds each token's H query heads, then its Hkv key
heads, then its values. Through `model.RMSNorm` the norms cost a copy of each strided head view, a kernel each
and a concatenation back: five launches a layer, which a decode step of a 36-layer model pays 36 times. Here
one program a (token, head) normalizes the head where it lies: the q weight for the first H heads of a row,
the k weight for the next Hkv, the values untouched. Numerics are `model.RMSNorm`'s, as `row_norm`'s kernel
rounds them (the head in float32, times rsqrt(mean of squares + eps), rounded to the dtype, times the
weight, rounded again), so the two paths agree to a step of the dtype (tests/test_head_norm.py). With
`unit_offset=True` the numerics are Gemma's norm (`models.gemma3.GemmaRMSNorm`, as `row_norm`'s `unit_offset`): the
head in float32 times rsqrt(...) times `1 + weight` in float32, rounded once.

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

from serving.engine.pdl import gdc, launch_options

try:
    import triton
    import triton.language as tl

    from serving.engine.pdl import gdc_enter
except ImportError:  # CPU-only installs
    triton = None

DTYPES = (torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _head_norm_kernel(qkv_ptr, qw_ptr, kw_ptr, stride_t, n_q_heads, eps, D: tl.constexpr,
                          BLOCK_D: tl.constexpr, GDC: tl.constexpr = False, UNIT_OFFSET: tl.constexpr = False):
        if GDC:
            gdc_enter()
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        at = qkv_ptr + token * stride_t + head * D + offs
        x = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        h = x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
        if head < n_q_heads:
            w = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            w = tl.load(kw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:  # Gemma's: by 1 + w in float32, rounded once
            y = h * (1.0 + w)
        else:
            y = w * h.to(qkv_ptr.dtype.element_ty).to(tl.float32)
        tl.store(at, y.to(qkv_ptr.dtype.element_ty), mask=mask)


def fits(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor) -> bool:
    """Whether `norm_heads_` takes this projection: Triton importable, a half-precision 2-D qkv of the weights'
    dtype, its columns contiguous, contiguous weights of one head's width."""
    return (triton is not None and qkv.dim() == 2 and qkv.dtype in DTYPES and qkv.stride(-1) == 1
            and q_weight.dtype == qkv.dtype and k_weight.dtype == qkv.dtype and q_weight.is_contiguous()
            and k_weight.is_contiguous() and q_weight.shape == k_weight.shape and q_weight.dim() == 1)


def norm_heads_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, *, n_heads: int,
                n_kv_heads: int, eps: float, pdl: bool = False, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm each of the H query heads (with `q_weight`) and Hkv key heads (`k_weight`) of every row of
    qkv [T, (H + 2 Hkv) hd], in place; returns qkv. `pdl`: launched with programmatic dependent launch
    (`serving.engine.pdl`); `unit_offset`: Gemma's norm, by `1 + weight` (module doc)."""
    head_dim = q_weight.shape[0]
    tokens = qkv.shape[0]
    if tokens:
        block = triton.next_power_of_2(head_dim)
        _head_norm_kernel[(tokens, n_heads + n_kv_heads)](
            qkv, q_weight, k_weight, qkv.stride(0), n_heads, eps, D=head_dim, BLOCK_D=block, GDC=gdc(pdl),
            UNIT_OFFSET=unit_offset, num_warps=max(1, min(4, block // 64)), **launch_options(pdl))
    return qkv
