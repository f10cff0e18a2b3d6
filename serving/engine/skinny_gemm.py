"""Linear layers of the decode step (few rows, M <= 64) as split-K Triton kernels, with a torch fallback.

A decode step multiplies a handful of activation rows by each weight matrix once, so its GEMMs are
bound by reading the weights. cuBLAS picks tiles for these skinny shapes that leave SMs idle (Llama-8B
wqkv at M=64: 96 tiles of 64x64 on 132 SMs) or adds a split-K reduction kernel per GEMM.

`skinny_partials(x [M, K], weight [N, K], config)` returns the partial products `[split, M, N]` of
`config.split` slices of K (float32 when split > 1, else x.dtype); `skinny_linear` sums them and adds
the bias. Under torch.compile the sum is an ordinary reduction that inductor fuses into the next
elementwise kernel (the residual add, SiLU * up, rotary), so split-K costs no extra kernel.

Three kernels:
- "dot": a program per (BLOCK_N columns, K slice) loads all M rows (padded to BLOCK_M >= 16 for
  `tl.dot`) and its weight tile, accumulating in float32 on the tensor cores;
- "dott" (the same product transposed, out^T = W x^T): the weight tile is the first operand, which
  Hopper's tensor cores can take from registers, so a quantized tile converted there goes straight into
  the product instead of back through shared memory (the "dot" kernel on fp8 weights at 64 rows reached
  about half the bandwidth it reaches on bf16 ones: docs/quantization.md);
- "gemv" (M == 1): a program per (BLOCK_N columns, K slice) multiplies and sums on the CUDA cores.

`config_for(m, n, k, table)` looks the shape up in the device's tuned table (`tuned_tables`, written by the
GEMM sweep); shapes not in it return None and the caller keeps F.linear (cuBLAS). A device without tuned
tables runs no tuned config: there a config may need more shared memory than there is, and cuBLAS may well
be faster.

The op is registered as `torch.ops.enginewright.skinny_partials` (a `triton_op`), so it traces under
torch.compile(fullgraph=True) and launches inside CUDA-graph capture. Checked on CPU tensors under
TRITON_INTERPRET=1 (tests/test_skinny_gemm.py) and on the GPU (`gpu` tests there).

Imports: stdlib and torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

from serving.engine.gemm_config import MAX_ROWS, GemmConfig, parse_table, rows_bucket  # noqa: F401 (the kernels' names)
from serving.engine.partials import sum_partials
from serving.engine.tuned_tables import Table, TunedTables

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from serving.engine.pdl import gdc, gdc_enter, kernel_for, launch_options
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
TARGET_PROGRAMS = 2 * 132  # two programs per SM of a 132-SM Hopper GPU for the default quantized config


def config_for(m: int, n: int, k: int, table: Table) -> GemmConfig | None:
    """The tuned config of an [m, k] x [n, k]^T product in `table` (`TunedTables.skinny`), or None (F.linear)."""
    if m > MAX_ROWS:
        return None
    return table.get((rows_bucket(m), n, k))


def quantized_config_for(m: int, n: int, k: int, tables: TunedTables, *, int8: bool = False) -> GemmConfig | None:
    """The config of an [m, k] x [n, k]^T product with a quantized weight: for an `int8` one `skinny_int8`, then
    `skinny_fp8`, else the bf16 table's, else `default_quantized_config` (a quantized weight never takes
    F.linear in the decode step, which would dequantize the whole matrix first)."""
    if m > MAX_ROWS:
        return None
    key = (rows_bucket(m), n, k)
    config = ((tables.skinny_int8.get(key) if int8 else None) or tables.skinny_fp8.get(key) or tables.skinny.get(key))
    if config is not None and config.fits(m, n, k):
        return config
    return default_quantized_config(n, k)


def default_quantized_config(n: int, k: int) -> GemmConfig | None:
    """A "dot" config of 64 x 128 tiles, K split until the grid has about `TARGET_PROGRAMS` programs; None
    where K is not a multiple of 16 (`tl.dot`'s least)."""
    block_k = next((b for b in (128, 64, 32, 16) if k % b == 0), None)
    if block_k is None:
        return None
    tiles = -(-n // 64)
    split = 1
    while tiles * split * 2 <= TARGET_PROGRAMS and k % (split * 2 * block_k) == 0:
        split *= 2
    return GemmConfig("dot", 64, block_k, split, 4, 4)


def block_m(m: int) -> int:
    """Rows of the dot kernel's tile: 16 (the least `tl.dot` takes) for one row, else all 64, so that a
    dynamic-shape compile of the decode step needs no guard beyond the batch-1 one dynamo always makes."""
    return 16 if m == 1 else MAX_ROWS


if triton is not None:

    @triton.jit
    def widen(w, dtype: tl.constexpr, INT8_BITS: tl.constexpr):
        """A weight tile in `dtype`, exactly. INT8_BITS: an int8 tile widened to float32 goes through float32
        bits, 2^23 + 128 + w read as a float32 less 2^23 + 128 (integer and float adds), where Triton converts
        with I2F, one weight per instruction on the SM's conversion units (the gemv kernel for sm_90: 32 I2F
        per thread per 16 x 256 tile). To bf16 Triton already converts with byte permutes and half adds."""
        if INT8_BITS:  # noqa: SIM102 - each a compile-time test, nested as Triton compiles them in every version
            if w.dtype == tl.int8:  # noqa: SIM102
                if dtype == tl.float32:
                    w = (w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        return w.to(dtype)

    @triton.jit
    def _dot_kernel(x_ptr, w_ptr, out_ptr, M, N, k_split, stride_xm, stride_wn, stride_os, stride_om,
                    max_ptr, arg_ptr, n_tiles, scale_ptr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE_DOT: tl.constexpr, GDC: tl.constexpr, GREEDY: tl.constexpr = False,
                    SCALED: tl.constexpr = False):
        """GREEDY (one K slice): also each row's largest rounded product in the tile and its column, at
        [M, n_tiles] max_ptr / arg_ptr (`lm_head`). SCALED: the weight is quantized (int8 / e4m3), converted
        to x's dtype in registers (exact), and each column's sum multiplied by its scale [N] at scale_ptr."""
        if GDC:
            gdc_enter()
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        k_start = pid_s * k_split
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (k_start + offs_k)[:, None]  # [K, N] view
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for _ in range(0, k_split, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
            if SCALED:
                w = widen(w, x.dtype, True)
            if IEEE_DOT:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SCALED:
            acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        dst = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(dst, out, mask=m_mask[:, None] & n_mask[None, :])
        if GREEDY:
            rounded = tl.where(n_mask[None, :], out.to(tl.float32), float("-inf"))
            best = tl.max(rounded, 1)
            column = pid_n * BLOCK_N + tl.argmax(rounded, 1, tie_break_left=True)
            tl.store(max_ptr + offs_m * n_tiles + pid_n, best, mask=m_mask)
            tl.store(arg_ptr + offs_m * n_tiles + pid_n, column, mask=m_mask)

    @triton.jit
    def _dot_t_kernel(x_ptr, w_ptr, out_ptr, M, N, k_split, stride_xm, stride_wn, stride_os, stride_om, scale_ptr,
                      x_scale_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      IEEE_DOT: tl.constexpr, GDC: tl.constexpr, SCALED: tl.constexpr = False,
                      TOKENS_SCALED: tl.constexpr = False):
        """The "dot" kernel's product as out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, K] x^T [K, BLOCK_M].
        TOKENS_SCALED: x is e4m3 too (`fp8_gemm`: the FP8 tensor cores), each row's sum multiplied by its
        token's float32 scale [M] at x_scale_ptr."""
        if GDC:
            gdc_enter()
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        k_start = pid_s * k_split
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]  # [N, K]
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_start + offs_k)[:, None]  # [K, M] view
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for _ in range(0, k_split, BLOCK_K):
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            if SCALED:
                w = widen(w, x.dtype, True)
            if IEEE_DOT:
                acc += tl.dot(w, x, input_precision="ieee")
            else:
                acc += tl.dot(w, x)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SCALED:
            acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        if TOKENS_SCALED:
            acc = acc * tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
        out = acc.to(out_ptr.dtype.element_ty)
        dst = out_ptr + pid_s * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(dst, out, mask=n_mask[:, None] & m_mask[None, :])

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, k_split, stride_wn, stride_os, scale_ptr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr, SCALED: tl.constexpr = False,
                     INT8_BITS: tl.constexpr = True):
        if GDC:
            gdc_enter()
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        k_start = pid_s * k_split
        x_ptrs = x_ptr + k_start + offs_k
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_start + offs_k)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for _ in range(0, k_split, BLOCK_K):
            x = tl.load(x_ptrs).to(tl.float32)
            w = widen(tl.load(w_ptrs, mask=n_mask[:, None], other=0.0), tl.float32, INT8_BITS)
            acc += w * x[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = tl.sum(acc, 1)
        if SCALED:
            out = out * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(out_ptr + pid_s * stride_os + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)

    def launch(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, *, pdl: bool = False,
               greedy: tuple[torch.Tensor, torch.Tensor] | None = None,
               scale: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
               int8_float_bits: bool = True) -> torch.Tensor:
        """[split, M, N] partial products of x [M, K] and weight [N, K] (the tuning entry point); `pdl`:
        launched with programmatic dependent launch (Hopper and later, CUDA only); `greedy`: the [M, tiles]
        float32 maxima and int32 columns that `tile_maxima` allocates, written by a one-slice "dot" config;
        `scale`: the weight is quantized (int8 / float8_e4m3fn) with these float32 per-row scales [N];
        `x_scale`: x is e4m3 tokens with these float32 per-row scales [M] (a "dott" config, an e4m3 weight
        with its scales: `fp8_gemm`), the output bf16; `int8_float_bits`: the gemv kernel widens int8 tiles
        through float32 bits (`widen`), False: by int-to-float conversions (what the GEMM sweep times beside it)."""
        m, k = x.shape
        n = weight.shape[0]
        if not config.fits(m, n, k):
            raise ValueError(f"skinny GEMM config {config.key()} does not fit M={m}, N={n}, K={k}")
        if scale is not None and (weight.dtype not in QUANTIZED_DTYPES or scale.shape != (n,)
                                  or scale.dtype != torch.float32):
            raise ValueError(f"skinny GEMM with scales needs an int8 / float8_e4m3fn weight [N, K] and float32 scales "
                             f"[N], got {weight.dtype} {tuple(weight.shape)} and {scale.dtype} {tuple(scale.shape)}")
        if weight.shape[1] != k or (scale is None and x.dtype != weight.dtype):
            raise ValueError(f"skinny GEMM needs x [M, K] and weight [N, K] of one dtype, got {tuple(x.shape)} "
                             f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
        if greedy is not None and (config.kernel != "dot" or config.split != 1
                                   or greedy[0].shape != (m, triton.cdiv(n, config.block_n))):
            raise ValueError(f"skinny GEMM config {config.key()}: greedy maxima need a 'dot' config, one K slice "
                             f"and [M={m}, {triton.cdiv(n, config.block_n)}] outputs, got {tuple(greedy[0].shape)}")
        if x_scale is not None and (config.kernel != "dott" or scale is None or x_scale.numel() != m
                                    or x_scale.dtype != torch.float32):
            raise ValueError(f"skinny GEMM with token scales needs a 'dott' config, weight scales and float32 "
                             f"token scales [M={m}], got {config.key()}, {x_scale.dtype} {tuple(x_scale.shape)}")
        x = x.contiguous()
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        out = empty_partials(x, n, config, torch.bfloat16 if x_scale is not None else x.dtype)
        k_split = k // config.split
        grid = (triton.cdiv(n, config.block_n), config.split)
        options = {"num_warps": config.warps, "num_stages": config.stages, **launch_options(pdl)}
        scales = scale if scale is not None else x.new_empty(1, dtype=torch.float32)  # (unread when unscaled)
        if config.kernel == "dott":
            x_scales = x_scale.reshape(m).contiguous() if x_scale is not None else scales
            kernel_for(_dot_t_kernel, pdl)[grid](
                x, weight, out, m, n, k_split, x.stride(0), weight.stride(0), out.stride(0), out.stride(1), scales,
                x_scales, BLOCK_M=block_m(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                IEEE_DOT=x.dtype == torch.float32, GDC=gdc(pdl), SCALED=scale is not None,
                TOKENS_SCALED=x_scale is not None, **options)
        elif config.kernel == "gemv":
            kernel_for(_gemv_kernel, pdl)[grid](
                x, weight, out, n, k_split, weight.stride(0), out.stride(0), scales,
                BLOCK_N=config.block_n, BLOCK_K=config.block_k, GDC=gdc(pdl), SCALED=scale is not None,
                INT8_BITS=int8_float_bits, **options)
        else:
            # never written without `greedy`; tensors of their own, as torch.compile does not handle a traced
            # kernel's arguments that alias
            maxima, columns = greedy if greedy is not None else tile_maxima(x, 1, 1)
            kernel_for(_dot_kernel, pdl)[grid](
                x, weight, out, m, n, k_split, x.stride(0), weight.stride(0), out.stride(0), out.stride(1),
                maxima, columns, grid[0], scales, BLOCK_M=block_m(m), BLOCK_N=config.block_n,
                BLOCK_K=config.block_k, IEEE_DOT=x.dtype == torch.float32, GDC=gdc(pdl), GREEDY=greedy is not None,
                SCALED=scale is not None, **options)
        return out

    @triton_op("enginewright::skinny_partials", mutates_args=())
    def _skinny_partials_op(x: torch.Tensor, weight: torch.Tensor, config: str) -> torch.Tensor:
        return launch(x, weight, GemmConfig.parse(config))

    # inductor launches the kernels of a triton_op itself, without the PDL launch attribute: this variant
    # is opaque to it, and launches them with the attribute (inside a CUDA graph, as any other launch)
    @torch.library.custom_op("enginewright::skinny_partials_pdl", mutates_args=())
    def _skinny_partials_pdl_op(x: torch.Tensor, weight: torch.Tensor, config: str) -> torch.Tensor:
        return launch(x, weight, GemmConfig.parse(config), pdl=True)

    @_skinny_partials_pdl_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, config: str) -> torch.Tensor:
        return empty_partials(x, weight.shape[0], GemmConfig.parse(config))

    # the quantized weights' variants: the weight int8 / e4m3 with per-row float32 scales
    @triton_op("enginewright::skinny_partials_scaled", mutates_args=())
    def _skinny_partials_scaled_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: str
                                   ) -> torch.Tensor:
        return launch(x, weight, GemmConfig.parse(config), scale=scale)

    @torch.library.custom_op("enginewright::skinny_partials_scaled_pdl", mutates_args=())
    def _skinny_partials_scaled_pdl_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: str
                                       ) -> torch.Tensor:
        return launch(x, weight, GemmConfig.parse(config), pdl=True, scale=scale)

    @_skinny_partials_scaled_pdl_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: str) -> torch.Tensor:
        return empty_partials(x, weight.shape[0], GemmConfig.parse(config))


