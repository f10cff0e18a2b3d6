"""Checkpoints that arrive already in FP8: which format a Hugging Face folder is in, and how its weights and
scales map onto the engine's fp8 layers, as they are (no bf16 round trip).

Formats read (`detect_fp8_checkpoint`):

- **compressed-tensors** (llm-compressor): `config.json` `quantization_config.quant_method: compressed-tensors`,
  one config group of `format` `float-quantized` / `naive-quantized`, 8-bit float symmetric static weights with
  strategy `tensor`, `channel` or `block` (`block_structure`), activations none, static per tensor
  (`input_scale`) or dynamic (per token, per group). Tensors: `<proj>.weight` e4m3, `<proj>.weight_scale`
  ([1], [N, 1] or [ceil(N/bn), ceil(K/bk)]).
- **ModelOpt** (NVIDIA Model Optimizer): `hf_quant_config.json` `quantization.quant_algo: FP8` (or `config.json`
  `quantization_config.quant_method: modelopt`). Tensors: `weight` e4m3, `weight_scale` and `input_scale`
  float32 scalars.
- **block-wise fp8** (the official Qwen3 / DeepSeek FP8 releases, transformers' FineGrainedFP8):
  `quantization_config.quant_method: fp8` with `weight_block_size: [bn, bk]`, dynamic activations. Tensors:
  `weight` e4m3, `weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] (multiplied, despite its name:
  W = Q * s over each block).

Mapping (`Fp8Checkpoint.engine_scale`): per-tensor and per-channel scales become the engine's per-output-channel
scales [N] (a per-tensor scale broadcast to its rows: exact), so q/k/v or gate/up parts scaled separately fuse
into `wqkv` / `w13` by concatenating their rows and scales; block scales stay blocks ([ceil(N/bn), ceil(K/bk)],
`linear_fp8_block.Fp8BlockLinear`), and a fused part must then span whole blocks of rows. Static input scales
(`input_scale`) and KV-cache scales (`k_scale`, `v_scale`) are not used: the engine scales tokens per token (per
group for block weights) at run time, and its KV cache is set by `engine.kv_cache`. The engine record says so.

`dequantized_state` gives the same checkpoint's weights * scales in float32 with the unquantized config, for
the validation gate's Hugging Face reference.

Imports: stdlib and torch (safetensors lazily, in `dequantized_state`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from serving.engine.errors import CheckpointError

COMPRESSED_TENSORS, MODELOPT, FP8_BLOCK = "compressed-tensors", "modelopt", "fp8"
PER_TENSOR, PER_CHANNEL, BLOCK = "per-tensor", "per-channel", "block"
MODELOPT_CONFIG = "hf_quant_config.json"
E4M3 = torch.float8_e4m3fn
# tensors of an FP8 checkpoint that the engine reads no value from (module doc)
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
CT_FORMATS = ("float-quantized", "naive-quantized")
SUPPORTED = ("compressed-tensors FP8 (format float-quantized / naive-quantized; weights per tensor, per channel "
             "or in blocks; activations static per tensor, dynamic or none), modelopt (quant_algo FP8), "
             "fp8 with weight_block_size (block-wise, dynamic activations)")


class UnsupportedQuantizationError(CheckpointError):
    """A checkpoint quantized in a scheme the engine does not load."""


@dataclass(frozen=True)
class Fp8Checkpoint:
    """A Hugging Face checkpoint whose projections are already e4m3 with their scales."""

    format: str  # COMPRESSED_TENSORS | MODELOPT | FP8_BLOCK
    weights: str  # PER_TENSOR | PER_CHANNEL | BLOCK (compressed-tensors' strategy; else what the format has)
    activations: str  # what the checkpoint asks of the activations, as a person reads it
    scale_suffix: str  # the weight's scale tensor: ".weight_scale" or ".weight_scale_inv"
    block: tuple[int, int] | None = None  # (rows, columns) of a weight block, for BLOCK
    config: dict[str, Any] | None = None  # the quantization config as the checkpoint wrote it

    def record(self) -> dict[str, Any]:
        """Where the engine's scales came from, for checkpoint.json / engine.json."""
        return {"format": self.format, "weights": self.weights,
                **({"block": list(self.block)} if self.block else {}),
                "activations": self.activations,
                "unused": "static input scales and KV-cache scales (input_scale, k_scale, v_scale), if any: the "
                          "engine scales tokens at run time and sets its KV cache by engine.kv_cache",
                "quantization_config": self.config}

    def unused(self, name: str) -> bool:
        """A tensor of the checkpoint the engine takes no value from (static input / KV-cache scales)."""
        return name.endswith(UNUSED_SUFFIXES)

    def weight_of_scale(self, name: str) -> str | None:
        """`<proj>.weight` for the weight's scale tensor `<proj>.weight_scale[_inv]`, else None."""
        if name.endswith(self.scale_suffix):
            return name[:-len(self.scale_suffix)] + ".weight"
        return None

    def engine_scale(self, scale: torch.Tensor, weight_shape: list[int], *, name: str, fused: bool) -> torch.Tensor:
        """The checkpoint's scale tensor `name` of a weight [N, K] in the engine's layout, float32: [N] per output
        channel (a per-tensor scale broadcast, exact), or [ceil(N/bn), ceil(K/bk)] for block weights. `fused`: the
        weight is one part of a fused tensor (its rows then span whole blocks)."""
        n, k = weight_shape
        scale = scale.to(torch.float32)
        if self.block is not None:
            bn, bk = self.block
            want = (math.ceil(n / bn), math.ceil(k / bk))
            if tuple(scale.shape) != want:
                raise CheckpointError(f"{name}: block scales of shape {list(scale.shape)}, expected {list(want)} for "
                                      f"the weight [{n}, {k}] in blocks of {bn} x {bk}")
            if fused and n % bn:
                raise UnsupportedQuantizationError(
                    f"{name}: the weight's {n} rows are not a multiple of the block's {bn} (weight_block_size / "
                    "block_structure), and the engine fuses it with its siblings (q/k/v, gate/up) into one tensor "
                    "whose blocks would straddle them; block-wise FP8 needs each fused part to span whole blocks")
            return scale.contiguous()
        if scale.numel() == 1:
            return scale.reshape(1).expand(n).contiguous()
        if scale.numel() == n and (scale.dim() == 1 or scale.shape[-1] == 1):
            return scale.reshape(n).contiguous()
        raise CheckpointError(f"{name}: a scale of shape {list(scale.shape)} for the weight [{n}, {k}] is neither "
                              f"per tensor nor per output channel ({self.format}, weights {self.weights})")

    def check_weight(self, name: str, weight: torch.Tensor) -> None:
        """Every projection of an FP8 checkpoint is e4m3 (the engine quantizes all of them or none)."""
        if weight.dtype != E4M3:
            raise UnsupportedQuantizationError(
                f"{name} is {str(weight.dtype).removeprefix('torch.')}, not float8_e4m3fn: this {self.format} "
                "checkpoint leaves a projection unquantized (its ignore / exclude list), and the engine loads FP8 "
                "checkpoints whose every layer projection is in FP8")

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The checkpoint's W = Q * s in float32, for the reference (the checkpoint's own scale tensor)."""
        q, s = weight.to(torch.float32), scale.to(torch.float32)
        if self.block is None:
            return q * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
        return q * expand_blocks(s, self.block, tuple(q.shape))


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one per element [N, K]."""
    bn, bk = block
    n, k = shape
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def detect_fp8_checkpoint(hf_dir: Path, config: dict[str, Any]) -> Fp8Checkpoint | None:
    """The FP8 format of the checkpoint at `hf_dir` (its `config.json` already read as `config`), None for an
    unquantized checkpoint; UnsupportedQuantizationError naming the value for any other quantization."""
    modelopt_file = Path(hf_dir) / MODELOPT_CONFIG
    qc = config.get("quantization_config")
    if modelopt_file.is_file():
        quant = json.loads(modelopt_file.read_text()).get("quantization") or {}
        return _modelopt(quant, where=f"{modelopt_file}: quantization")
    if not qc:
        return None
    where = f"{Path(hf_dir) / 'config.json'}: quantization_config"
    method = qc.get("quant_method")
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(qc, where=where)
    if method == MODELOPT:
        return _modelopt(qc, where=where)
    if method == FP8_BLOCK:
        return _fp8_block(qc, where=where)
    raise UnsupportedQuantizationError(f"{where}.quant_method={method!r} is not supported; the engine loads "
                                       f"checkpoints unquantized or in FP8: {SUPPORTED}")


