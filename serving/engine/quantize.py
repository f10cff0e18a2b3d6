"""Quantized weights of the `torch` engine: fp8 (e4m3) and int8 weight-only, per output channel.

Methods (`engine.quantization` in the release spec):

- `none`: weights in the engine dtype.
- `fp8`: each quantized weight `W [N, K]` is stored as float8_e4m3fn `Q` with one float32 scale per
  output channel (row) `s [N]`, `W ~= Q * s[:, None]`, `s = max|W[n]| / 448`. On a GPU that has FP8
  tensor cores (compute capability 8.9 or later, bf16 engines), GEMMs scale each activation row (token)
  to e4m3 at run time (`quantize_tokens_fp8`) and multiply e4m3 x e4m3, both scales in the epilogue:
  prefill GEMMs (more than 64 rows) through `torch._scaled_mm`; decode GEMMs (1-64 rows) of the shapes in
  the device's tuned `fp8` table (`tuned_tables`) through the split-K `fp8_gemm` kernel; other decode GEMMs of
  16-64 rows with outputs at least `FP8_TENSOR_CORE_MIN_N` wide through `_scaled_mm`. The remaining decode
  GEMMs take the weight-only decode kernels, which read `Q` and `s` at their stored precision and convert the
  tile exactly in registers (`skinny_gemm`, `gate_up`). Each layer picks among these at load
  (`linear_fp8.Fp8Linear`, `linear_int8.Int8Linear`).
- `int8-weight-only`: `Q` is int8, `s = max|W[n]| / 127`, round to nearest; activations stay in the
  engine dtype everywhere (for GPUs without FP8 and for the CPU).

What is quantized: the four projections of every layer (`wqkv`, `wo`, `w13`, `w2`), and the LM head
when `lm_head=True` (untied models only). Embeddings, norms, biases and (by default) the LM head keep
the engine dtype. Each quantized tensor `<name>` has its scale beside it in the same weight file, as
`<name>_scale` (`SCALE_SUFFIX`). `engine.json` records it all under `quantization` (`QuantInfo.to_dict`).

The CPU (and any device without the kernels) runs the same engines through the dequantizing reference
path `linear_quantized.QuantLinear.reference`: the weight is dequantized on the fly into the engine dtype and multiplied
by F.linear, so CI exercises every quantized engine. That is weight-only numerics for fp8 too: the CPU
has no FP8 tensor cores. `fp8_emulated_linear` reproduces the per-token activation rounding on any
device (the same e4m3 values and scales; only the accumulation order and precision differ from the
tensor cores'), for tests and quality measurements. On the CPU an fp8 layer keeps its dequantized weight
after the first call (`QuantLinear.dequantized`): torch's e4m3-to-float conversion on the CPU is slow
enough to dominate every forward (docs/quantization.md), so an fp8 engine on the CPU takes the memory of its
engine dtype; it is the reference path, not a way to save CPU memory (int8 weight-only is, and its
conversion is faster: it is dequantized at every call).

Imports: stdlib and torch only (this module runs inside Triton's python backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from serving.engine.errors import EngineLimitError, EngineQuantizationError
from serving.engine.prescaled import E4M3_MAX, prescaled_rows

NONE, FP8, INT8_WEIGHT_ONLY = "none", "fp8", "int8-weight-only"
QUANTIZATIONS = (NONE, FP8, INT8_WEIGHT_ONLY)
SCALE_SUFFIX = "_scale"
STORED_DTYPES: dict[str, torch.dtype] = {FP8: torch.float8_e4m3fn, INT8_WEIGHT_ONLY: torch.int8}
QMAX: dict[str, float] = {FP8: E4M3_MAX, INT8_WEIGHT_ONLY: 127.0}
FP8_TENSOR_CORE_MIN_ROWS = 16  # fp8 GEMMs of this many rows and more may run on FP8 tensor cores (tokens to e4m3)
FP8_DECODE_MAX_ROWS = 64  # skinny_gemm.MAX_ROWS: up to this many rows, the decode kernels are the alternative
FP8_TENSOR_CORE_MIN_N = 16384  # decode rows: only outputs this wide (w13, LM heads) take the tensor cores
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores and e4m3 conversions: Ada, Hopper and later
LAYER_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
SETTING = "engine.quantization"


@dataclass(frozen=True)
class QuantInfo:
    """How an engine's weights are quantized (the `quantization` block of engine.json / checkpoint.json)."""

    method: str = NONE  # one of QUANTIZATIONS
    lm_head: bool = False  # the LM head quantized too (untied models only)
    # a checkpoint already in FP8 (`fp8_checkpoint.Fp8Checkpoint.record`): where its scales came from; not part of
    # equality, so a spec's `fp8` matches what its conversion found
    checkpoint: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def block(self) -> tuple[int, int] | None:
        """(rows, columns) of a weight block whose one scale the engine keeps (block-wise FP8), else None."""
        block = (self.checkpoint or {}).get("block")
        return (int(block[0]), int(block[1])) if block else None

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
        block = self.block
        record = {
            "method": self.method,
            "lm_head": self.lm_head,
            "weight_dtype": str(STORED_DTYPES[self.method]).removeprefix("torch."),
            "scales": {"granularity": "per-output-channel", "dtype": "float32", "suffix": SCALE_SUFFIX,
                       "where": "tensor '<weight name>_scale' [N] beside each quantized weight, same file"},
            "activations": ("per-token e4m3 at run time in FP8 tensor-core GEMMs (prefill; decode GEMMs in "
                            "the device's tuned fp8 table, and of >= "
                            f"{FP8_TENSOR_CORE_MIN_ROWS} rows where N >= {FP8_TENSOR_CORE_MIN_N}); engine dtype in "
                            "the weight-only decode kernels and on the CPU"
                            if self.method == FP8 else "engine dtype"),
            "tensors": [f"{m}.weight" for m in self.quantized_modules(n_layers, tie_word_embeddings=tie_word_embeddings)],
        }
        if self.checkpoint is not None:
            record["checkpoint"] = self.checkpoint
        if block is not None:
            record["scales"] = {"granularity": f"per-block {block[0]}x{block[1]}", "dtype": "float32",
                                "suffix": SCALE_SUFFIX, "where": "tensor '<weight name>_scale' "
                                f"[ceil(N/{block[0]}), ceil(K/{block[1]})] beside each quantized weight, same file"}
            record["activations"] = (f"per token and group of {block[1]} e4m3 at run time in the block-scaled FP8 "
                                     "GEMM (CUDA, FP8 tensor cores); engine dtype on the CPU")
        return record

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> QuantInfo:
        if not d:
            return cls()
        info = cls(method=d.get("method", NONE), lm_head=bool(d.get("lm_head", False)), checkpoint=d.get("checkpoint"))
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


