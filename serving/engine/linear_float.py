"""The linear layer of a model in its own dtype (bf16 / fp16 / float32): `FloatLinear`, and `TiedHead` (the LM
head of a model that ties it to its embedding table).

At load (`apply_options`) a layer picks, for each row-count bucket, the GEMM it runs: with the options' "triton"
decode GEMMs on CUDA, the device's tuned skinny config for its shape at one row and at 2-64 rows (where the
tables have one), and for w13 the fused silu(gate) * up kernel where tuned; F.linear (cuBLAS) everywhere else.
`forward(x)` only looks its bucket up.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine import silu_mul
from serving.engine.gemm_config import MAX_ROWS
from serving.engine.linear_routes import (
    ANY_ROWS,
    GateUpKernel,
    Route,
    Routes,
    Skinny,
    TorchLinear,
    Unfused,
    pick,
)
from serving.engine.options import EngineOptions

DECODE_BUCKETS = (1, MAX_ROWS)  # one row, 2-64 rows: the tuned tables' rows buckets


class Routed:
    """What every linear layer answers, over the routes it picked at load (`routes`, `gated_routes`)."""

    routes: Routes
    gated_routes: Routes

    def forward(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """x W^T (+ b); `pdl`: a Triton kernel launched with programmatic dependent launch."""
        return pick(self.routes, x)(self, x, pdl)

    def parts(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """`forward` as split-K partial products [P, M, N] for a consumer that sums them (P = 1 unsplit)."""
        return pick(self.routes, x).parts(self, x, pdl)

    def gated(self, x: torch.Tensor, pdl: bool = False, e4m3: bool = False) -> torch.Tensor:
        """silu(gate) * up of this w13 ([gate; up] rows); `e4m3`: the result's rows also scaled for an FP8 GEMM
        (`silu_mul.gated`), through this layer's own product."""
        if e4m3:
            return silu_mul.gated(self(x, pdl=pdl), self.out_features // 2, e4m3=True)
        return pick(self.gated_routes, x)(self, x, pdl)


class FloatLinear(Routed, nn.Linear):
    """nn.Linear (same parameters and state dict) with its GEMMs picked at load (module doc)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **factory: object) -> None:
        super().__init__(in_features, out_features, bias, **factory)
        self.routes, self.gated_routes = plain_routes()

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def apply_options(self, options: EngineOptions) -> None:
        self.routes, self.gated_routes = float_routes(self, options)


class RowParallelLinear(FloatLinear):
    """A FloatLinear whose products are partial sums that `ParallelConfig.all_reduce` adds over the ranks of a
    tensor-parallel group (wo and w2: each rank holds some of the input columns), made the same whatever the
    group's size in float32 (float32 engines only: bf16 and fp16 layers run their routes unchanged).

    One float32 GEMM over a whole row rounds inside its own order of additions, which no split into ranks can
    repeat: two ranks' halves, each rounded and then added, differ from it by a few float32 steps of the residual
    stream. So a float32 layer cuts its input columns into `groups` equal groups (`parallel.column_groups`: the
    finest split a tensor-parallel size may make, so each rank holds whole groups), multiplies each group by its
    own float32 GEMM, and adds the groups' products in float64, returned so: the all-reduce adds the ranks' in
    float64 and rounds to float32 once. Every tensor-parallel size runs the same GEMMs and rounds once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, groups: int = 1,
                 **factory: object) -> None:
        super().__init__(in_features, out_features, bias, **factory)
        if in_features % groups:
            raise ValueError(f"RowParallelLinear: groups={groups} does not divide in_features={in_features}")
        self.groups = groups

    def forward(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return self.grouped_product(x)
        return super().forward(x, pdl)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return self.grouped_product(x)
        return super().reference(x)

    def grouped_product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) of float32 x [..., K], W, b: each column group's float32 GEMM, their sum in float64."""
        width = self.in_features // self.groups
        total = F.linear(x[..., :width], self.weight[:, :width]).double()
        for start in range(width, self.in_features, width):
            total += F.linear(x[..., start:start + width], self.weight[:, start:start + width])
        return total if self.bias is None else total + self.bias


class TiedHead(Routed, nn.Module):
    """The LM head of a model that ties it to its embedding table: the table's weight read at each call (so
    a model loaded or moved in place needs nothing more), no bias. Not a submodule of the model (held in a
    tuple), so the state dict keeps the table once."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.table = (embedding,)
        self.routes, self.gated_routes = plain_routes()

    @property
    def weight(self) -> torch.Tensor:
        return self.table[0].weight

    bias = None

    @property
    def out_features(self) -> int:
        return self.table[0].num_embeddings

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def apply_options(self, options: EngineOptions) -> None:
        self.routes, self.gated_routes = float_routes(self, options)


def plain_routes() -> tuple[Routes, Routes]:
    """F.linear at every row count, SiLU * up after it: a layer before `apply_options`."""
    return ((ANY_ROWS, TorchLinear()),), ((ANY_ROWS, Unfused()),)


def float_routes(layer: Routed, options: EngineOptions) -> tuple[Routes, Routes]:
    """A float layer's routes under `options` (module doc)."""
    if not (options.triton_gemms and layer.weight.is_cuda):
        return plain_routes()
    from serving.engine import gate_up
    from serving.engine.skinny_gemm import config_for

    n, k = layer.weight.shape
    routes: list[tuple[int, Route]] = []
    gated: list[tuple[int, Route]] = []
    for rows in DECODE_BUCKETS:  # each bucket's config, looked up at its largest row count
        config = config_for(rows, n, k, options.tuned.skinny)
        fits = config is not None and config.fits(rows, n, k)
        routes.append((rows, Skinny(config, one_kernel_sum=options.partial_sums_one_kernel) if fits
                       else TorchLinear()))
        fused = gate_up.config_for(rows, n // 2, k, options.tuned) if options.decode_gate_up else None
        gated.append((rows, GateUpKernel(fused) if fused is not None and gate_up.fits(fused, rows, k) else Unfused()))
    return (*routes, (ANY_ROWS, TorchLinear())), (*gated, (ANY_ROWS, Unfused()))
