"""fp8 decode GEMMs on the FP8 tensor cores with split-K: e4m3 tokens x e4m3 weights, both scales in the epilogue.

A decode step's GEMM reads each weight once, so its time is the weight's bytes over the bandwidth. The
row-wise `torch._scaled_mm` tiles N only: an output narrower than about one wave of 128-wide tiles (8B
wqkv, wo, w2; every Llama-1B GEMM but w13) leaves SMs idle, and the weight-only decode kernels
(`skinny_gemm`, e4m3 converted to bf16 in registers, bf16 MMAs) reach about half the bandwidth at 64 rows
(docs/quantization.md). Here a
program per (BLOCK_N output columns, K slice) multiplies the weight tile [BLOCK_N, BLOCK_K] (e4m3, read as
stored) by the tokens' tile [BLOCK_K, BLOCK_M] (e4m3, each token scaled by its own max:
`quantize.quantize_tokens_fp8`, torch ops that the decode step's compile fuses into the RMSNorm or SiLU * up
before it) on the FP8 tensor cores, accumulating in float32. The product is transposed (out^T = W x^T), as in
`skinny_gemm`'s "dott" kernel, so the weight is the MMA's M side (64 or 128 wide) and the rows its N side
(BLOCK_M: 16 for one row, else 64); it is `skinny_gemm`'s "dott" kernel with e4m3 tokens (`TOKENS_SCALED`) and
its launcher. Each partial sum is multiplied by the weight's per-channel scale and the
token's scale, so `fp8_partials` returns `[split, M, N]` partial products of the real product: float32 when
K is split (the step sums them, fused by inductor into the next elementwise kernel), else bf16.

One token (M == 1) with `row_scaling_in_kernel` (`EngineOptions.fp8_row_scaling_in_kernel`): the kernel takes the bf16 row and scales it itself
(`_fp8_one_row_kernel`: each program reads the whole row from L2 for its largest magnitude, then converts its K
slice to e4m3 as it goes), so the decode step at batch 1 has no kernel of its own for that: at one row the
scaling kernels inductor writes (after the attention, and SiLU * up's row reduction in three kernels) cost more
in launches than the values they move. The e4m3 values and scales equal `quantize_tokens_fp8`'s (the scale
as the row's max times 1/448, the elements divided correctly rounded, `div_rn`), so the partial products equal the
two-step path's bit for bit.

The device's `fp8` tuned table (`tuned_tables`) holds the shapes (rows bucket, N, K) where this kernel was
measured faster than the engine's other fp8 paths (the fp8 GEMM sweep); `fp8_config_for` returns None
elsewhere and the caller keeps those paths.

Numerics are `quantize.fp8_scaled_linear`'s (the same e4m3 tokens and scales), accumulated in another order.
Registered as `torch.ops.enginewright.fp8_partials` (a `triton_op`, traced by torch.compile) and
`enginewright::fp8_partials_pdl` (opaque, launched with programmatic dependent launch; `serving.engine.pdl`).
Checked on CPU tensors under TRITON_INTERPRET=1 and on the GPU (tests/test_fp8_gemm.py).

Imports: stdlib and torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

from serving.engine.gemm_config import MAX_ROWS, GemmConfig, rows_bucket
from serving.engine.partials import sum_partials
from serving.engine.prescaled import E4M3_MAX
from serving.engine.skinny_gemm import empty_partials
from serving.engine.tuned_tables import Table

try:
    import triton
    from torch.library import triton_op

    from serving.engine.skinny_gemm import launch
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

FP8_KERNEL = "dott"  # the config texts name the transposed kernel's tiling (`GemmConfig`)
ROW_BLOCK = 2048  # elements of the row a program reads at once for its largest magnitude


def fits(config: GemmConfig, m: int, n: int, k: int) -> bool:
    """Whether `config` runs an [m, k] x [n, k]^T fp8 product: its K slices tile K, MMA-sized blocks."""
    return (config.kernel == FP8_KERNEL and 1 <= m <= MAX_ROWS and k % (config.split * config.block_k) == 0
            and config.block_k % 32 == 0 and config.block_n % 16 == 0)


def fp8_config_for(x: torch.Tensor, weight: torch.Tensor, table: Table) -> GemmConfig | None:
    """The config in `table` (the device's `TunedTables.fp8`) of x [M, K] (bf16, CUDA) times an e4m3 weight
    [N, K], or None (another path)."""
    if triton is None or not x.is_cuda or x.dtype != torch.bfloat16 or weight.dtype != torch.float8_e4m3fn:
        return None
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        return None
    config = table.get((rows_bucket(m), n, k))
    return config if config is not None and fits(config, m, n, k) else None


def empty_fp8_partials(xq: torch.Tensor, n: int, config: GemmConfig) -> torch.Tensor:
    """The [split, M, N] output: float32 when K is split, else bf16."""
    return empty_partials(xq, n, config, torch.bfloat16)


if triton is not None:
    import triton.language as tl

    from serving.engine.pdl import gdc, gdc_enter, kernel_for, launch_options

    @triton.jit
    def _fp8_one_row_kernel(x_ptr, w_ptr, out_ptr, N, K, k_split, stride_wn, stride_os, w_scale_ptr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr,
                            QMAX: tl.constexpr, GDC: tl.constexpr):
        """One bf16 token x [K] times the e4m3 weight [N, K]: the token's scale from its largest magnitude over
        the whole row (`quantize_tokens_fp8`'s), then the "dott" product of this program's K slice with the
        token converted to e4m3 tile by tile (padded to 16 columns for `tl.dot`), both scales in the epilogue."""
        if GDC:
            gdc_enter()
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_row = tl.arange(0, ROW_BLOCK)
        peak = tl.zeros((ROW_BLOCK,), tl.float32)
        for r0 in range(0, K, ROW_BLOCK):
            v = tl.load(x_ptr + r0 + offs_row, mask=r0 + offs_row < K, other=0.0)
            peak = tl.maximum(peak, tl.abs(v.to(tl.float32)))
        amax = tl.max(peak, 0)
        x_scale = tl.where(amax > 0, amax * (1.0 / QMAX), 1.0)
        offs_m = tl.arange(0, 16)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < 1
        n_mask = offs_n < N
        k_start = pid_s * k_split
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]  # [N, K]
        x_ptrs = x_ptr + k_start + offs_k
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
        for _ in range(0, k_split, BLOCK_K):
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(x, x_scale), -QMAX), QMAX)
            q = tl.where(m_mask[None, :], q[:, None], 0.0).to(w.dtype)  # [K, 16]: the token in column 0
            acc += tl.dot(w, q)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None] * x_scale
        out = acc.to(out_ptr.dtype.element_ty)
        dst = out_ptr + pid_s * stride_os + offs_m[None, :] * 0 + offs_n[:, None]
        tl.store(dst, out, mask=n_mask[:, None] & m_mask[None, :])

    def launch_fp8_one_row(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, config: GemmConfig, *,
                           pdl: bool = False) -> torch.Tensor:
        """[split, 1, N] partial products of one bf16 token x [1, K], scaled to e4m3 in the kernel, and the e4m3
        weight [N, K] with float32 scales [N]: what `launch_fp8` gives for `quantize_tokens_fp8(x)`."""
        m, k = x.shape
        n = weight.shape[0]
        if m != 1 or not fits(config, m, n, k):
            raise ValueError(f"fp8 GEMM config {config.key()} with the token scaled in the kernel does not fit "
                             f"M={m}, N={n}, K={k} (one row; K a multiple of split x block_k, block_k of 32s)")
        if (x.dtype != torch.bfloat16 or weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k
                or w_scale.shape != (n,) or w_scale.dtype != torch.float32):
            raise ValueError(f"fp8 GEMM needs a bf16 token [1, K] and an e4m3 weight [N, K] with float32 scales "
                             f"[N], got {x.dtype} {tuple(x.shape)}, {weight.dtype} {tuple(weight.shape)}, "
                             f"{w_scale.dtype} {tuple(w_scale.shape)}")
        x = x.contiguous()
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        out = empty_fp8_partials(x, n, config)
        grid = (triton.cdiv(n, config.block_n), config.split)
        kernel_for(_fp8_one_row_kernel, pdl)[grid](
            x, weight, out, n, k, k // config.split, weight.stride(0), out.stride(0), w_scale,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, ROW_BLOCK=ROW_BLOCK, QMAX=E4M3_MAX, GDC=gdc(pdl),
            num_warps=config.warps, num_stages=config.stages, **launch_options(pdl))
        return out

    @triton_op("enginewright::fp8_one_row_partials", mutates_args=())
    def _fp8_one_row_op(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, config: str) -> torch.Tensor:
        return launch_fp8_one_row(x, weight, w_scale, GemmConfig.parse(config))

    @torch.library.custom_op("enginewright::fp8_one_row_partials_pdl", mutates_args=())
    def _fp8_one_row_pdl_op(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, config: str
                            ) -> torch.Tensor:
        return launch_fp8_one_row(x, weight, w_scale, GemmConfig.parse(config), pdl=True)

    @_fp8_one_row_pdl_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, config: str) -> torch.Tensor:
        return empty_fp8_partials(x, weight.shape[0], GemmConfig.parse(config))

    def launch_fp8(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                   config: GemmConfig, *, pdl: bool = False) -> torch.Tensor:
        """[split, M, N] partial products of the e4m3 tokens xq [M, K] (scales [M] or [M, 1], float32) and the
        e4m3 weight [N, K] (scales [N], float32), the tuning entry point; `pdl`: launched with programmatic
        dependent launch (Hopper and later). `skinny_gemm`'s "dott" kernel with both operands e4m3."""
        m, k = xq.shape
        n = weight.shape[0]
        if not fits(config, m, n, k):
            raise ValueError(f"fp8 GEMM config {config.key()} does not fit M={m}, N={n}, K={k} (kernel "
                             f"{FP8_KERNEL!r}, K a multiple of split x block_k, block_k a multiple of 32)")
        if (xq.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k
                or x_scale.numel() != m or w_scale.shape != (n,)
                or x_scale.dtype != torch.float32 or w_scale.dtype != torch.float32):
            raise ValueError(f"fp8 GEMM needs e4m3 tokens [M, K] with float32 scales [M] and an e4m3 weight [N, K] "
                             f"with float32 scales [N], got {xq.dtype} {tuple(xq.shape)}, {x_scale.dtype} "
                             f"{tuple(x_scale.shape)}, {weight.dtype} {tuple(weight.shape)}, {w_scale.dtype} "
                             f"{tuple(w_scale.shape)}")
        return launch(xq, weight, config, pdl=pdl, scale=w_scale, x_scale=x_scale)

    @triton_op("enginewright::fp8_partials", mutates_args=())
    def _fp8_partials_op(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                         config: str) -> torch.Tensor:
        return launch_fp8(xq, x_scale, weight, w_scale, GemmConfig.parse(config))

    @torch.library.custom_op("enginewright::fp8_partials_pdl", mutates_args=())
    def _fp8_partials_pdl_op(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                             config: str) -> torch.Tensor:
        return launch_fp8(xq, x_scale, weight, w_scale, GemmConfig.parse(config), pdl=True)

    @_fp8_partials_pdl_op.register_fake
    def _(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, config: str
          ) -> torch.Tensor:
        return empty_fp8_partials(xq, weight.shape[0], GemmConfig.parse(config))


def fp8_partials(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, config: GemmConfig, *,
                 pdl: bool = False, row_scaling_in_kernel: bool = False) -> torch.Tensor:
    """x [M, K] (bf16) times the e4m3 weight [N, K] with per-row scales [N], as [split, M, N] partial products:
    the tokens scaled to e4m3 each by its own max (torch ops: fused into x's producer when compiled), then
    the registered op; one token with `row_scaling_in_kernel` is scaled inside the kernel (module doc)."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the fp8 GEMM kernel")
    if row_scaling_in_kernel and x.shape[0] == 1:
        op = torch.ops.enginewright.fp8_one_row_partials_pdl if pdl else torch.ops.enginewright.fp8_one_row_partials
        return op(x, weight, w_scale, config.key())
    from serving.engine.quantize import quantize_tokens_fp8

    xq, x_scale = quantize_tokens_fp8(x)
    op = torch.ops.enginewright.fp8_partials_pdl if pdl else torch.ops.enginewright.fp8_partials
    return op(xq, x_scale, weight, w_scale, config.key())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               config: GemmConfig, pdl: bool = False, row_scaling_in_kernel: bool = False,
               one_kernel_sum: bool = True) -> torch.Tensor:
    """`quantize.fp8_scaled_linear` for decode rows through this kernel: x [M, K] -> [M, N] in x's dtype."""
    out = sum_partials(fp8_partials(x, weight, w_scale, config, pdl=pdl, row_scaling_in_kernel=row_scaling_in_kernel),
                       x.dtype, one_kernel=one_kernel_sum)
    return out if bias is None else out + bias
