"""fp8 decode GEMMs on the FP8 tensor cores with split-K: e4m3 tokens x e4m3 weights, both scales in the epilogue.

A decode step's GEMM reads each weight once, so its time is the weight's bytes over the bandwidth. The
row-wise `torch._scaled_mm` tiles N only: an output narrower than about one wave of 128-wide tiles (8B
wqkv, wo, w2; every Llama-1B GEMM but w13) leaves SMs idle, and the weight-only decode kernels
(`skinny_gemm`, e4m3 converted to bf16 in registers, bf16 MMAs) reach about 2 TB/s at 64 rows. Here a
program per (BLOCK_N output columns, K slice) multiplies the weight tile [BLOCK_N, BLOCK_K] (e4m3, read as
stored) by the tokens' tile [BLOCK_K, BLOCK_M] (e4m3, each token scaled by its own max:
`quantize.quantize_tokens_fp8`, torch ops that the decode step's compile fuses into the RMSNorm or SiLU * up
before it) on the FP8 tensor cores, accumulating in float32. The product is transposed (out^T = W x^T), as in
`skinny_gemm`'s "dott" kernel, so the weight is the MMA's M side (64 or 128 wide) and the rows its N side
(BLOCK_M: 16 for one row, else 64); it is `skinny_gemm`'s "dott" kernel with e4m3 tokens (`TOKENS_SCALED`) and
its launcher. Each partial sum is multiplied by the weight's per-channel scale and the
token's scale, so `fp8_partials` returns `[split, M, N]` partial products of the real product: float32 when
K is split (the step sums them, fused by inductor into the next elementwise kernel), else bf16.

`TUNED_FP8` holds the shapes (rows bucket, N, K) where this kernel was measured faster than the engine's
other fp8 paths (`python3 -m serving.bench fp8-gemms` on an H200); `fp8_config_for` returns None elsewhere
and the caller keeps those paths.

Numerics are `quantize.fp8_scaled_linear`'s (the same e4m3 tokens and scales), accumulated in another order.
Registered as `torch.ops.enginewright.fp8_partials` (a `triton_op`, traced by torch.compile) and
`enginewright::fp8_partials_pdl` (opaque, launched with programmatic dependent launch; `serving.engine.pdl`).
Checked on CPU tensors under TRITON_INTERPRET=1 and on the GPU (tests/test_fp8_gemm.py).

Imports: stdlib and torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

from serving.engine.partials import sum_partials
from serving.engine.skinny_gemm import MAX_ROWS, GemmConfig, empty_partials, parse_table, rows_bucket

try:
    import triton
    from torch.library import triton_op

    from serving.engine.skinny_gemm import launch
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

FP8_KERNEL = "dott"  # the config texts name the transposed kernel's tiling (`GemmConfig`)

# (rows bucket, N, K) -> config, from `python3 -m serving.bench fp8-gemms` (H200, 2026-12-01, cold L2, in CUDA
# graphs; docs/quantization.md): where the kernel beat the engine's other fp8 path by more than 2% ("vs": the
# weight-only decode kernel, or `_scaled_mm` on pre-scaled tokens for w13 at 64 rows). Rows bucket: 1 for one
# row (BLOCK_M 16), else 64 (2..64 rows). Llama-1B wo at one row (3.3 vs 3.3 us) keeps the weight-only gemv.
TUNED_FP8: dict[tuple[int, int, int], str] = {
    # Llama-3.2-1B
    (1, 3072, 2048): "dott:n64:k128:s8:w4:st4",  # wqkv: 4.0 vs 4.2 us
    (1, 16384, 2048): "dott:n64:k128:s2:w4:st3",  # w13: 10.1 vs 11.2 us
    (1, 2048, 8192): "dott:n64:k256:s8:w4:st3",  # w2: 6.2 vs 7.1 us
    (64, 3072, 2048): "dott:n64:k256:s2:w4:st4",  # wqkv: 5.0 vs 7.2 us
    (64, 2048, 2048): "dott:n64:k128:s4:w4:st4",  # wo: 4.2 vs 5.6 us
    (64, 16384, 2048): "dott:n64:k128:s1:w4:st4",  # w13: 11.2 vs 14.3 us (_scaled_mm)
    (64, 2048, 8192): "dott:n64:k256:s4:w4:st4",  # w2: 7.2 vs 11.0 us
    # Llama-3.1-8B
    (1, 6144, 4096): "dott:n64:k128:s4:w4:st4",  # wqkv: 8.1 vs 9.9 us
    (1, 4096, 4096): "dott:n64:k256:s4:w4:st3",  # wo: 6.3 vs 6.9 us
    (1, 28672, 4096): "dott:n64:k128:s2:w4:st3",  # w13: 29.3 vs 35.7 us (4.0 TB/s)
    (1, 4096, 14336): "dott:n64:k256:s4:w4:st4",  # w2: 15.7 vs 19.0 us
    (64, 6144, 4096): "dott:n64:k256:s1:w4:st5",  # wqkv: 9.7 vs 14.8 us
    (64, 4096, 4096): "dott:n64:k256:s2:w4:st5",  # wo: 7.3 vs 11.2 us
    (64, 28672, 4096): "dott:n128:k128:s1:w8:st3",  # w13: 32.2 vs 46.3 us (_scaled_mm; 3.65 TB/s)
    (64, 4096, 14336): "dott:n64:k256:s2:w4:st5",  # w2: 17.9 vs 29.6 us
}
TUNED_FP8_CONFIGS: dict[tuple[int, int, int], GemmConfig] = parse_table(TUNED_FP8)


def install_table(table: dict[tuple[int, int, int], str]) -> None:
    """Replace `TUNED_FP8` (the bench's sweeps install what they measured for one process)."""
    TUNED_FP8.clear()
    TUNED_FP8.update(table)
    TUNED_FP8_CONFIGS.clear()
    TUNED_FP8_CONFIGS.update(parse_table(table))


def fits(config: GemmConfig, m: int, n: int, k: int) -> bool:
    """Whether `config` runs an [m, k] x [n, k]^T fp8 product: its K slices tile K, MMA-sized blocks."""
    return (config.kernel == FP8_KERNEL and 1 <= m <= MAX_ROWS and k % (config.split * config.block_k) == 0
            and config.block_k % 32 == 0 and config.block_n % 16 == 0)


def fp8_config_for(x: torch.Tensor, weight: torch.Tensor) -> GemmConfig | None:
    """The tuned config of x [M, K] (bf16, CUDA) times an e4m3 weight [N, K], or None (another path).
    By dtype, device type and shape only, so that dynamo traces it without a device query: the decode step
    asks only when it runs the "triton" GEMMs, which `runner.pick_decode_gemm` picks on compute capability
    9.0 alone (`skinny_gemm.TUNED_CAPABILITY`, the GPU these tables were measured on)."""
    if triton is None or not x.is_cuda or x.dtype != torch.bfloat16 or weight.dtype != torch.float8_e4m3fn:
        return None
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        return None
    config = TUNED_FP8_CONFIGS.get((rows_bucket(m), n, k))
    return config if config is not None and fits(config, m, n, k) else None


def empty_fp8_partials(xq: torch.Tensor, n: int, config: GemmConfig) -> torch.Tensor:
    """The [split, M, N] output: float32 when K is split, else bf16."""
    return empty_partials(xq, n, config, torch.bfloat16)


if triton is not None:

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
                 pdl: bool = False) -> torch.Tensor:
    """x [M, K] (bf16) times the e4m3 weight [N, K] with per-row scales [N], as [split, M, N] partial products:
    the tokens scaled to e4m3 each by its own max (torch ops: fused into x's producer when compiled), then
    the registered op."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the fp8 GEMM kernel")
    from serving.engine.quantize import quantize_tokens_fp8

    xq, x_scale = quantize_tokens_fp8(x)
    op = torch.ops.enginewright.fp8_partials_pdl if pdl else torch.ops.enginewright.fp8_partials
    return op(xq, x_scale, weight, w_scale, config.key())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               config: GemmConfig, pdl: bool = False) -> torch.Tensor:
    """`quantize.fp8_scaled_linear` for decode rows through this kernel: x [M, K] -> [M, N] in x's dtype."""
    out = sum_partials(fp8_partials(x, weight, w_scale, config, pdl=pdl), x.dtype)
    return out if bias is None else out + bias
