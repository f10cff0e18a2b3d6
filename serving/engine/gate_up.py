"""The MLP's first half of the decode step, silu(x W_gate^T) * (x W_up^T), as one Triton kernel.

The unfused step multiplies by w13 ([gate; up] stacked, [2I, D]), writes the [M, 2I] product, and a
second kernel reads it back for SiLU * up. Here each program computes BLOCK_N columns of the gate product and the
same columns of the up product (two accumulators, the two weight tiles read once each) and stores
silu(gate) * up: the weights are read exactly as by the w13 GEMM, and nothing else runs. K is not split
(SiLU needs whole sums), so the kernel fits shapes with enough columns to fill the GPU: I / BLOCK_N
programs.

Rounding follows the unfused step: gate and up are rounded to the weights' dtype (the w13 output),
F.silu's result is rounded, and so is the product.

`gate_up(x [M, D], w13 [2I, D], tables=...)` -> [M, I] runs the kernel where the device's tuned tables
(`TunedTables.gate_up`, `gate_up_quantized`: written by the GEMM sweep with `--gate-up`) have a config for
the shape (rows bucket, I, D); elsewhere the w13 product (through `skinny_linear`, so a tuned split-K w13
still runs) and SiLU * up. Inside the static batch-1 compile it would take inductor's fusions of RMSNorm
into w13 and SiLU * up into w2 away; `cuda_graphs.tuned_single_row` keeps a model whose batch-1 products
are all tuned off that compile (figures: docs/decisions.md). Checked on CPU tensors under TRITON_INTERPRET=1 and on the GPU (tests/test_gate_up.py).

Registered as `torch.ops.enginewright.gate_up` (a `triton_op`), so it traces under
torch.compile(fullgraph=True) and launches inside CUDA-graph capture; `enginewright::gate_up_pdl` is
its programmatic-dependent-launch variant (`serving.engine.pdl`).

Imports: stdlib and torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

from serving.engine import silu_mul
from serving.engine.gemm_config import MAX_ROWS, GemmConfig, rows_bucket
from serving.engine.skinny_gemm import QUANTIZED_DTYPES, block_m, skinny_linear
from serving.engine.tuned_tables import TunedTables

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from serving.engine.pdl import gdc, gdc_enter, kernel_for, launch_options
    from serving.engine.skinny_gemm import widen
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

def fits(config: GemmConfig, m: int, k: int) -> bool:
    """Whether `config` can run the gate/up product of m rows of width k (one K slice, whole blocks)."""
    return config.kernel in ("dot", "dott") and config.split == 1 and config.fits(m, 0, k)  # (fits does not read n)


def config_for(m: int, intermediate: int, k: int, tables: TunedTables, *, quantized: bool = False
               ) -> GemmConfig | None:
    """The tuned config of the shape in `tables`; for a quantized w13 `gate_up_quantized`'s only (a shape not
    there runs the w13 product's own quantized kernel, then SiLU * up)."""
    if m > MAX_ROWS:
        return None
    key = (rows_bucket(m), intermediate, k)
    return (tables.gate_up_quantized if quantized else tables.gate_up).get(key)