def _refuse(where: str, value: Any) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{where}={value!r} is not supported; the engine loads checkpoints "
                                        f"unquantized or in FP8: {SUPPORTED}")


def _compressed_tensors(qc: dict[str, Any], *, where: str) -> Fp8Checkpoint:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(f"{where}.config_groups (one scheme for every projection expected)", sorted(groups))
    if qc.get("sparsity_config"):
        raise _refuse(f"{where}.sparsity_config", qc["sparsity_config"])
    if qc.get("transform_config"):
        raise _refuse(f"{where}.transform_config", qc["transform_config"])
    (group_name, group), = groups.items()
    at = f"{where}.config_groups.{group_name}"
    fmt = group.get("format") or qc.get("format")
    if fmt not in CT_FORMATS:
        raise _refuse(f"{at}.format", fmt)
    w = group.get("weights") or {}
    if (w.get("num_bits"), w.get("type"), w.get("symmetric", True), w.get("dynamic", False)) != (8, "float", True,
                                                                                                  False):
        raise _refuse(f"{at}.weights", {k: w.get(k) for k in ("num_bits", "type", "symmetric", "dynamic", "strategy")})
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        block = _block_of(w.get("block_structure"), where=f"{at}.weights.block_structure")
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"{at}.weights.strategy", strategy)
    weights = {"tensor": PER_TENSOR, "channel": PER_CHANNEL, "block": BLOCK}[strategy]
    a = group.get("input_activations")
    if a is None:
        activations = "none (weight-only FP8)"
    elif (a.get("num_bits"), a.get("type")) != (8, "float"):
        raise _refuse(f"{at}.input_activations", {k: a.get(k) for k in ("num_bits", "type", "strategy")})
    elif a.get("dynamic"):
        activations = f"dynamic, per {a.get('strategy')}" + (f" of {a['group_size']}" if a.get("group_size") else "")
    elif a.get("strategy") == "tensor":
        activations = "static per tensor (input_scale)"
    else:
        raise _refuse(f"{at}.input_activations.strategy (static)", a.get("strategy"))
    return Fp8Checkpoint(COMPRESSED_TENSORS, weights, activations, ".weight_scale", block, qc)