def empty_partials(x: torch.Tensor, n: int, config: GemmConfig, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [split, M, N] output of x [M, K] times an [N, K] weight: float32 when K is split, else `dtype`
    (default x.dtype)."""
    return x.new_empty((config.split, x.shape[0], n), dtype=torch.float32 if config.split > 1 else dtype or x.dtype)


def tile_maxima(x: torch.Tensor, n: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The [M, ceil(n / block_n)] float32 maxima and int32 columns a greedy launch writes."""
    shape = (x.shape[0], -(-n // block_n))
    return (x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int32))


def triton_available() -> bool:
    return triton is not None


def skinny_partials(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, *, pdl: bool = False,
                    scale: torch.Tensor | None = None) -> torch.Tensor:
    """[split, M, N] partial products through the registered op (CUDA; CPU under TRITON_INTERPRET=1);
    `pdl`: launched with programmatic dependent launch (CUDA, Hopper and later); `scale`: the weight is
    quantized with these per-row scales."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the skinny GEMM kernels")
    if scale is not None:
        op = torch.ops.enginewright.skinny_partials_scaled_pdl if pdl else torch.ops.enginewright.skinny_partials_scaled
        return op(x, weight, scale, config.key())
    if pdl:
        return torch.ops.enginewright.skinny_partials_pdl(x, weight, config.key())
    return torch.ops.enginewright.skinny_partials(x, weight, config.key())


def kernel_config(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None,
                  tables: TunedTables | None = None) -> GemmConfig | None:
    """The config the product of x [M, K] and weight [N, K] runs with (`config`, else on CUDA the one in
    `tables`: for a quantized weight `quantized_config_for`), or None for F.linear."""
    m, k = x.shape
    n = weight.shape[0]
    if config is None and tables is not None and x.is_cuda and triton is not None:
        config = (quantized_config_for(m, n, k, tables, int8=weight.dtype == torch.int8)
                  if weight.dtype in QUANTIZED_DTYPES else config_for(m, n, k, tables.skinny))
    return config if config is not None and config.fits(m, n, k) else None


def skinny_linear_parts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        config: GemmConfig | None = None, tables: TunedTables | None = None, pdl: bool = False,
                        scale: torch.Tensor | None = None) -> torch.Tensor:
    """`skinny_linear` left as its partial products [split, M, N] for a consumer that sums them itself
    (the decode attention kernel); [1, M, N] where no kernel config fits, or with a bias."""
    config = kernel_config(x, weight, config, tables) if bias is None else None
    if config is None:
        return _fallback_linear(x, weight, bias, scale).unsqueeze(0)
    return skinny_partials(x, weight, config, pdl=pdl, scale=scale)


def _fallback_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     scale: torch.Tensor | None) -> torch.Tensor:
    """F.linear, with a quantized weight dequantized first (the reference path)."""
    if scale is not None:
        weight = (weight.float() * scale[:, None]).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  config: GemmConfig | None = None, tables: TunedTables | None = None, pdl: bool = False,
                  scale: torch.Tensor | None = None, one_kernel_sum: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K]: the Triton kernel when a config fits (`config`, else on CUDA
    the shape's in `tables`; M <= 64), else F.linear. The partial sums are added in float32 and rounded
    once to x.dtype, as cuBLAS does (`one_kernel_sum`: `partials.sum_partials`'s). `scale`: `weight` is
    quantized (int8 / e4m3) with these per-row float32 scales; the kernel reads it at that precision."""
    config = kernel_config(x, weight, config, tables)
    if config is None:
        return _fallback_linear(x, weight, bias, scale)
    out = sum_partials(skinny_partials(x, weight, config, pdl=pdl, scale=scale), x.dtype, one_kernel=one_kernel_sum)
    return out if bias is None else out + bias
