"""Quantized weights of the `torch` engine: fp8 (e4m3) and int8 weight-only, per output channel.

Methods (`engine.quantization` in the release spec):

- `none`: weights in the engine dtype.
- `fp8`: each quantized weight `W [N, K]` is stored as float8_e4m3fn `Q` with one float32 scale per
  output channel (row) `s [N]`, `W ~= Q * s[:, None]`, `s = max|W[n]| / 448`. On a GPU that has FP8
  tensor cores (compute capability 8.9 or later, bf16 engines), GEMMs scale each activation row (token)
  to e4m3 at run time (`quantize_tokens_fp8`) and multiply e4m3 x e4m3, both scales in the epilogue:
  prefill GEMMs (more than 64 rows) through `torch._scaled_mm`; decode GEMMs (1-64 rows) of the shapes in
  `fp8_gemm.TUNED_FP8` (on compute capability 9.0: every Llama-1B/8B projection) through the split-K
  `fp8_gemm` kernel; other decode GEMMs of 16-64 rows with outputs at least `FP8_TENSOR_CORE_MIN_N` wide
  through `_scaled_mm`. The remaining decode GEMMs take the weight-only decode kernels, which read `Q` and
  `s` at their stored precision and convert the tile exactly in registers (`skinny_gemm`, `gate_up`).
- `int8-weight-only`: `Q` is int8, `s = max|W[n]| / 127`, round to nearest; activations stay in the
  engine dtype everywhere (for GPUs without FP8 and for the CPU).

What is quantized: the four projections of every layer (`wqkv`, `wo`, `w13`, `w2`), and the LM head
when `lm_head=True` (untied models only). Embeddings, norms, biases and (by default) the LM head keep
the engine dtype. Each quantized tensor `<name>` has its scale beside it in the same weight file, as
`<name>_scale` (`SCALE_SUFFIX`). `engine.json` records it all under `quantization` (`QuantInfo.to_dict`).

The CPU (and any device without the kernels) runs the same engines through the dequantizing reference
path `QuantLinear.reference`: the weight is dequantized on the fly into the engine dtype and multiplied
by F.linear, so CI exercises every quantized engine. That is weight-only numerics for fp8 too: the CPU
has no FP8 tensor cores. `fp8_emulated_linear` reproduces the per-token activation rounding on any
device (the same e4m3 values and scales; only the accumulation order and precision differ from the
tensor cores'), for tests and quality measurements. On the CPU an fp8 layer keeps its dequantized weight
after the first call (`QuantLinear.dequantized`): torch converts e4m3 to float there at about 80 M
elements/s (SmolLM2-135M: ~1.4 s of every forward), so an fp8 engine on the CPU takes the memory of its
engine dtype; it is the reference path, not a way to save CPU memory (int8 weight-only is, and its
conversion is 4x faster: it is dequantized at every call).

Imports: stdlib and torch only (this module runs inside Triton's python backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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
# the norms and SiLU * up writing an fp8 GEMM's input also write its rows scaled to e4m3 (serving.engine.prescaled):
# in the H200 profile of a 1,024-request FP8 run the separate scaling was 282 ms of 5,119 ms of kernels, all of it
# but wo's input; bit-equal results, 1,024 x 128/128 FP8 +1.5% (bench throughput side `paged-unscaled` without it)
PRESCALE_ROWS = True
# _scaled_mm's use_fast_accum in the fp8 prompt GEMMs (Hopper: the FP8 MMAs accumulate without cuBLAS/CUTLASS's
# periodic promotion to float32, as vLLM's and TensorRT-LLM's FP8 GEMM kernels do): 1,024 x 128/128 FP8 +7.5%;
# its quality on the real model in docs/quantization.md (side `paged-precise-accum` without it)
FP8_FAST_ACCUM = True
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
            "activations": ("per-token e4m3 at run time in FP8 tensor-core GEMMs (prefill; decode GEMMs in "
                            "fp8_gemm.TUNED_FP8, and of >= "
                            f"{FP8_TENSOR_CORE_MIN_ROWS} rows where N >= {FP8_TENSOR_CORE_MIN_N}); engine dtype in "
                            "the weight-only decode kernels and on the CPU"
                            if self.method == FP8 else "engine dtype"),
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

    `forward` (prompt steps, eager): for an fp8 layer of a bf16 engine on a GPU with FP8 tensor cores, inputs of
    at least `tensor_core_min_rows` rows take `tensor_core` (tokens scaled to e4m3, `torch._scaled_mm`) at any
    width; everything else the dequantizing `reference`. The decode step's Triton kernels read `weight` and `weight_scale`
    themselves for fewer rows (`model._linear_fn`).
    """

    def __init__(self, in_features: int, out_features: int, *, method: str, bias: bool, dtype: torch.dtype,
                 tensor_core_min_rows: int = FP8_TENSOR_CORE_MIN_ROWS) -> None:
        super().__init__()
        self.method = method
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = dtype
        self.tensor_core_min_rows = tensor_core_min_rows
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=STORED_DTYPES[method]),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._kept: tuple[tuple, torch.Tensor] | None = None  # (what it was made from, the dequantized weight)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, method={self.method}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prompt_tensor_cores(x) and has_fp8_tensor_cores(x.device.index or 0):
            return self.tensor_core(x)
        return self.reference(x)

    @property
    def decode_tensor_cores(self) -> bool:
        """Whether the decode step may run this layer's GEMMs of 1-64 rows on the split-K FP8 kernel
        (`fp8_gemm`, shapes in its table): fp8, no bias, and `tensor_core_min_rows` within the decode rows
        (the bench's `fp8-decode-kernels` sets it past them to time the weight-only kernels alone)."""
        return self.method == FP8 and self.bias is None and self.tensor_core_min_rows <= FP8_DECODE_MAX_ROWS

    def prompt_tensor_cores(self, x: torch.Tensor) -> bool:
        """Whether x [..., K] outside the decode kernels goes to the FP8 tensor cores: fp8, at least
        `tensor_core_min_rows` rows, a shape `_scaled_mm` takes. At any width: `reference` would dequantize the
        whole weight first (5 bytes a weight moved against 1), and its numerics (bf16 activations) would leave the
        quality gate's short prompts judging a path that longer prompts do not take."""
        rows = x.numel() // x.shape[-1]
        return self.method == FP8 and rows >= self.tensor_core_min_rows and scaled_mm_fits(x, self.weight)

    def tensor_core_shape(self, x: torch.Tensor) -> bool:
        """Whether x [..., K] goes to the FP8 tensor cores, by method, device type, dtype and shape only (no
        device query: a loaded fp8 engine's GPU was checked by `check_device`). At decode rows only wide
        outputs do: the row-wise FP8 GEMM tiles N alone, so an output under about one wave of 128-wide
        tiles on the GPU's SMs leaves it short of the bandwidth that the split-K decode kernels reach."""
        rows = x.numel() // x.shape[-1]
        wide = self.out_features >= FP8_TENSOR_CORE_MIN_N or rows > FP8_DECODE_MAX_ROWS
        return self.method == FP8 and rows >= self.tensor_core_min_rows and wide and scaled_mm_fits(x, self.weight)

    def tensor_core(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_scaled_linear(x, self.weight, self.weight_scale, self.bias)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """x times the dequantized weight in x's dtype: weight-only numerics, any device."""
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantized to `dtype`: made at each call, except an fp8 weight on the CPU, kept (module
        docstring) until the weight or its scale change (their version counters and storage are the key)."""
        if self.method != FP8 or self.weight.device.type != "cpu" or torch.compiler.is_compiling():
            return dequantize_weight(self.weight, self.weight_scale, dtype)
        made_from = (dtype, self.weight.data_ptr(), self.weight._version,
                     self.weight_scale.data_ptr(), self.weight_scale._version)
        if self._kept is None or self._kept[0] != made_from:
            self._kept = (made_from, dequantize_weight(self.weight, self.weight_scale, dtype))
        return self._kept[1]


def has_fp8_tensor_cores(device_index: int) -> bool:
    """Compute capability >= 8.9 (a constant to torch.compile: queried once per trace, not per step)."""
    return torch.cuda.get_device_capability(device_index) >= FP8_MIN_CAPABILITY


# What `@torch.compiler.assume_constant_result` does (torch 2.13, torch/_dynamo/decorators.py), without importing
# torch._dynamo when this module is imported: that import took 2.5 s of CPU in every process loading an engine (each
# Triton `llm` stub, each CLI), most of which never compile. tests/test_engine_build.py checks both.
has_fp8_tensor_cores._dynamo_marked_constant = True  # type: ignore[attr-defined]


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` with row-wise scales takes x [..., K] by weight [N, K]: CUDA, bf16
    activations, an e4m3 weight, K and N multiples of 16 (the rows and the device are the caller's)."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or weight.dtype != torch.float8_e4m3fn:
        return False
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


def quantize_tokens_fp8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]), each row scaled by its own max: x ~= q * scale.
    Torch ops that inductor fuses into the producer of x (the RMSNorm, SiLU * up) in the decode step."""
    amax = x2.abs().amax(dim=-1, keepdim=True).float()  # [T, 1]
    scale = torch.where(amax > 0, amax / QMAX[FP8], torch.ones_like(amax))
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


def prescale_rows_for(linear: nn.Module, rows: int, device: torch.device) -> bool:
    """Whether the norm writing `linear`'s input of `rows` rows should scale them to e4m3 too: `linear` an fp8
    layer whose GEMM would scale them in a Triton kernel (CUDA, past the decode rows), `PRESCALE_ROWS` on."""
    return (PRESCALE_ROWS and device.type == "cuda" and rows > FP8_DECODE_MAX_ROWS
            and isinstance(linear, QuantLinear) and linear.method == FP8)


def fp8_scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (bf16) times the e4m3 weight [N, K] with per-row scales [N]: each token (row of x) scaled to
    e4m3 by its own max, one FP8 tensor-core GEMM with both scales applied in its epilogue -> bf16 [..., N].
    The weight's transpose is the column-major second operand `_scaled_mm` wants (no copy)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, x_scale = prescaled_rows(x, x2.shape[0]) or tokens_to_e4m3(x2)  # the norm kernel may have scaled them
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype,
                         use_fast_accum=FP8_FAST_ACCUM)
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


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear)


def install_quantized_linears(model: nn.Module, info: QuantInfo, *, n_layers: int, tie_word_embeddings: bool,
                              dtype: torch.dtype, tensor_core_min_rows: int = FP8_TENSOR_CORE_MIN_ROWS) -> None:
    """Replace the modules that `info` quantizes with `QuantLinear`s of the same shape (on the model's
    device, meta included), before the quantized state dict is loaded. `tensor_core_min_rows`: the fewest
    rows an fp8 GEMM runs on the FP8 tensor cores with (the bench raises it past the decode batches to time
    the weight-only decode kernels beside them)."""
    for name in info.quantized_modules(n_layers, tie_word_embeddings=tie_word_embeddings):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        device = old.weight.device
        with torch.device(device):
            new = QuantLinear(old.in_features, old.out_features, method=info.method, bias=old.bias is not None,
                              dtype=dtype, tensor_core_min_rows=tensor_core_min_rows)
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
