"""Quantized weights of the `torch` engine: fp8 (e4m3) and int8 weight-only, per output channel.

Methods (`engine.quantization` in the release spec):

- `none`: weights in the engine dtype.
- `fp8`: each quantized weight `W [N, K]` is stored as float8_e4m3fn `Q` with one float32 scale per
  output channel (row) `s [N]`, `W ~= Q * s[:, None]`, `s = max|W[n]| / 448`. The decode GEMMs read
  `Q` and `s` at their stored precision and dequantize in registers (`skinny_gemm`, `gate_up`); the
  prefill GEMMs (more than 64 tokens) on a GPU that has FP8 tensor cores (compute capability 8.9 or
  later, bf16 engines) scale each activation row (token) to e4m3 at run time and multiply through
  `torch._scaled_mm`.
- `int8-weight-only`: `Q` is int8, `s = max|W[n]| / 127`, round to nearest; activations stay in the
  engine dtype everywhere (for GPUs without FP8 and for the CPU).

What is quantized: the four projections of every layer (`wqkv`, `wo`, `w13`, `w2`), and the LM head
when `lm_head=True` (untied models only). Embeddings, norms, biases and (by default) the LM head keep
the engine dtype. Each quantized tensor `<name>` has its scale beside it in the same weight file, as
`<name>_scale` (`SCALE_SUFFIX`). `engine.json` records it all under `quantization` (`QuantInfo.to_dict`).

The CPU (and any device without the kernels) runs the same engines through the dequantizing reference
path `QuantLinear.forward`: the weight is dequantized on the fly into the engine dtype and multiplied
by F.linear, so CI exercises every quantized engine.

Imports: stdlib and torch only (this module runs inside Triton's python backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.errors import EngineLimitError, EngineQuantizationError

NONE, FP8, INT8_WEIGHT_ONLY = "none", "fp8", "int8-weight-only"
QUANTIZATIONS = (NONE, FP8, INT8_WEIGHT_ONLY)
SCALE_SUFFIX = "_scale"
STORED_DTYPES: dict[str, torch.dtype] = {FP8: torch.float8_e4m3fn, INT8_WEIGHT_ONLY: torch.int8}
QMAX: dict[str, float] = {FP8: 448.0, INT8_WEIGHT_ONLY: 127.0}
FP8_GEMM_MIN_ROWS = 64  # the decode kernels' most rows: more (prefill) take the FP8 tensor-core GEMM
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores and e4m3 conversions: Ada, Hopper and later
LAYER_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
SETTING = "engine.quantization"


@dataclass(frozen=True)
class QuantInfo:
    """How an engine's weights are quantized (the `quantization` block of engine.json / checkpoint.json)."""

    method: str = NONE  # one of QUANTIZATIONS
    lm_head: bool = False  # the LM head quantized too (untied models only)

    @property
    def enabled(self) -> bool:
        return self.method != NONE

    def validate(self, *, tie_word_embeddings: bool) -> None:
        if self.method not in QUANTIZATIONS:
            raise EngineLimitError(f"{SETTING}={self.method!r} is not supported; choose one of {list(QUANTIZATIONS)}")
        if self.lm_head and not self.enabled:
            raise EngineLimitError(f"engine.quantize_lm_head=true needs {SETTING} other than 'none'")
        if self.lm_head and tie_word_embeddings:
            raise EngineLimitError("engine.quantize_lm_head=true: this model ties its LM head to the embedding "
                                   "table (tie_word_embeddings), which stays in the engine dtype")

    def quantized_modules(self, n_layers: int, *, tie_word_embeddings: bool) -> list[str]:
        """Module names (`layers.0.attention.wqkv`, ..., `output`) whose weights are quantized."""
        if not self.enabled:
            return []
        names = [f"layers.{i}.{m}" for i in range(n_layers) for m in LAYER_LINEARS]
        if self.lm_head and not tie_word_embeddings:
            names.append("output")
        return names

    def to_dict(self, n_layers: int, *, tie_word_embeddings: bool) -> dict[str, Any]:
        """The engine.json record: method, stored dtype, where the scales are, which tensors."""
        if not self.enabled:
            return {"method": NONE}
        return {
            "method": self.method,
            "lm_head": self.lm_head,
            "weight_dtype": str(STORED_DTYPES[self.method]).removeprefix("torch."),
            "scales": {"granularity": "per-output-channel", "dtype": "float32", "suffix": SCALE_SUFFIX,
                       "where": "tensor '<weight name>_scale' [N] beside each quantized weight, same file"},
            "activations": ("per-token e4m3 at run time in FP8 tensor-core GEMMs (prefill); engine dtype in the "
                            "decode kernels" if self.method == FP8 else "engine dtype"),
            "tensors": [f"{m}.weight" for m in self.quantized_modules(n_layers, tie_word_embeddings=tie_word_embeddings)],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> QuantInfo:
        if not d:
            return cls()
        info = cls(method=d.get("method", NONE), lm_head=bool(d.get("lm_head", False)))
        if info.method not in QUANTIZATIONS:
            raise EngineQuantizationError(f"quantization.method={info.method!r} in engine.json is not one of "
                                          f"{list(QUANTIZATIONS)} (an engine from a newer enginewright?)")
        return info


# ---------------------------------------------------------------------------------------------
# quantize / dequantize


def quantize_weight(weight: torch.Tensor, method: str, *, rows_per_chunk: int = 2048
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (Q [N, K] in the method's stored dtype, per-row float32 scales s [N]), W ~= Q * s[:, None].

    Rows go through float32 `rows_per_chunk` at a time, so the extra memory is a slice, not a float32
    copy of the whole (fused) tensor."""
    if method not in STORED_DTYPES:
        raise EngineLimitError(f"{SETTING}={method!r} has no quantized weight format; choose one of "
                               f"{sorted(STORED_DTYPES)}")
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=STORED_DTYPES[method], device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    qmax = QMAX[method]
    for lo in range(0, n, rows_per_chunk):
        w = weight[lo:lo + rows_per_chunk].to(torch.float32, copy=True)  # (divided in place below)
        amax = w.abs().amax(dim=1)  # [rows]
        s = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        scaled = w.div_(s[:, None])
        if method == INT8_WEIGHT_ONLY:
            scaled = scaled.round_()
        q[lo:lo + rows_per_chunk] = scaled.clamp_(-qmax, qmax).to(q.dtype)
        scale[lo:lo + rows_per_chunk] = s
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Q [N, K], s [N] -> Q * s[:, None] in `dtype` (the multiplication in float32)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_state(state: dict[str, torch.Tensor], info: QuantInfo, *, n_layers: int,
                   tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """A full engine state dict with the quantized weights replaced and their scales added (the bench and
    tests build engines in memory with it; conversion quantizes tensor by tensor with `quantize_weight`)."""
    out = dict(state)
    for module in info.quantized_modules(n_layers, tie_word_embeddings=tie_word_embeddings):
        q, s = quantize_weight(state[f"{module}.weight"], info.method)
        out[f"{module}.weight"], out[f"{module}.weight{SCALE_SUFFIX}"] = q, s
    return out


# ---------------------------------------------------------------------------------------------
# the module


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored quantized (`weight` [N, K] int8 / e4m3, `weight_scale` [N]).

    `forward` is the dequantizing reference path (any device), or on a GPU with FP8 tensor cores for a
    bf16 fp8 engine the per-token scaled `torch._scaled_mm`. The decode step's Triton kernels read
    `weight` and `weight_scale` themselves (`model._linear_fn`).
    """

    def __init__(self, in_features: int, out_features: int, *, method: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.method = method
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=STORED_DTYPES[method]),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, method={self.method}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == FP8 and scaled_mm_fits(x, self.weight):
            return fp8_scaled_linear(x, self.weight, self.weight_scale, self.bias)
        return F.linear(x, dequantize_weight(self.weight, self.weight_scale, x.dtype), self.bias)


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` with row-wise scales runs x [..., K] by weight [N, K] here: CUDA of
    compute capability >= 8.9, bf16 activations, more than `FP8_GEMM_MIN_ROWS` rows (prefill; fewer rows
    keep the exact dequantized product, which the decode kernels compute too), K and N multiples of 16."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or weight.dtype != torch.float8_e4m3fn:
        return False
    if x.numel() // x.shape[-1] <= FP8_GEMM_MIN_ROWS:
        return False
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0 and torch.cuda.get_device_capability(x.device) >= FP8_MIN_CAPABILITY


def fp8_scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (bf16) times the e4m3 weight [N, K] with per-row scales [N]: each token (row of x) scaled to
    e4m3 by its own max, one FP8 tensor-core GEMM with both scales applied in its epilogue -> bf16 [..., N]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    amax = x2.abs().amax(dim=-1, keepdim=True).float()  # [T, 1]
    x_scale = torch.where(amax > 0, amax / QMAX[FP8], torch.ones_like(amax))
    xq = (x2.float() / x_scale).clamp(-QMAX[FP8], QMAX[FP8]).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear)


def install_quantized_linears(model: nn.Module, info: QuantInfo, *, n_layers: int, tie_word_embeddings: bool,
                              dtype: torch.dtype) -> None:
    """Replace the modules that `info` quantizes with `QuantLinear`s of the same shape (on the model's
    device, meta included), before the quantized state dict is loaded."""
    for name in info.quantized_modules(n_layers, tie_word_embeddings=tie_word_embeddings):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        device = old.weight.device
        with torch.device(device):
            new = QuantLinear(old.in_features, old.out_features, method=info.method, bias=old.bias is not None,
                              dtype=dtype)
        setattr(parent, child, new)


def model_quantization(model: nn.Module) -> str:
    """The method of the model's quantized linears, or "none"."""
    return next((m.method for m in model.modules() if isinstance(m, QuantLinear)), NONE)


# ---------------------------------------------------------------------------------------------
# what a device can run


def check_device(method: str, device: torch.device | str, *, where: str) -> None:
    """Refuse, naming the setting and the device, a quantization the device cannot run: fp8 on a CUDA GPU
    below compute capability 8.9 (no e4m3 conversions or FP8 tensor cores). The CPU runs every method
    through the dequantizing reference path."""
    dev = torch.device(device)
    if method == FP8 and dev.type == "cuda":
        capability = torch.cuda.get_device_capability(dev)
        if capability < FP8_MIN_CAPABILITY:
            raise EngineQuantizationError(
                f"{where}: {SETTING}='fp8' needs a GPU of compute capability "
                f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or later (Ada, Hopper); device {dev} "
                f"({torch.cuda.get_device_name(dev)}) has {'.'.join(map(str, capability))}. Use "
                f"{SETTING}='int8-weight-only' there")


def check_capability_text(method: str, capability: str, *, where: str) -> None:
    """`check_device` for a recorded compute capability ("9.0", or "cpu")."""
    if method != FP8 or capability == "cpu":
        return
    major, _, minor = capability.partition(".")
    if (int(major), int(minor or 0)) < FP8_MIN_CAPABILITY:
        raise EngineQuantizationError(
            f"{where}: {SETTING}='fp8' needs a GPU of compute capability "
            f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or later; this build's GPU has {capability}. Use "
            f"{SETTING}='int8-weight-only' there")
