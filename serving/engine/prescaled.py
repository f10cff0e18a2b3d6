"""Activations that arrive with their rows already scaled to e4m3 by the kernel that produced them.

An FP8 tensor-core GEMM scales each row (token) of its bf16 input to e4m3 by the row's own largest magnitude
(`quantize.tokens_to_e4m3`: one more kernel, one more pass over the input). A norm kernel holds each whole row
in registers when it writes it, so it can write the e4m3 row and its scale as well
(`row_norm.rms_norm(..., e4m3=True)`: the inputs of wqkv and w13), and SiLU * up can scale each row it wrote
(`silu_mul.silu_mul_e4m3`: the input of w2), with the values the separate kernel computes from the bf16 row.
It hands them over on the bf16 output itself: `with_prescaled_rows` sets them as an attribute of that tensor
object, and `quantize.fp8_scaled_linear` takes them from the tensor it is given (`prescaled_rows`) instead of
scaling again. A view or copy of the output does not carry them, so anything else done to it first falls
back to scaling as before.

Used where the GEMM would scale rows in its Triton kernel (`linear_quantized.prescale_rows_for`): an fp8 layer on
CUDA past the decode rows, with `quantize.PRESCALE_ROWS` on.

Imports: torch.
"""

from __future__ import annotations

from typing import Any

import torch

E4M3_MAX = 448.0  # the largest e4m3 (float8_e4m3fn) magnitude
_ATTRIBUTE = "_enginewright_e4m3_rows"


def with_prescaled_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] (returned), carrying its rows scaled to e4m3: q [T, K] e4m3 and float32 scales [T, 1]."""
    setattr(x, _ATTRIBUTE, (q, scale))
    return x


def prescaled_rows(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (e4m3 rows, scales) x carries for `rows` rows, or None."""
    carried: Any = getattr(x, _ATTRIBUTE, None)
    return carried if carried is not None and carried[0].shape[0] == rows else None
