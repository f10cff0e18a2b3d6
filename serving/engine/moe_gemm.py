"""A mixture of experts' MLPs as grouped GEMMs on the GPU: one Triton launch a projection for every expert
(vLLM's `fused_moe` design), the path `models.moe.MoEFeedForward` picks on CUDA.

`fused_experts(x [N, D], weights [N, k], ids [N, k], w13, w2)` -> [N, D], the same sum as `moe.expert_loop`:
1. `align`: the N k (token, expert) pairs, "assignments" a = token k + slot, sorted by expert, each expert's run
   padded to a multiple of the kernel's row block with the sentinel N k: `sorted_ids`, sized on the host from N
   alone (N k + min(E, N k) (block_m - 1), the most padding there can be), the expert of each block of rows
   (`block_expert`) and the rows in use (`padded`, on the device). Torch ops without a host sync (counts by
   scatter_add, cumsums, a stable argsort): capturable in the decode graphs.
2. `grouped_gemm` over w13: a program per (block of block_m sorted rows, block_n output columns) multiplies its
   expert's weight tile by its rows gathered from x (row a // k) and writes them at row a -> [N k, 2I]; the
   programs of blocks past `padded` return at once.
3. SiLU(gate) * up (`silu_mul.gated`) -> [N k, I].
4. `grouped_gemm` over w2, each row times its routing weight in float32 in the epilogue -> [N k, D].
5. The k rows of each token summed in float32, rounded once to x's dtype.
Weights in the model's dtype, or quantized (e4m3 / int8, `quantize.quantize_weight`'s per-row scales): a tile is
converted to the activations' dtype in registers (exact) and each output column's sum multiplied by its
expert's row scale, weight-only numerics like the decode kernels of `linear_fp8`. float32 activations multiply in
IEEE float32 (no TF32).

Tile sizes (`GroupedConfig`, `config_for`): the device's tuned table (`tuned_tables`, section `moe`, written by
`bench.moe --sweep --write-table`), else vLLM's defaults for an untuned device (a block of 16 rows while the
tokens are at most the experts, else 64). Checked on CPU tensors under TRITON_INTERPRET=1 and on the GPU
(tests/test_moe_gemm.py).

Imports: stdlib and torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from serving.engine import silu_mul
from serving.engine.gemm_config import GroupedConfig, Shape

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8)


class ExpertWeights(Protocol):
    """E experts' weights stacked on the rows (`models.moe.ExpertWeights`)."""

    n_experts: int
    in_features: int
    out_features: int
    weight: torch.Tensor  # [E * out_features, in_features]
    weight_scale: torch.Tensor | None  # [E * out_features] float32 when the weight is quantized


def config_for(tokens: int, n_experts: int, table: Mapping[Shape, GroupedConfig] | None = None, *,
               inter: int = 0, dim: int = 0) -> GroupedConfig:
    """The device's tuned tiling for this shape (`table`: `TunedTables.moe`, keyed (tokens, I, D)) at the least
    tuned token count >= `tokens` (else the largest), or vLLM's default for an untuned device: small row blocks
    while each expert gets few tokens."""
    tuned = sorted(t for t, i, d in (table or {}) if (i, d) == (inter, dim))
    if tuned:
        return table[(next((t for t in tuned if t >= tokens), tuned[-1]), inter, dim)]
    if tokens <= n_experts:
        return GroupedConfig(16, 32, 64)
    return GroupedConfig(64, 64, 32)


def available(weight: torch.Tensor) -> bool:
    """Whether the grouped kernels run experts stored like `weight`: Triton importable, CUDA, a weight dtype
    they read."""
    return triton is not None and weight.is_cuda and weight.dtype in WEIGHT_DTYPES


