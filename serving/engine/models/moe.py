"""The mixture-of-experts MLP shared by the MoE families (`models.mixtral`, `models.qwen3_moe`): the router, top-k
with each family's normalization, and the experts.

Routing (`route`): router logits [N, E] = h W_g^T in the model's dtype (as Hugging Face computes them), softmax
over the E experts in float32, the k experts of the largest probabilities, and with `renormalize` their weights
divided by their sum (Mixtral always; Qwen3-MoE when `norm_topk_prob`). Each token's output is the sum over its
k experts of weight x expert(h), every expert a SiLU-gated MLP: w2 (silu(h w_gate^T) * h w_up^T). The weights
multiply in float32 as Mixtral's HF code does (Qwen3-MoE's rounds them to the model's dtype first: a difference
of a bf16 rounding, within the validation gate's bf16 budget).

Ties, the one rule: **among experts of exactly equal probability, the lowest expert index wins** (a stable sort
of the probabilities, descending: `route`), on every device and path. Hugging Face's routers call `torch.topk`,
which has no rule on ties: on the CPU it picks either of two equal experts at the k-th place, depending on the
values around them. So where two experts tie exactly at the k-th place the engine equals HF run with its top-k
under this rule (tests/test_moe.py runs HF so, on a checkpoint whose router has two equal rows, and shows that
the tie decides tokens there); anywhere else the choice is HF's.

Experts' weights (`ExpertWeights`): E experts of one shape stacked on the rows, as the engine checkpoint stores
them: `w13.weight` [E * 2I, D], expert e's [gate; up] rows at [2I e, 2I (e + 1)); `w2.weight` [E * D, I]. So a
quantized engine (fp8, int8 weight-only) quantizes them per row, which is per expert and output channel, with
`quantize.quantize_weight` as every other linear: `weight_scale` [E * 2I] / [E * D] beside them. The router
(`gate`, [E, D]) keeps the model's dtype.

How the experts run, picked at load (`MoEFeedForward.apply_options`):
- the loop (the CPU, any device without Triton, and the layers' references): for each expert that received
  tokens, its tokens gathered (`index_select`), through its MLP (a quantized weight dequantized), times their
  routing weights, added into the output (`index_add_`), experts in index order as Hugging Face adds them. It
  asks the host which experts received tokens: never inside a CUDA graph.
- the grouped GEMM (CUDA with Triton, `serving.engine.moe_gemm`, vLLM's `fused_moe` design; a decode step's
  routing and alignment in one launch, `serving.engine.moe_routing`, option `moe_fused_routing`): the (token, expert)
  pairs sorted by expert, each expert's count padded to the kernel's row block, one launch for w13 of all
  experts, SiLU * up, one launch for w2 with the routing weights in its epilogue, then the k rows of each token
  summed. Weights bf16 / fp16, or e4m3 / int8 converted in registers and scaled per row (weight-only numerics, as
  the decode kernels of `linear_fp8`). No host sync: capturable in the decode graphs.

Imports: stdlib and torch only (Triton lazily, in `moe_gemm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.errors import EngineLimitError
from serving.engine.linear_float import FloatLinear
from serving.engine.model import ModelArgs
from serving.engine.models import llama
from serving.engine.options import EngineOptions
from serving.engine.quantize import NONE, STORED_DTYPES, dequantize_weight


def route(logits: torch.Tensor, top_k: int, *, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (float32 weights [N, k], expert ids [N, k] int64): softmax in float32, the k
    largest probabilities with ties to the lowest expert index (module doc), renormalized if asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, order)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, order


class ExpertWeights(nn.Module):
    """E linear weights of one shape [out_features, in_features] stacked on the rows: `weight` [E * out, in]
    in the model's dtype, or stored quantized (`method` fp8 / int8 weight-only) with `weight_scale` [E * out]
    (module doc)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, *, method: str = NONE,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.n_experts, self.in_features, self.out_features, self.method = n_experts, in_features, out_features, method
        rows = n_experts * out_features
        stored = dtype if method == NONE else STORED_DTYPES[method]
        self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=stored), requires_grad=False)
        self.weight_scale = (nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
                             if method != NONE else None)

    def extra_repr(self) -> str:
        return f"{self.n_experts} x ({self.in_features}, {self.out_features}), method={self.method}"

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [out, in] in `dtype` (dequantized when stored quantized)."""
        rows = slice(e * self.out_features, (e + 1) * self.out_features)
        if self.weight_scale is None:
            return self.weight[rows]
        return dequantize_weight(self.weight[rows], self.weight_scale[rows], dtype)

    def quantized(self, method: str, dtype: torch.dtype) -> ExpertWeights:
        """An empty twin of this module stored as `method` (on its device, meta included), for a quantized
        state dict to load into (`linears.install_quantized_linears`)."""
        with torch.device(self.weight.device):
            return ExpertWeights(self.n_experts, self.in_features, self.out_features, method=method, dtype=dtype)


def expert_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: ExpertWeights,
                w2: ExpertWeights) -> torch.Tensor:
    """The experts over x [N, D] routed as (weights, ids) [N, k], one expert at a time (module doc) -> [N, D]."""
    inter = w2.in_features
    out = torch.zeros_like(x)
    hit = torch.zeros(w13.n_experts, dtype=torch.bool, device=x.device)
    hit[ids.flatten()] = True
    for e in hit.nonzero().flatten().tolist():
        token, slot = torch.where(ids == e)
        h = x.index_select(0, token)
        gate, up = F.linear(h, w13.expert(e, x.dtype)).split([inter, inter], dim=-1)
        y = F.linear(F.silu(gate) * up, w2.expert(e, x.dtype))
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


class MoEFeedForward(nn.Module):
    """A layer's MLP as a mixture of experts: the router `gate`, the experts' `w13` and `w2` (module doc). It
    answers what the layer's step asks of an MLP (`forward`, `reference`, and `w13` for
    `linear_quantized.prescale_rows_for`, which never prescales rows for it)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.renormalize = args.n_experts_per_tok, args.moe_renormalize
        inter = args.moe_intermediate_size
        self.gate = FloatLinear(args.dim, args.n_experts, bias=False)
        self.w13 = ExpertWeights(args.n_experts, args.dim, 2 * inter)  # [gate; up] of each expert
        self.w2 = ExpertWeights(args.n_experts, inter, args.dim)
        self.grouped = False  # the grouped GEMM kernels (CUDA with Triton), picked at load
        self.fused_routing = False  # with them: routing and alignment in one launch where the batch fits
        self.tilings: dict = {}  # the device's tuned grouped GEMM tilings (`TunedTables.moe`), set at load

    def apply_options(self, options: EngineOptions) -> None:
        """Pick how the experts run on the weights' device (module doc): the grouped kernels on CUDA, whatever
        `options.decode_gemm` says (the loop asks the host which experts got tokens, which a CUDA graph cannot)."""
        from serving.engine import moe_gemm

        self.grouped = moe_gemm.available(self.w13.weight)
        self.fused_routing = self.grouped and options.moe_fused_routing
        self.tilings = dict(options.tuned.moe)
        if self.w13.weight.is_cuda and not self.grouped:
            raise EngineLimitError(f"a mixture-of-experts layer on {self.w13.weight.device} needs the grouped expert "
                                   f"kernels (serving/engine/moe_gemm.py): Triton importable and expert weights of "
                                   f"{[str(d).removeprefix('torch.') for d in moe_gemm.WEIGHT_DTYPES]}; here Triton "
                                   f"is {'importable' if moe_gemm.triton is not None else 'not importable'}, the "
                                   f"weights {self.w13.weight.dtype}")

    def forward(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """x [..., D] -> [..., D]: routed, through the experts as picked at load."""
        x2 = x.reshape(-1, x.shape[-1])
        logits = self.gate(x2)
        if not self.grouped:
            weights, ids = route(logits, self.top_k, renormalize=self.renormalize)
            return expert_loop(x2, weights, ids, self.w13, self.w2).view(x.shape)
        from serving.engine import moe_gemm, moe_routing

        config = moe_gemm.config_for(x2.shape[0], self.w13.n_experts, self.tilings, inter=self.w2.in_features,
                                     dim=self.w2.out_features)
        if self.fused_routing and moe_routing.fits(x2.shape[0], self.w13.n_experts):
            weights, _, *aligned = moe_routing.route_and_align(logits, self.top_k, renormalize=self.renormalize,
                                                               block_m=config.block_m)
        else:
            weights, ids = route(logits, self.top_k, renormalize=self.renormalize)
            aligned = moe_gemm.align(ids, self.w13.n_experts, config.block_m)
        return moe_gemm.aligned_experts(x2, weights, *aligned, self.w13, self.w2, config).view(x.shape)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The experts one at a time through dequantized weights (what the steps are checked against)."""
        x2 = x.reshape(-1, x.shape[-1])
        weights, ids = route(self.gate.reference(x2), self.top_k, renormalize=self.renormalize)
        return expert_loop(x2, weights, ids, self.w13, self.w2).view(x.shape)


def moe_fields(*, n_experts: int, top_k: int, inter: int, renormalize: bool, dense_layers: tuple[int, ...] = (),
               source: str) -> dict[str, object]:
    """The `ModelArgs` fields of a mixture of experts read from a config (`source` names it in errors); a
    routing the engine cannot run raises `UnsupportedArchitectureError` naming the value."""
    from serving.engine.errors import UnsupportedArchitectureError

    if n_experts < 1 or not 1 <= top_k <= n_experts:
        raise UnsupportedArchitectureError(f"num_experts_per_tok={top_k} with {n_experts} experts in {source}: "
                                           "expected 1 <= num_experts_per_tok <= the number of experts")
    if inter < 1:
        raise UnsupportedArchitectureError(f"expert intermediate size {inter} in {source} must be >= 1")
    return {"n_experts": n_experts, "n_experts_per_tok": top_k, "moe_intermediate_size": inter,
            "moe_renormalize": renormalize, "dense_layers": tuple(sorted(dense_layers))}


def moe_param_names(args: ModelArgs, layer: int) -> list[str]:
    """The tensors a mixture-of-experts layer holds beyond a dense layer's (whose `feed_forward.w13` / `w2`
    names it keeps for the stacked experts): the router."""
    return [f"layers.{layer}.feed_forward.gate.weight"] if args.is_moe_layer(layer) else []


class MoETransformer(llama.Transformer):
    """A family's model (its layer: `block_class`) with a mixture of experts as the MLP of every layer that
    `ModelArgs.is_moe_layer`, the dense `FeedForward` in the others."""

    def block(self, args: ModelArgs, index: int) -> llama.TransformerBlock:
        return self.block_class(args, MoEFeedForward(args) if args.is_moe_layer(index) else None)
