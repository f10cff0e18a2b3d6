"""The GEMMs a linear layer may run, as small objects a layer picks at load (`linear_float`, `linear_fp8`,
`linear_int8`) for each row-count bucket: `route(module, x, pdl)` -> x W^T (+ b), `route.parts(...)` -> the
same as split-K partial products [P, M, N] (P = 1 where the GEMM does not split K) for a consumer that sums
them itself. A route holds its kernel config and options, never the weights: it reads them from the module it
is given, so a model moved or reloaded in place keeps its routes.

Imports: stdlib and torch only (the kernels' modules, which import Triton, lazily).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine import silu_mul
from serving.engine.gemm_config import GemmConfig

ANY_ROWS = 1 << 62  # the last bucket's bound
Routes = tuple[tuple[int, "Route"], ...]  # (the most rows, the route) by increasing rows


class Route:
    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        raise NotImplementedError

    def parts(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        return self(module, x, pdl).unsqueeze(0)


def pick(routes: Routes, x: torch.Tensor) -> Route:
    """The route of x [..., K]'s row count (decode rows against prompt rows: data, not module type)."""
    rows = x.numel() // x.shape[-1]
    for most, route in routes:
        if rows <= most:
            return route
    raise AssertionError(f"no route for {rows} rows: the last bucket takes any")


@dataclass(frozen=True)
class TorchLinear(Route):
    """F.linear (cuBLAS) on the module's weight in x's dtype."""

    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        return F.linear(x, module.weight, module.bias)


@dataclass(frozen=True)
class Dequantized(Route):
    """A quantized layer's reference: the weight dequantized to x's dtype, then F.linear."""

    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        return module.reference(x)


@dataclass(frozen=True)
class TensorCores(Route):
    """An fp8 layer on the FP8 tensor cores: tokens scaled to e4m3, `torch._scaled_mm` (`quantize`)."""

    fast_accum: bool = True

    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        from serving.engine.quantize import fp8_scaled_linear

        return fp8_scaled_linear(x, module.weight, module.weight_scale, module.bias, fast_accum=self.fast_accum)


@dataclass(frozen=True)
class Skinny(Route):
    """The split-K skinny kernel of `config` (`skinny_gemm`); `scaled`: the weight is quantized (int8 / e4m3)
    with its per-row scales, read at that precision."""

    config: GemmConfig
    scaled: bool = False
    one_kernel_sum: bool = True

    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        from serving.engine.skinny_gemm import skinny_linear

        x2 = x.reshape(-1, x.shape[-1])
        y = skinny_linear(x2, module.weight, module.bias, config=self.config, pdl=pdl,
                          scale=module.weight_scale if self.scaled else None, one_kernel_sum=self.one_kernel_sum)
        return y.view(*x.shape[:-1], y.shape[-1])

    def parts(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        from serving.engine.skinny_gemm import skinny_linear_parts

        return skinny_linear_parts(x, module.weight, module.bias, config=self.config, pdl=pdl,
                                   scale=module.weight_scale if self.scaled else None)


@dataclass(frozen=True)
class SplitKFp8(Route):
    """An fp8 layer's decode rows on the FP8 tensor cores through the split-K kernel of `config` (`fp8_gemm`)."""

    config: GemmConfig
    row_scaling_in_kernel: bool = False
    one_kernel_sum: bool = True

    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        from serving.engine.fp8_gemm import fp8_linear

        return fp8_linear(x, module.weight, module.weight_scale, module.bias, config=self.config, pdl=pdl,
                          row_scaling_in_kernel=self.row_scaling_in_kernel, one_kernel_sum=self.one_kernel_sum)

    def parts(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        from serving.engine.fp8_gemm import fp8_partials

        return fp8_partials(x, module.weight, module.weight_scale, self.config, pdl=pdl,
                            row_scaling_in_kernel=self.row_scaling_in_kernel)


# the MLP's silu(gate) * up from w13 (`gated`): the layer's own product then SiLU * up, or one kernel


@dataclass(frozen=True)
class Unfused(Route):
    """w13's own product (its routes), then SiLU * up (`e4m3`: its rows also scaled for an FP8 GEMM)."""

    e4m3: bool = False

    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        return silu_mul.gated(module(x, pdl=pdl), module.out_features // 2, e4m3=self.e4m3)


@dataclass(frozen=True)
class GateUpKernel(Route):
    """silu(gate) * up in one kernel of `config` (`gate_up`); `scaled`: w13 quantized with its scales."""

    config: GemmConfig
    scaled: bool = False

    def __call__(self, module: nn.Module, x: torch.Tensor, pdl: bool) -> torch.Tensor:
        from serving.engine.gate_up import gate_up

        return gate_up(x, module.weight, config=self.config, pdl=pdl,
                       scale=module.weight_scale if self.scaled else None)
