"""The decode step's wo and w2 products with the residual add, and the next norm's sums of squares.

`linear_residual(x [M, K], weight [N, K], residual [M, N], config, counters)` returns
(residual + x W^T rounded as the unfused step rounds it, its rows' sums of squares [M, N / BLOCK_N]),
so that the RMSNorm after it needs no kernel of its own: the GEMM that reads the normalized rows applies
it (`row_norm`).

The product is split over K (`config.split` slices, as the skinny GEMM tuned for the shape). Each slice
stores its float32 partial product; the slice of a column tile that finishes last sums the tile's
partials in slice order (so the result does not depend on which one that is, and equals the unfused
`skinny_linear`), rounds, adds the residual, and writes the tile and its sums of squares. "Last" is
counted with one atomic per column tile in `counters` (int32, zero, at least N / BLOCK_N of them), which
that slice sets back to zero: the counters are zero again whenever no such kernel runs, so one buffer
serves every call in a stream. Memory order: each slice's stores, a barrier of its program, then one
acquire-release atomic; the last slice reads the partials through L2 (`.cg`), past its own L1.

Registered as the custom op `enginewright::linear_residual` (opaque to inductor; launched with
programmatic dependent launch when `pdl`). Checked on CPU tensors under TRITON_INTERPRET=1 and on the GPU
(tests/test_fused_norms.py). Imports: stdlib and torch; Triton only if importable.
"""

from __future__ import annotations

import torch

from serving.engine.skinny_gemm import GemmConfig, block_m

try:
    import triton
    import triton.language as tl

    from serving.engine.pdl import gdc, gdc_enter, launch_options
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None


def fits(config: GemmConfig, m: int, n: int, k: int) -> bool:
    """Whether `config` can run the product with its residual add ("dot" configs)."""
    return config.kernel == "dot" and config.fits(m, n, k)


def counters_needed(n: int, config: GemmConfig) -> int:
    return -(-n // config.block_n)


if triton is not None:

    @triton.jit
    def _residual_dot_kernel(x_ptr, w_ptr, res_ptr, part_ptr, count_ptr, out_ptr, sumsq_ptr,
                             M, N, k_split, stride_xm, stride_wn, stride_ps, n_tiles,
                             SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, IEEE_DOT: tl.constexpr, GDC: tl.constexpr):
        if GDC:
            gdc_enter()
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        mask = m_mask[:, None] & n_mask[None, :]
        k_start = pid_s * k_split
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (k_start + offs_k)[:, None]  # [K, N] view
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for _ in range(0, k_split, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
            if IEEE_DOT:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_s * stride_ps + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the atomic publishes them
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT - 1  # a mask rather than a branch: the other slices load and store nothing
        tl.store(count_ptr + pid_n, 0, mask=last)
        mask = mask & last
        total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(part_ptr + s * stride_ps + tile, mask=mask, other=0.0, cache_modifier=".cg")
        dtype = out_ptr.dtype.element_ty
        residual = tl.load(res_ptr + tile, mask=mask, other=0.0).to(tl.float32)
        out = (residual + total.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + tile, out, mask=mask)
        squares = out.to(tl.float32)
        tl.store(sumsq_ptr + offs_m * n_tiles + pid_n, tl.sum(squares * squares, 1), mask=m_mask & last)

    def launch(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, config: GemmConfig,
               counters: torch.Tensor, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x weight^T [M, N], sums of squares [M, N / BLOCK_N]); `pdl`: launched with
        programmatic dependent launch."""
        m, k = x.shape
        n = weight.shape[0]
        if not fits(config, m, n, k):
            raise ValueError(f"linear_residual config {config.key()} does not fit M={m}, N={n}, K={k} "
                             "(a 'dot' config whose K slices tile K)")
        if weight.shape[1] != k or residual.shape != (m, n) or len({x.dtype, weight.dtype, residual.dtype}) != 1:
            raise ValueError(f"linear_residual needs x [M, K], weight [N, K] and residual [M, N] of one dtype, got "
                             f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} {weight.dtype}, "
                             f"{tuple(residual.shape)} {residual.dtype}")
        tiles = counters_needed(n, config)
        if counters.dtype != torch.int32 or counters.numel() < tiles:
            raise ValueError(f"linear_residual needs {tiles} int32 counters, got {counters.numel()} {counters.dtype}")
        x, residual = x.contiguous(), residual.contiguous()
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        parts = torch.empty((config.split, m, n), dtype=torch.float32, device=x.device)
        out = torch.empty_like(residual)
        sumsq = torch.empty((m, tiles), dtype=torch.float32, device=x.device)
        _residual_dot_kernel[(tiles, config.split)](
            x, weight, residual, parts, counters, out, sumsq, m, n, k // config.split, x.stride(0),
            weight.stride(0), parts.stride(0), tiles, SPLIT=config.split, BLOCK_M=block_m(m),
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, IEEE_DOT=x.dtype == torch.float32, GDC=gdc(pdl),
            num_warps=config.warps, num_stages=config.stages, **launch_options(pdl))
        return out, sumsq

    # opaque to inductor. `counters` is changed and set back while the kernel runs, so the op declares no
    # mutation: declared, functionalization would copy the buffer around every call
    @torch.library.custom_op("enginewright::linear_residual", mutates_args=())
    def _linear_residual_op(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, counters: torch.Tensor,
                            config: str, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return launch(x, weight, residual, GemmConfig.parse(config), counters, pdl=pdl)

    @_linear_residual_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, counters: torch.Tensor, config: str,
          pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = counters_needed(weight.shape[0], GemmConfig.parse(config))
        return torch.empty_like(residual), x.new_empty((x.shape[0], tiles), dtype=torch.float32)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, config: GemmConfig,
                    counters: torch.Tensor, *, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x weight^T, its rows' sums of squares [M, tiles] float32) through the registered op
    (CUDA; CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for linear_residual")
    return torch.ops.enginewright.linear_residual(x, weight, residual, counters, config.key(), pdl)
