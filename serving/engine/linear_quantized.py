"""The quantized linear layer's storage and reference, shared by the per-method layers (`linear_fp8`,
`linear_int8`): `QuantLinear` holds `weight` [N, K] (int8 / e4m3) and `weight_scale` [N] (quantize.py's
formats), multiplies by the dequantized weight in `reference`, and answers what the step asks of a quantized
layer (`prescale_rows_for`, `model_quantization`).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.linear_float import Routed
from serving.engine.linear_routes import ANY_ROWS, Dequantized, Unfused
from serving.engine.quantize import FP8, FP8_DECODE_MAX_ROWS, NONE, STORED_DTYPES, dequantize_weight


class QuantLinear(Routed, nn.Module):
    """A linear layer whose weight is stored quantized (`weight` [N, K] int8 / e4m3, `weight_scale` [N]): the
    storage and the dequantizing `reference` shared by the per-method layers (`linear_fp8.Fp8Linear`,
    `linear_int8.Int8Linear`), which pick their GEMMs at load. Until then (and as this class) every row count
    runs `reference`."""

    def __init__(self, in_features: int, out_features: int, *, method: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.method = method
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=STORED_DTYPES[method]),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._kept: tuple[tuple, torch.Tensor] | None = None  # (what it was made from, the dequantized weight)
        # whether the norm or SiLU * up before it scales its rows to e4m3 past the decode rows (`prescale_rows_for`)
        self.prescale_rows = method == FP8
        self.routes = ((ANY_ROWS, Dequantized()),)
        self.gated_routes = ((ANY_ROWS, Unfused()),)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, method={self.method}, bias={self.bias is not None}"

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """x times the dequantized weight in x's dtype: weight-only numerics, any device."""
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantized to `dtype`: made at each call, except an fp8 weight on the CPU, kept (module
        docstring) until the weight or its scale change (their version counters and storage are the key)."""
        if self.method != FP8 or self.weight.device.type != "cpu" or torch.compiler.is_compiling():
            return self.dequantize(dtype)
        made_from = (dtype, self.weight.data_ptr(), self.weight._version,
                     self.weight_scale.data_ptr(), self.weight_scale._version)
        if self._kept is None or self._kept[0] != made_from:
            self._kept = (made_from, self.dequantize(dtype))
        return self._kept[1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Q * s in `dtype` (the multiplication in float32), by the layer's scale layout: one per output row."""
        return dequantize_weight(self.weight, self.weight_scale, dtype)


def prescale_rows_for(linear: nn.Module, rows: int, device: torch.device) -> bool:
    """Whether the norm writing `linear`'s input of `rows` rows should scale them to e4m3 too: `linear` an fp8
    layer whose GEMM would scale them in a Triton kernel (CUDA, past the decode rows), with its `prescale_rows`
    on (`EngineOptions.prescale_rows`, applied at load)."""
    return (device.type == "cuda" and rows > FP8_DECODE_MAX_ROWS and isinstance(linear, QuantLinear)
            and linear.method == FP8 and linear.prescale_rows)


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear)


def model_quantization(model: nn.Module) -> str:
    """The method of the model's quantized linears, or "none"."""
    return next((m.method for m in model.modules() if isinstance(m, QuantLinear)), NONE)
