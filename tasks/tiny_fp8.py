"""Tiny checkpoints already in FP8, in the formats people download, made offline from the tiny Llama.

`make_tiny_fp8_model(out_dir, fmt)` writes the tiny Llama of `tasks.tiny_model` (bf16) quantized to FP8 in one
of `FP8_FORMATS`, each written by its format's own library where it has one on PyPI:

- `ct-tensor`, `ct-channel`, `ct-block`, `ct-naive`: llm-compressor's compressed-tensors format, by `compressed-tensors`
  (`apply_quantization_config`, then `ModelCompressor` compresses and writes `quantization_config`): its presets
  FP8 (per-tensor weights, static per-tensor input scales), FP8_DYNAMIC (per-channel weights, dynamic tokens;
  `ct-naive`: the same in the `naive-quantized` format) and FP8_BLOCK (block weights, dynamic token groups), with scales from each weight's own range (minmax, as
  llm-compressor's default observer); static input scales are a fixed 0.05 (no calibration data here);
- `modelopt`: NVIDIA ModelOpt's FP8, written here by hand to the layout of ModelOpt's own export: `nvidia-modelopt`
  0.47.0 installs and exports on the CPU (`mtq.quantize(model, mtq.FP8_DEFAULT_CFG, calibrate)`, then
  `export_hf_checkpoint`), but importing it took 45-120 s on the 2-core CI machine, more than the test it would
  serve. That export of this tiny model wrote `hf_quant_config.json` (`producer`, `quantization.quant_algo: FP8`,
  `kv_cache_quant_algo: null`, `exclude_modules: [lm_head, model.embed_tokens]`), config.json's
  `quantization_config` (`quant_method: modelopt`), and per projection `weight` e4m3, `weight_scale` and
  `input_scale` float32 scalars (q/k/v with scales of their own); so does `_modelopt`;
- `fp8-block`: the block-wise `fp8` format of the official Qwen3 / DeepSeek FP8 releases (`weight_scale_inv` per
  block, `quant_method: fp8`), written here by hand to that layout: transformers' own writer of it
  (FineGrainedFP8) quantizes on CUDA only.

Block formats use blocks of `TINY_BLOCK` x `TINY_BLOCK` (the releases use 128 x 128, wider than the tiny
model's k/v projections; a fused part must span whole blocks).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from tasks.tiny_model import make_tiny_model

FP8_FORMATS = ("ct-tensor", "ct-channel", "ct-block", "ct-naive", "modelopt", "fp8-block")
TINY_BLOCK = 32
MODELOPT_VERSION = "0.47.0"  # the export whose layout `_modelopt` writes
E4M3_MAX = 448.0
TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja")


def make_tiny_fp8_model(out_dir: Path, fmt: str, *, seed: int = 0, block: int = TINY_BLOCK) -> Path:
    """Write the tiny Llama of `seed`, quantized to FP8 in `fmt` (one of FP8_FORMATS), with its tokenizer."""
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt={fmt!r} is not one of {FP8_FORMATS}")
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="tiny-bf16-") as tmp:
        source = make_tiny_model(Path(tmp) / "hf", seed=seed)
        if fmt == "ct-naive":
            _compressed_tensors(source, out_dir, "channel", block, compression="naive-quantized")
        elif fmt.startswith("ct-"):
            _compressed_tensors(source, out_dir, fmt.removeprefix("ct-"), block)
        elif fmt == "modelopt":
            _modelopt(source, out_dir)
        else:
            _fp8_block(source, out_dir, block)
        for name in TEXT_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out_dir / name)
    return out_dir


def _bf16_model(source: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()


def _compressed_tensors(source: Path, out_dir: Path, strategy: str, block: int, *,
                        compression: str | None = None) -> None:
    """compressed-tensors' FP8 presets, scales from each weight's range, compressed and saved by the library in
    its `compression` format (default: the one it infers, float-quantized)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    preset = {"tensor": "FP8", "channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}[strategy]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if strategy == "block":
        scheme = QuantizationScheme(
            targets=["Linear"],
            weights=scheme.weights.model_copy(update={"block_structure": [block, block]}),
            input_activations=scheme.input_activations.model_copy(update={"group_size": block}))
    model = _bf16_model(source)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            args = module.quantization_scheme.weights
            low, high = _weight_range(module.weight.float(), strategy, block)
            scale, _ = calculate_qparams(low, high, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "input_scale"):  # static activations: no calibration data, a fixed scale
                module.input_scale.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=compression)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(out_dir)


def _weight_range(w: torch.Tensor, strategy: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of a weight [N, K] per tensor, per row or per block."""
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    blocks = _blocks(w, block)
    return blocks.amin((1, 3)), blocks.amax((1, 3))


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """W [N, K] zero-padded to whole blocks, as [N/b, b, K/b, b]."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w, (0, -k % block, 0, -n % block))
    return padded.reshape(padded.shape[0] // block, block, padded.shape[1] // block, block)


def _modelopt(source: Path, out_dir: Path) -> None:
    """ModelOpt's FP8 export layout by hand (module doc): per-tensor `weight_scale` (the weight's largest magnitude
    / 448) and `input_scale` (the calibration tokens' largest input magnitude / 448) as float32 scalars,
    `hf_quant_config.json`, and `quantization_config` (`quant_method: modelopt`) in config.json."""
    from safetensors.torch import save_file

    model = _bf16_model(source)
    amax: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: amax.__setitem__(
                 name, max(amax.get(name, 0.0), float(args[0].abs().amax()))))
             for name, m in model.named_modules() if name.startswith("model.layers.") and name.endswith("proj")]
    with torch.no_grad():
        model(torch.arange(3, 40).reshape(1, -1))  # calibration tokens
    for hook in hooks:
        hook.remove()
    state = {}
    for name, t in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module in amax:
            scale = t.float().abs().amax() / E4M3_MAX
            state[name] = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            state[f"{module}.weight_scale"] = scale.reshape(())
            state[f"{module}.input_scale"] = torch.tensor(amax[module] / E4M3_MAX, dtype=torch.float32)
        else:
            state[name] = t.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    excluded = ["lm_head", "model.embed_tokens"]
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": excluded}
    (out_dir / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": quant}, indent=4))
    config = json.loads((source / "config.json").read_text())
    float8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": float8, "weights": float8, "targets": ["Linear"]}},
        "ignore": excluded, "quant_algo": "FP8", "producer": producer, "quant_method": "modelopt"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _fp8_block(source: Path, out_dir: Path, block: int) -> None:
    """The `fp8` block-wise layout by hand: each projection e4m3 with `weight_scale_inv` [N/b, K/b] float32
    (multiplied: W = Q * s per block), everything else bf16, `quantization_config` as the releases have it."""
    from safetensors.torch import save_file

    model = _bf16_model(source)
    state = {}
    for name, t in model.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            q, s = quantize_blocks(t.float(), block)
            state[name], state[name + "_scale_inv"] = q, s
        else:
            state[name] = t.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K], float32 scales [ceil(N/b), ceil(K/b)]), each block by its largest magnitude."""
    n, k = w.shape
    blocks = _blocks(w, block)
    amax = blocks.abs().amax((1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(blocks.shape[0] * block, blocks.shape[2] * block)[:n, :k].contiguous()
    return q, scale[:, 0, :, 0].contiguous()
