"""The int8 weight-only linear layer: an int8 weight with per-row scales (`linear_quantized.QuantLinear`), activations
in the engine dtype, its GEMMs picked at load.

`apply_options` picks, with the options' "triton" decode GEMMs on CUDA, the weight-only skinny kernel for one
row and for 2-64 rows (the device's `skinny_int8` config, else `skinny_fp8`'s, else the bf16 table's, else a
default tiling: `skinny_gemm.quantized_config_for`), and for w13 the fused silu(gate) * up kernel where the
`gate_up_quantized` table has the shape; the dequantizing reference everywhere else (prompt rows, the CPU).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import torch

from serving.engine.gemm_config import MAX_ROWS
from serving.engine.linear_quantized import QuantLinear
from serving.engine.linear_routes import ANY_ROWS, Dequantized, GateUpKernel, Route, Routes, Skinny, Unfused
from serving.engine.options import EngineOptions
from serving.engine.quantize import INT8_WEIGHT_ONLY


class Int8Linear(QuantLinear):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, method=INT8_WEIGHT_ONLY, bias=bias, dtype=dtype)

    def apply_options(self, options: EngineOptions) -> None:
        self.routes, self.gated_routes = int8_routes(self, options)


def int8_routes(layer: Int8Linear, options: EngineOptions) -> tuple[Routes, Routes]:
    """The layer's routes under `options` (module doc)."""
    plain: tuple[Routes, Routes] = ((ANY_ROWS, Dequantized()),), ((ANY_ROWS, Unfused()),)
    if not (options.triton_gemms and layer.weight.is_cuda):
        return plain
    from serving.engine import gate_up
    from serving.engine.skinny_gemm import quantized_config_for

    n, k = layer.weight.shape
    routes: list[tuple[int, Route]] = []
    gated: list[tuple[int, Route]] = []
    for rows in (1, MAX_ROWS):  # each bucket's config, looked up at its largest row count
        config = quantized_config_for(rows, n, k, options.tuned, int8=True)
        routes.append((rows, Dequantized() if config is None
                       else Skinny(config, scaled=True, one_kernel_sum=options.partial_sums_one_kernel)))
        fused = gate_up.config_for(rows, n // 2, k, options.tuned, quantized=True) if options.decode_gate_up else None
        gated.append((rows, GateUpKernel(fused, scaled=True) if fused is not None and gate_up.fits(fused, rows, k)
                      else Unfused()))
    return (*routes, (ANY_ROWS, Dequantized())), (*gated, (ANY_ROWS, Unfused()))