def align(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids [N, k] -> (sorted_ids [blocks * block_m] int32: assignments sorted by expert, each expert's run
    padded to a multiple of block_m with N k; block_expert [blocks] int32: each block's expert, `n_experts`
    past the last; padded [1] int32: the rows in use). See the module doc."""
    flat = ids.flatten()
    total = flat.numel()
    dev = flat.device
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = padded_counts.cumsum(0)
    order = torch.argsort(flat, stable=True)  # assignments by expert, in token order within each expert
    experts = flat[order]
    rank = torch.arange(total, device=dev) - (counts.cumsum(0) - counts)[experts]
    blocks = -(-(total + min(n_experts, total) * (block_m - 1)) // block_m)
    sorted_ids = torch.full((blocks * block_m,), total, dtype=torch.int32, device=dev)
    sorted_ids[(padded_end - padded_counts)[experts] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(padded_end // block_m, torch.arange(blocks, device=dev), right=True)
    return sorted_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, routing_ptr, sorted_ptr, block_expert_ptr, padded_ptr,
                             N, K, n_rows, rows_per_token, stride_am, stride_cm,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SCALED: tl.constexpr, ROUTED: tl.constexpr, IEEE_DOT: tl.constexpr):
        """c[a] = a_rows[a // rows_per_token] W_e^T for the assignments a of one block (expert e), N columns of
        W_e [N, K] at b_ptr + e N K; SCALED: W quantized, scales [E N] at scale_ptr; ROUTED: each row times its
        routing weight [n_rows] at routing_ptr."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BLOCK_M >= tl.load(padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = rows < n_rows
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (rows // rows_per_token).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + (expert * N + offs_n)[None, :] * K + offs_k[:, None]  # [K, N] view of W_e's rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if SCALED:
                b = b.to(a.dtype)
            if IEEE_DOT:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if SCALED:
            acc = acc * tl.load(scale_ptr + expert * N + offs_n, mask=n_mask, other=0.0)[None, :]
        if ROUTED:
            acc = acc * tl.load(routing_ptr + rows, mask=valid, other=0.0)[:, None]
        dst = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def grouped_gemm(a: torch.Tensor, experts: ExpertWeights, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                 padded: torch.Tensor, *, rows_per_token: int, n_rows: int, config: GroupedConfig,
                 routing: torch.Tensor | None = None) -> torch.Tensor:
    """[n_rows, out_features]: row a is a's row a // rows_per_token times the weight of its expert (from
    `align`), times routing[a] when given (float32 [n_rows])."""
    if triton is None:
        raise RuntimeError("Triton is needed for the grouped expert kernels (moe_gemm)")
    a = a.contiguous()
    weight, n, k = experts.weight, experts.out_features, experts.in_features
    if a.shape[1] != k or weight.stride(1) != 1 or weight.stride(0) != k:
        raise ValueError(f"grouped GEMM needs rows [M, {k}] and contiguous stacked experts [E * {n}, {k}], got "
                         f"{tuple(a.shape)} and {tuple(weight.shape)} (strides {weight.stride()})")
    out = a.new_empty(n_rows, n)
    scale = experts.weight_scale
    grid = (block_expert.shape[0], triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a, weight, out, scale if scale is not None else out, routing if routing is not None else out, sorted_ids,
        block_expert, padded, n, k, n_rows, rows_per_token, a.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SCALED=scale is not None,
        ROUTED=routing is not None, IEEE_DOT=a.dtype == torch.float32, num_warps=config.warps,
        num_stages=config.stages)
    return out


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: ExpertWeights,
                  w2: ExpertWeights, config: GroupedConfig | None = None) -> torch.Tensor:
    """The experts over x [N, D] routed as (float32 weights, ids) [N, k] -> [N, D] (module doc)."""
    config = config or config_for(ids.shape[0], w13.n_experts)
    return aligned_experts(x, weights, *align(ids, w13.n_experts, config.block_m), w13, w2, config)


def aligned_experts(x: torch.Tensor, weights: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                    padded: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, config: GroupedConfig
                    ) -> torch.Tensor:
    """`fused_experts` from step 2 on, the assignments aligned already (`align`, or `moe_routing`)."""
    n, k = weights.shape
    gate_up = grouped_gemm(x, w13, sorted_ids, block_expert, padded, rows_per_token=k, n_rows=n * k, config=config)
    h = silu_mul.gated(gate_up, w2.in_features)
    y = grouped_gemm(h, w2, sorted_ids, block_expert, padded, rows_per_token=1, n_rows=n * k, config=config,
                     routing=weights.reshape(-1).float().contiguous())
    return y.view(n, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