if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, out_ptr, M, I, K, stride_xm, stride_wn, stride_om, scale_ptr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE_DOT: tl.constexpr, GDC: tl.constexpr, SCALED: tl.constexpr = False):
        """SCALED: w13 is quantized (int8 / e4m3), converted to x's dtype in registers, and each column's sums
        multiplied by its row scale ([2I] float32 at scale_ptr) before the rounding."""
        if GDC:
            gdc_enter()
        pid_n = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < I
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        g_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [K, N] views
        u_ptrs = w_ptr + (offs_n + I).to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for _ in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_mask[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_mask[None, :], other=0.0)
            if SCALED:
                g = widen(g, x.dtype, True)
                u = widen(u, x.dtype, True)
            if IEEE_DOT:
                acc_g += tl.dot(x, g, input_precision="ieee")
                acc_u += tl.dot(x, u, input_precision="ieee")
            else:
                acc_g += tl.dot(x, g)
                acc_u += tl.dot(x, u)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if SCALED:
            acc_g = acc_g * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
            acc_u = acc_u * tl.load(scale_ptr + I + offs_n, mask=n_mask, other=0.0)[None, :]
        dtype = out_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)
        up = acc_u.to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        dst = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(dst, (silu * up).to(dtype), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _gate_up_t_kernel(x_ptr, w_ptr, out_ptr, M, I, K, stride_xm, stride_wn, stride_om, scale_ptr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          IEEE_DOT: tl.constexpr, GDC: tl.constexpr, SCALED: tl.constexpr = False):
        """`_gate_up_kernel` transposed (config kernel "dott"): the weight tiles as the products' first
        operands, [BLOCK_N, BLOCK_M] accumulators (see skinny_gemm's "dott")."""
        if GDC:
            gdc_enter()
        pid_n = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < I
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [K, M] view
        g_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [N, K]
        u_ptrs = w_ptr + (offs_n + I).to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for _ in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=n_mask[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=n_mask[:, None], other=0.0)
            if SCALED:
                g = widen(g, x.dtype, True)
                u = widen(u, x.dtype, True)
            if IEEE_DOT:
                acc_g += tl.dot(g, x, input_precision="ieee")
                acc_u += tl.dot(u, x, input_precision="ieee")
            else:
                acc_g += tl.dot(g, x)
                acc_u += tl.dot(u, x)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if SCALED:
            acc_g = acc_g * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
            acc_u = acc_u * tl.load(scale_ptr + I + offs_n, mask=n_mask, other=0.0)[:, None]
        dtype = out_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)
        up = acc_u.to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        dst = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(dst, (silu * up).to(dtype), mask=n_mask[:, None] & m_mask[None, :])

    def launch(x: torch.Tensor, w13: torch.Tensor, config: GemmConfig, *, pdl: bool = False,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up [M, I] of x [M, K] and w13 [2I, K] (the tuning entry point); `pdl`: launched with
        programmatic dependent launch; `scale`: w13 is quantized with these float32 per-row scales [2I]."""
        m, k = x.shape
        if scale is not None and (w13.dtype not in QUANTIZED_DTYPES or scale.shape != (w13.shape[0],)):
            raise ValueError(f"gate_up with scales needs an int8 / float8_e4m3fn w13 and float32 scales [2I], got "
                             f"{w13.dtype} {tuple(w13.shape)} and {tuple(scale.shape)}")
        if w13.shape[0] % 2 or w13.shape[1] != k or (scale is None and x.dtype != w13.dtype):
            raise ValueError(f"gate_up needs x [M, K] and w13 [2I, K] of one dtype, got {tuple(x.shape)} {x.dtype} "
                             f"and {tuple(w13.shape)} {w13.dtype}")
        if not fits(config, m, k):
            raise ValueError(f"gate_up config {config.key()} does not fit M={m}, K={k} (a 'dot' or 'dott' config with "
                             "split 1)")
        intermediate = w13.shape[0] // 2
        x = x.contiguous()
        if w13.stride(1) != 1:
            w13 = w13.contiguous()
        out = torch.empty((m, intermediate), dtype=x.dtype, device=x.device)
        kernel = _gate_up_t_kernel if config.kernel == "dott" else _gate_up_kernel
        kernel_for(kernel, pdl)[(triton.cdiv(intermediate, config.block_n),)](
            x, w13, out, m, intermediate, k, x.stride(0), w13.stride(0), out.stride(0),
            scale if scale is not None else x.new_empty(1, dtype=torch.float32),
            BLOCK_M=block_m(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            IEEE_DOT=x.dtype == torch.float32, GDC=gdc(pdl), SCALED=scale is not None, num_warps=config.warps,
            num_stages=config.stages, **launch_options(pdl))
        return out

    @triton_op("enginewright::gate_up", mutates_args=())
    def _gate_up_op(x: torch.Tensor, w13: torch.Tensor, config: str) -> torch.Tensor:
        return launch(x, w13, GemmConfig.parse(config))

    # opaque to inductor, which would launch the kernel without the PDL attribute (`serving.engine.pdl`)
    @torch.library.custom_op("enginewright::gate_up_pdl", mutates_args=())
    def _gate_up_pdl_op(x: torch.Tensor, w13: torch.Tensor, config: str) -> torch.Tensor:
        return launch(x, w13, GemmConfig.parse(config), pdl=True)

    @_gate_up_pdl_op.register_fake
    def _(x: torch.Tensor, w13: torch.Tensor, config: str) -> torch.Tensor:
        return x.new_empty((x.shape[0], w13.shape[0] // 2))

    @triton_op("enginewright::gate_up_scaled", mutates_args=())
    def _gate_up_scaled_op(x: torch.Tensor, w13: torch.Tensor, scale: torch.Tensor, config: str) -> torch.Tensor:
        return launch(x, w13, GemmConfig.parse(config), scale=scale)

    @torch.library.custom_op("enginewright::gate_up_scaled_pdl", mutates_args=())
    def _gate_up_scaled_pdl_op(x: torch.Tensor, w13: torch.Tensor, scale: torch.Tensor, config: str) -> torch.Tensor:
        return launch(x, w13, GemmConfig.parse(config), pdl=True, scale=scale)

    @_gate_up_scaled_pdl_op.register_fake
    def _(x: torch.Tensor, w13: torch.Tensor, scale: torch.Tensor, config: str) -> torch.Tensor:
        return x.new_empty((x.shape[0], w13.shape[0] // 2))


def gate_up(x: torch.Tensor, w13: torch.Tensor, *, config: GemmConfig | None = None,
            tables: TunedTables | None = None, pdl: bool = False, scale: torch.Tensor | None = None,
            one_kernel_sum: bool = True) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for x [M, D] and w13 = [W_gate; W_up] [2I, D]: the fused kernel when
    a config fits (`config`, else the one in `tables` on CUDA), else the w13 product (`skinny_linear` with
    `tables`) and SiLU * up. `pdl`: the kernels launched with programmatic dependent launch (CUDA, Hopper
    and later). `scale`: w13 is quantized (int8 / e4m3) with these per-row float32 scales [2I]."""
    m, k = x.shape
    intermediate = w13.shape[0] // 2
    if config is None and tables is not None and x.is_cuda and triton is not None:
        config = config_for(m, intermediate, k, tables, quantized=scale is not None)
    if config is None or triton is None or not fits(config, m, k):
        both = skinny_linear(x, w13, tables=tables, pdl=pdl, scale=scale, one_kernel_sum=one_kernel_sum)
        return silu_mul.gated(both, intermediate)
    if scale is not None:
        op = torch.ops.enginewright.gate_up_scaled_pdl if pdl else torch.ops.enginewright.gate_up_scaled
        return op(x, w13, scale, config.key())
    op = torch.ops.enginewright.gate_up_pdl if pdl else torch.ops.enginewright.gate_up
    return op(x, w13, config.key())
