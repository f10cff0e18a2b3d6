"""The fp8 linear layer of a block-wise FP8 checkpoint: an e4m3 weight [N, K] with one float32 scale per block of
[bn, bk] (`weight_scale` [ceil(N/bn), ceil(K/bk)], `fp8_checkpoint`), its GEMM picked at load.

`apply_options` picks, for every row count: the block-scaled FP8 GEMM (`fp8_block_gemm`, tokens scaled per token
and group of bk) on CUDA with FP8 tensor cores (compute capability 8.9+), a bf16 engine and a block the kernel
takes; else the dequantizing reference (the CPU: weight-only numerics, as for every fp8 engine there).
Its rows are never prescaled by the norm before it (those kernels scale per token, not per group).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from serving.engine.linear_quantized import QuantLinear
from serving.engine.linear_routes import ANY_ROWS, Dequantized, Route, Unfused
from serving.engine.options import EngineOptions
from serving.engine.quantize import FP8, has_fp8_tensor_cores


class Fp8BlockLinear(QuantLinear):
    def __init__(self, in_features: int, out_features: int, *, block: tuple[int, int], bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, method=FP8, bias=bias, dtype=dtype)
        self.block = block
        blocks = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
        self.weight_scale = nn.Parameter(torch.empty(blocks, dtype=torch.float32), requires_grad=False)
        self.prescale_rows = False

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={self.block}"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Q * s over each block, in `dtype` (the multiplication in float32)."""
        from serving.engine.fp8_checkpoint import expand_blocks

        scale = expand_blocks(self.weight_scale.float(), self.block, tuple(self.weight.shape))
        return (self.weight.float() * scale).to(dtype)

    def apply_options(self, options: EngineOptions) -> None:
        self.prescale_rows = False
        route: Route = BlockScaled() if self.takes_block_kernel() else Dequantized()
        self.routes, self.gated_routes = ((ANY_ROWS, route),), ((ANY_ROWS, Unfused()),)

    def takes_block_kernel(self) -> bool:
        """CUDA with FP8 tensor cores, a bf16 engine, and a block the kernel takes (the layer's only FP8 GEMM, for
        every row count, whichever decode GEMMs the options name)."""
        from serving.engine import fp8_block_gemm

        device = self.weight.device
        return (device.type == "cuda" and self.compute_dtype == torch.bfloat16
                and fp8_block_gemm.available() and fp8_block_gemm.fits(self.block)
                and has_fp8_tensor_cores(device.index or 0))


@dataclass(frozen=True)
class BlockScaled(Route):
    """A block-wise fp8 layer on the FP8 tensor cores (`fp8_block_gemm.block_fp8_linear`)."""

    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        from serving.engine.fp8_block_gemm import block_fp8_linear

        return block_fp8_linear(x, module.weight, module.weight_scale, module.block, module.bias)
