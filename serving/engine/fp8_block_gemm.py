"""The block-scaled FP8 GEMM of a block-wise FP8 checkpoint's weights (one float32 scale per [bn, bk] block):
e4m3 tokens x e4m3 weights on the FP8 tensor cores, both scales applied per K block.

As vLLM's `w8a8_block_fp8_matmul` (and DeepSeek's `fp8_gemm`): the tokens x [M, K] are scaled to e4m3 per token
and per group of bk columns (`tokens_e4m3_groups`: each group by its own largest magnitude), so a K block of the
product is one e4m3 x e4m3 `tl.dot` whose float32 result is multiplied by the token's group scale and the weight
block's scale before it is added to the accumulator. A program computes a [BLOCK_M, BLOCK_N] tile of the output;
its K loop steps one weight block (bk columns) at a time, so bk must be a power of two of at least 16 (`fits`).

`block_fp8_emulated_linear` computes the same on any device (the same e4m3 tokens and scales, dequantized, in
float32) for tests; `linear_fp8_block.Fp8BlockLinear.reference` is the weight-only path of the CPU.

Registered as `torch.ops.enginewright.block_fp8_linear` (a `triton_op`, traced by torch.compile); eagerly
launched directly. Checked on CPU tensors under TRITON_INTERPRET=1 and on the GPU (tests/test_fp8_block_gemm.py).

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from serving.engine.prescaled import E4M3_MAX

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

BLOCK_M, BLOCK_N = 64, 128  # the output tile of one program


def fits(block: tuple[int, int]) -> bool:
    """Whether the kernel takes weight blocks of `block` (rows, columns): K steps of one block, `tl.dot`-sized."""
    bk = block[1]
    return bk >= 16 and bk & (bk - 1) == 0


def tokens_e4m3_groups(x2: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/group)]): each token's group of `group` columns
    scaled by its own largest magnitude over 448 (torch ops; the kernel's values)."""
    m, k = x2.shape
    groups = -(-k // group)
    padded = F.pad(x2.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1, keepdim=True)  # [M, G, 1]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (padded / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(m, groups * group)[:, :k]
    return q.contiguous(), scale.view(m, groups)


def block_fp8_emulated_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                              bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's numerics on any device: the same e4m3 tokens and scales and the block-dequantized weight,
    multiplied in float32, cast to x's dtype."""
    from serving.engine.fp8_checkpoint import expand_blocks

    shape = x.shape
    xq, xs = tokens_e4m3_groups(x.reshape(-1, shape[-1]), block[1])
    tokens = xq.float() * xs.repeat_interleave(block[1], dim=1)[:, :shape[-1]]
    y = F.linear(tokens, weight.float() * expand_blocks(scale.float(), block, tuple(weight.shape))).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


if triton is not None:

    @triton.jit
    def _block_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_x, stride_xs, stride_w,
                          stride_ws, stride_o, GROUP_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """out [M, N] = sum over K blocks of (xq . wq^T) * token group scale * weight block scale."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view
        xs_ptrs = xs_ptr + offs_m * stride_xs
        ws_ptrs = ws_ptr + (offs_n // GROUP_N) * stride_ws
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kb in range(tl.cdiv(K, BLOCK_K)):
            k_mask = kb * BLOCK_K + offs_k < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            x_scale = tl.load(xs_ptrs + kb, mask=m_mask, other=0.0)
            w_scale = tl.load(ws_ptrs + kb, mask=n_mask, other=0.0)
            acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        dst = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    def _launch(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                block_k: int, out_dtype: torch.dtype, kernel: Any) -> torch.Tensor:
        m, k = xq.shape
        n = weight.shape[0]
        out = xq.new_empty((m, n), dtype=out_dtype)
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        kernel[grid](xq, xs, weight, scale, out, m, n, k, xq.stride(0), xs.stride(0), weight.stride(0),
                     scale.stride(0), out.stride(0), GROUP_N=block_n, BLOCK_K=block_k, BLOCK_M=BLOCK_M,
                     BLOCK_N=BLOCK_N, num_warps=4, num_stages=3)
        return out

    @triton_op("enginewright::block_fp8_linear", mutates_args=())
    def _block_fp8_op(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                      block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
        return _launch(xq, xs, weight, scale, block_n, block_k, out_dtype, wrap_triton(_block_fp8_kernel))


def available() -> bool:
    return triton is not None


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times the e4m3 weight [N, K] with block scales [ceil(N/bn), ceil(K/bk)]: the tokens scaled per
    group of bk columns, one block-scaled FP8 GEMM -> [..., N] in x's dtype (CUDA; CPU tensors under
    TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the block-scaled FP8 GEMM")
    if not fits(block):
        raise ValueError(f"block-scaled FP8 GEMM: weight blocks of {block[0]} x {block[1]} are not supported; the "
                         "K side must be a power of two of at least 16")
    shape = x.shape
    xq, xs = tokens_e4m3_groups(x.reshape(-1, shape[-1]), block[1])
    if torch.compiler.is_compiling():
        y = torch.ops.enginewright.block_fp8_linear(xq, xs, weight, scale.contiguous(), block[0], block[1], x.dtype)
    else:
        y = _launch(xq, xs, weight, scale.contiguous(), block[0], block[1], x.dtype, _block_fp8_kernel)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])