def _modelopt(quant: dict[str, Any], *, where: str) -> Fp8Checkpoint:
    algo = quant.get("quant_algo")
    if algo != "FP8":
        raise _refuse(f"{where}.quant_algo", algo)
    return Fp8Checkpoint(MODELOPT, PER_TENSOR, "static per tensor (input_scale)", ".weight_scale", None, quant)


def _fp8_block(qc: dict[str, Any], *, where: str) -> Fp8Checkpoint:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"{where}.fmt", qc.get("fmt"))
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(f"{where}.activation_scheme", qc.get("activation_scheme"))
    if qc.get("weight_block_size") is None:
        raise _refuse(f"{where}.weight_block_size", None)
    block = _block_of(qc["weight_block_size"], where=f"{where}.weight_block_size")
    return Fp8Checkpoint(FP8_BLOCK, BLOCK, f"dynamic, per token and group of {block[1]}", ".weight_scale_inv",
                         block, qc)


def _block_of(value: Any, *, where: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise _refuse(where, value)
    return int(value[0]), int(value[1])


def dequantized_state(hf_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json without `quantization_config`, the checkpoint's tensors with every FP8 weight dequantized
    to float32 by its own scales and the scale tensors dropped): what Hugging Face's plain model of that config
    loads as the validation gate's reference of an FP8 checkpoint."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    source = detect_fp8_checkpoint(hf_dir, config)
    if source is None:
        raise CheckpointError(f"{hf_dir} is not an FP8 checkpoint (no quantization_config, no {MODELOPT_CONFIG})")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    state = {}
    for name, t in tensors.items():
        if source.unused(name) or source.weight_of_scale(name) is not None:
            continue
        scale = tensors.get(name[:-len(".weight")] + source.scale_suffix) if name.endswith(".weight") else None
        state[name] = source.dequantize(t, scale) if t.dtype == E4M3 and scale is not None else t.float()
    config.pop("quantization_config", None)
    return config, state


def fp8_quantization(source: Fp8Checkpoint, asked: Any, *, where: str) -> Any:
    """The `quantize.QuantInfo` an engine of the FP8 checkpoint at `where` has: `asked` (the spec's) must be fp8
    without a quantized LM head (these formats leave it unquantized); the checkpoint's record added."""
    from serving.engine.quantize import FP8, SETTING, QuantInfo

    if asked.method != FP8 or asked.lm_head:
        raise UnsupportedQuantizationError(
            f"{SETTING}={asked.method!r}{' with engine.quantize_lm_head=true' if asked.lm_head else ''}: checkpoint "
            f"{where!r} is already in FP8 ({source.format}, weights {source.weights}); set {SETTING}: fp8 (and "
            "engine.quantize_lm_head: false) to load it as it is, without a round trip through the engine dtype")
    return QuantInfo(method=FP8, checkpoint=source.record())