def has_fp8_tensor_cores(device_index: int) -> bool:
    """Compute capability >= 8.9 (asked once, when an fp8 layer picks its GEMMs at load)."""
    return torch.cuda.get_device_capability(device_index) >= FP8_MIN_CAPABILITY


def quantize_tokens_fp8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]), each row scaled by its own max: x ~= q * scale.
    The scale is the max times the float32 reciprocal of 448, as every row-scaling kernel computes it (the
    norms', SiLU * up's, `fp8_tokens`', the one-row GEMM's): CUDA's torch divides by a Python scalar that way, the
    CPU's divides, so the product is written out to give the same scale on both and in the kernels."""
    amax = x2.abs().amax(dim=-1, keepdim=True).float()  # [T, 1]
    scale = torch.where(amax > 0, amax * (1.0 / QMAX[FP8]), torch.ones_like(amax))
    q = (x2.float() / scale).clamp(-QMAX[FP8], QMAX[FP8]).to(torch.float8_e4m3fn)
    return q, scale


def tokens_to_e4m3(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_tokens_fp8`, through one Triton kernel (`fp8_tokens.tokens_e4m3`: the same values but at
    rounding ties) for more rows than a decode batch on CUDA: an eager prefill, where the torch ops cost ten
    launches and passes over x per GEMM."""
    if x2.is_cuda and x2.shape[0] > FP8_DECODE_MAX_ROWS:
        from serving.engine import fp8_tokens

        if fp8_tokens.available():
            return fp8_tokens.tokens_e4m3(x2, QMAX[FP8])
    return quantize_tokens_fp8(x2)


def fp8_scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None, *, fast_accum: bool = True) -> torch.Tensor:
    """x [..., K] (bf16) times the e4m3 weight [N, K] with per-row scales [N]: each token (row of x) scaled to
    e4m3 by its own max, one FP8 tensor-core GEMM with both scales applied in its epilogue -> bf16 [..., N].
    The weight's transpose is the column-major second operand `_scaled_mm` wants (no copy). `fast_accum`:
    `EngineOptions.fp8_fast_accum`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, x_scale = prescaled_rows(x, x2.shape[0]) or tokens_to_e4m3(x2)  # the norm kernel may have scaled them
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype,
                         use_fast_accum=fast_accum)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


def fp8_emulated_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """`fp8_scaled_linear`'s numerics on any device: the same e4m3 tokens and scales, dequantized, multiplied
    in float32 (the tensor cores accumulate in their own order and precision), cast to x's dtype."""
    shape = x.shape
    xq, x_scale = quantize_tokens_fp8(x.reshape(-1, shape[-1]))
    y = F.linear(xq.float() * x_scale, dequantize_weight(weight, scale, torch.float32))
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------
# what a device can run


def check_device(method: str, device: torch.device | str, *, where: str) -> None:
    """Refuse, naming the setting and the device, a quantization the device cannot run: fp8 on a CUDA GPU
    below compute capability 8.9 (no e4m3 conversions or FP8 tensor cores). The CPU runs every method
    through the dequantizing reference path."""
    if method == FP8:
        require_e4m3(device, where=where, setting=SETTING, instead=f"{SETTING}='int8-weight-only'")


def require_e4m3(device: torch.device | str, *, where: str, setting: str, instead: str) -> None:
    """Refuse `setting`='fp8' on a CUDA GPU below compute capability 8.9 (no e4m3 conversions), naming the
    setting, the device and what to use `instead`; other devices pass."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(dev)
    if capability < FP8_MIN_CAPABILITY:
        raise EngineQuantizationError(
            f"{where}: {setting}='fp8' needs a GPU of compute capability "
            f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or later (Ada, Hopper); device {dev} "
            f"({torch.cuda.get_device_name(dev)}) has {'.'.join(map(str, capability))}. Use {instead} there")


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
