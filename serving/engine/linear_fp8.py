"""The fp8 linear layer: an e4m3 weight with per-row scales (`linear_quantized.QuantLinear`), its GEMMs picked at load.

`apply_options` picks, by row count:

- prompt rows (more than 64): the FP8 tensor cores (`torch._scaled_mm`, tokens scaled to e4m3 each by its own
  max) where the GPU has them (compute capability 8.9+), the engine is bf16 and the shape takes them; else the
  dequantizing reference;
- decode rows with the options' "triton" GEMMs, for one row and for 2-15 / 16-64 rows: the split-K FP8 kernel
  where the device's `fp8` table has the shape (`fp8_gemm`); from 16 rows, outputs at least
  `FP8_TENSOR_CORE_MIN_N` wide on `_scaled_mm` (its row-wise GEMM tiles N alone: a narrower output leaves SMs
  idle); else the weight-only skinny kernel (e4m3 converted to bf16 in registers); `fp8_decode_tensor_cores`
  off keeps the decode rows off the tensor cores altogether;
- decode rows with "torch" GEMMs: `_scaled_mm` from 16 rows (if allowed), the reference below.

For w13, `gated` runs the fused silu(gate) * up kernel where the rows take the skinny kernel and the
`gate_up_quantized` table has the shape; otherwise the product above, then SiLU * up.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import torch

from serving.engine.gemm_config import MAX_ROWS
from serving.engine.linear_quantized import QuantLinear
from serving.engine.linear_routes import (
    ANY_ROWS,
    Dequantized,
    GateUpKernel,
    Route,
    Routes,
    Skinny,
    SplitKFp8,
    TensorCores,
    Unfused,
)
from serving.engine.options import EngineOptions
from serving.engine.quantize import FP8, FP8_TENSOR_CORE_MIN_N, FP8_TENSOR_CORE_MIN_ROWS, has_fp8_tensor_cores

FEW_ROWS = FP8_TENSOR_CORE_MIN_ROWS - 1  # decode rows below the tensor cores' least


class Fp8Linear(QuantLinear):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, method=FP8, bias=bias, dtype=dtype)

    def apply_options(self, options: EngineOptions) -> None:
        self.prescale_rows = options.prescale_rows and self.weight.is_cuda
        self.routes, self.gated_routes = fp8_routes(self, options)

    def takes_tensor_cores(self) -> bool:
        """Whether `_scaled_mm` runs this layer here: CUDA with FP8 tensor cores, a bf16 engine, N and K
        multiples of 16."""
        n, k = self.weight.shape
        device = self.weight.device
        return (device.type == "cuda" and self.compute_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
                and has_fp8_tensor_cores(device.index or 0))


def fp8_routes(layer: Fp8Linear, options: EngineOptions) -> tuple[Routes, Routes]:
    """The layer's routes under `options` (module doc)."""
    tensor_cores = layer.takes_tensor_cores()
    prompt: Route = TensorCores(options.fp8_fast_accum) if tensor_cores else Dequantized()
    decode_tensor_cores = options.fp8_decode_tensor_cores and tensor_cores
    if not (options.triton_gemms and layer.weight.is_cuda):
        few = FEW_ROWS if decode_tensor_cores else MAX_ROWS
        return ((few, Dequantized()), (ANY_ROWS, prompt)), ((ANY_ROWS, Unfused()),)
    from serving.engine import fp8_gemm, gate_up
    from serving.engine.skinny_gemm import quantized_config_for

    n, k = layer.weight.shape
    routes: list[tuple[int, Route]] = []
    gated: list[tuple[int, Route]] = []
    for rows in (1, FEW_ROWS, MAX_ROWS):  # each bucket's route, picked at its largest row count
        split_k = options.tuned.fp8.get((1 if rows == 1 else MAX_ROWS, n, k))
        if decode_tensor_cores and layer.bias is None and split_k is not None and fp8_gemm.fits(split_k, rows, n, k):
            route: Route = SplitKFp8(split_k, options.fp8_row_scaling_in_kernel, options.partial_sums_one_kernel)
        elif decode_tensor_cores and rows >= FP8_TENSOR_CORE_MIN_ROWS and n >= FP8_TENSOR_CORE_MIN_N:
            route = prompt
        elif (config := quantized_config_for(rows, n, k, options.tuned)) is not None:
            route = Skinny(config, scaled=True, one_kernel_sum=options.partial_sums_one_kernel)
        else:
            route = prompt if decode_tensor_cores and rows >= FP8_TENSOR_CORE_MIN_ROWS else Dequantized()
        routes.append((rows, route))
        fused = (gate_up.config_for(rows, n // 2, k, options.tuned, quantized=True)
                 if options.decode_gate_up and isinstance(route, Skinny) else None)
        gated.append((rows, GateUpKernel(fused, scaled=True) if fused is not None and gate_up.fits(fused, rows, k)
                      else Unfused()))
    return (*routes, (ANY_ROWS, prompt)), (*gated, (ANY_ROWS, Unfused()))
