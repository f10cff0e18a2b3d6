"""Checkpoints already in FP8 load as they are (`serving.engine.fp8_checkpoint`), CPU, tiny Llama
(`tasks.tiny_fp8`): compressed-tensors per tensor / per channel / block (written by `compressed-tensors`), ModelOpt
FP8 and the block-wise `fp8` format (written to their layouts).

- each converts without a round trip (the engine's e4m3 bytes are the checkpoint's; fused q/k/v and gate/up keep
  each part's scales, exactly), builds with engine.json saying where the scales came from, and passes the
  validation gate in the FP8 budget against HF's plain model of the same checkpoint dequantized;
- one layer's scale read 8x too large by the conversion is refused by the gate;
- unsupported quantization configs, a spec that does not ask for fp8, fused parts that straddle blocks and an
  unquantized projection are refused, naming the value and what is supported;
- one format through the real release flow (Prefect, MLflow store, artifact store).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flows.release import release_flow
from flows.spec import parse_spec
from serving.engine import EngineLimits, build_engine, convert_checkpoint, read_engine_info
from serving.engine.convert import read_checkpoint_meta
from serving.engine.fp8_checkpoint import SUPPORTED, UnsupportedQuantizationError, dequantized_state
from serving.engine.quantize import FP8, QuantInfo
from tasks.checkpoint import check_checkpoint
from tasks.gate_specs import EnvelopeSpec, ValidationSpec
from tasks.tiny_fp8 import FP8_FORMATS, TEXT_FILES, make_tiny_fp8_model
from tasks.tiny_model import TEXT
from tasks.validate import render_report, validate_engine

LIMITS = EngineLimits(dtype="bfloat16", max_batch_size=4, max_input_len=48, max_seq_len=64)
SPEC = ValidationSpec(prompts=["The quick brown fox", "Once upon a time there"], max_new_tokens=8,
                      passages=TEXT.splitlines()[4:6], envelope=EnvelopeSpec(long_prompts=1))
RECORDED = {  # format, weights granularity and block of each tiny checkpoint, as engine.json records them
    "ct-tensor": ("compressed-tensors", "per-tensor", None),
    "ct-channel": ("compressed-tensors", "per-channel", None),
    "ct-block": ("compressed-tensors", "block", [32, 32]),
    "ct-naive": ("compressed-tensors", "per-channel", None),
    "modelopt": ("modelopt", "per-tensor", None),
    "fp8-block": ("fp8", "block", [32, 32]),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8ckpt")


def checkpoint(root: Path, fmt: str) -> Path:
    """The tiny checkpoint in `fmt`, written once per module."""
    out = root / f"hf-{fmt}"
    if not (out / "config.json").is_file():
        make_tiny_fp8_model(out, fmt)
    return out


def engine(root: Path, fmt: str, *, edit=None, name: str = "") -> Path:
    """Convert (fp8, bf16) and build the checkpoint of `fmt`; `edit(tensors)` changes the engine checkpoint first."""
    out = root / f"engine-{fmt}{name}"
    if (out / "engine.json").is_file():
        return out
    converted = convert_checkpoint(checkpoint(root, fmt), root / f"ckpt-{fmt}{name}", dtype="bfloat16",
                                   quantization=QuantInfo(FP8))
    if edit is not None:
        meta = read_checkpoint_meta(converted)
        for file in sorted(set(meta["weights"].values())):
            tensors = torch.load(converted / file, weights_only=True)
            if edit(tensors):
                torch.save(tensors, converted / file)
    return build_engine(converted, out, limits=LIMITS).path


def engine_tensors(engine_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in read_engine_info(engine_dir).weight_files:
        out.update(torch.load(engine_dir / file, weights_only=True))
    return out


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_each_format_loads_as_it_is_and_passes_the_fp8_gate(root, fmt):
    hf = checkpoint(root, fmt)
    engine_dir = engine(root, fmt)
    record = json.loads((engine_dir / "engine.json").read_text())["quantization"]
    source, weights, block = RECORDED[fmt]
    assert record["method"] == FP8 and record["checkpoint"]["format"] == source
    assert record["checkpoint"]["weights"] == weights and record["checkpoint"].get("block") == block
    assert record["scales"]["granularity"] == (f"per-block {block[0]}x{block[1]}" if block else "per-output-channel")

    mine, theirs = engine_tensors(engine_dir), load_file(hf / "model.safetensors")
    wo = mine["layers.1.attention.wo.weight"]
    assert wo.dtype == torch.float8_e4m3fn
    assert torch.equal(wo.view(torch.uint8), theirs["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8)), \
        "the engine's e4m3 weight is the checkpoint's, byte for byte"
    # fused q/k/v: each part keeps its own scales (per tensor broadcast to rows, per channel, or whole blocks)
    from serving.engine.linear_fp8_block import Fp8BlockLinear
    from serving.engine.linear_quantized import QuantLinear

    layer = (Fp8BlockLinear(64, 128, block=tuple(block), bias=False, dtype=torch.float32) if block
             else QuantLinear(64, 128, method=FP8, bias=False, dtype=torch.float32))
    layer.load_state_dict({"weight": mine["layers.0.attention.wqkv.weight"],
                           "weight_scale": mine["layers.0.attention.wqkv.weight_scale"]})
    _, reference = dequantized_state(hf)
    parts = [reference[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(layer.dequantize(torch.float32), torch.cat(parts)), "fused wqkv dequantizes exactly as its parts"

    result = validate_engine(engine_dir, hf, SPEC)
    print(render_report(result))
    assert result.precision == "bfloat16+fp8"
    assert result.passed, result.failures
    assert result.engine.mean_kl <= result.thresholds["max_mean_kl"]


@pytest.mark.parametrize("fmt", ["ct-channel", "fp8-block"])
def test_one_scale_read_8x_too_large_is_refused(root, fmt):
    """The conversion's fault, not the checkpoint's: the gate's reference dequantizes the checkpoint itself."""
    def corrupt(tensors: dict[str, torch.Tensor]) -> bool:
        name = "layers.0.attention.wo.weight_scale"
        if name in tensors:
            tensors[name] = tensors[name] * 8
        return name in tensors

    engine_dir = engine(root, fmt, edit=corrupt, name="-corrupt")
    result = validate_engine(engine_dir, checkpoint(root, fmt), SPEC)
    print(render_report(result))
    assert not result.passed
    assert any("mean per-token KL" in f for f in result.failures), result.failures


UNSUPPORTED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
            "quantization_config.quant_method='awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
             "quantization_config.quant_method='gptq'"),
    "ct-w4a16": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                           "symmetric": True, "dynamic": False}}}},
        "config_groups.group_0.format='pack-quantized'"),
    "ct-w8a8-int": ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
                                           "dynamic": False}}}},
        "config_groups.group_0.format='int-quantized'"),
    "ct-fp8-int-weights": ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
        "config_groups.group_0.weights={'num_bits': 8, 'type': 'int'"),
    "modelopt-nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quantization_config.quant_algo='NVFP4'"),
    "fp8-e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
                 "quantization_config.fmt='e5m2'"),
    "fp8-static": ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
                   "quantization_config.activation_scheme='static'"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_an_unsupported_quantization_is_refused_naming_it_and_what_is_supported(root, case):
    qc, named = UNSUPPORTED[case]
    hf = root / f"unsupported-{case}"
    shutil.copytree(checkpoint(root, "ct-channel"), hf, dirs_exist_ok=True)
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = qc
    (hf / "config.json").write_text(json.dumps(config))
    for refuse in (lambda: check_checkpoint(hf, kind="torch"),  # when the release starts, before any flow run
                   lambda: convert_checkpoint(hf, root / f"out-{case}", dtype="bfloat16", quantization=QuantInfo(FP8))):
        with pytest.raises(UnsupportedQuantizationError) as caught:
            refuse()
        assert named in str(caught.value) and SUPPORTED in str(caught.value), str(caught.value)
    assert not (root / f"out-{case}").exists()


def test_modelopt_quant_algo_other_than_fp8_in_hf_quant_config_is_refused(root):
    hf = root / "modelopt-w4a8"
    shutil.copytree(checkpoint(root, "modelopt"), hf, dirs_exist_ok=True)
    quant = json.loads((hf / "hf_quant_config.json").read_text())
    quant["quantization"]["quant_algo"] = "W4A8_AWQ"
    (hf / "hf_quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(UnsupportedQuantizationError, match=r"hf_quant_config.json: quantization.quant_algo='W4A8_AWQ'"):
        check_checkpoint(hf, kind="torch")


@pytest.mark.parametrize("method", ["none", "int8-weight-only"])
def test_an_fp8_checkpoint_needs_engine_quantization_fp8(root, method):
    with pytest.raises(UnsupportedQuantizationError, match=rf"engine.quantization='{method}'.*already in FP8 "
                                                           r"\(compressed-tensors, weights per-channel\); set "
                                                           "engine.quantization: fp8"):
        convert_checkpoint(checkpoint(root, "ct-channel"), root / f"out-{method}", dtype="bfloat16",
                           quantization=QuantInfo(method))


def test_fused_parts_that_straddle_blocks_are_refused(root):
    """Blocks of 128 rows: the tiny model's k and v projections have 32, and fuse with q into wqkv."""
    hf = root / "hf-block-128"
    make_tiny_fp8_model(hf, "fp8-block", block=128)
    with pytest.raises(UnsupportedQuantizationError, match=r"k_proj.weight_scale_inv: the weight's 32 rows are not a "
                                                           "multiple of the block's 128"):
        convert_checkpoint(hf, root / "out-block-128", dtype="bfloat16", quantization=QuantInfo(FP8))


def test_an_unquantized_projection_is_refused(root):
    hf = root / "hf-one-bf16-projection"
    shutil.copytree(checkpoint(root, "fp8-block"), hf, dirs_exist_ok=True)
    _, dequantized = dequantized_state(hf)
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = dequantized[name].to(torch.bfloat16)
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedQuantizationError, match=r"model.layers.1.mlp.up_proj.weight is bfloat16, not "
                                                           "float8_e4m3fn"):
        convert_checkpoint(hf, root / "out-one-bf16", dtype="bfloat16", quantization=QuantInfo(FP8))


def test_release_flow_publishes_a_block_wise_fp8_checkpoint(root, prefect_harness):
    hf = checkpoint(root, "fp8-block")
    assert all((hf / f).is_file() for f in TEXT_FILES[:2])
    spec = parse_spec({
        "source": {"checkpoint": str(hf)},
        "engine": {"dtype": "bfloat16", "quantization": "fp8", "max_batch_size": 4, "max_input_len": 48,
                   "max_seq_len": 64},
        "validation": {"max_new_tokens": 8, "prompts": ["The quick brown fox", "Once upon a time there"],
                       "passages": TEXT.splitlines()[4:6], "envelope": {"long_prompts": 1}},
        "evaluation": {"enabled": False},
        "perf": {"batch_size": 2, "input_len": 8, "output_len": 4, "warmup": 0, "iterations": 2, "max_iterations": 4,
                 "max_slowdown": 0.5},
        "mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "model_name": "tiny-fp8-block"},
        "artifacts": {"uri": (root / "artifacts").as_uri()},
        "approval": {"mode": "auto"},
        "work_dir": str(root / "work"),
    })
    state = release_flow(spec, return_state=True)
    assert state.is_completed(), state.message
    engines = list((root / "work" / "engines").glob("*/engine.json"))
    assert len(engines) == 1
    record = json.loads(engines[0].read_text())["quantization"]["checkpoint"]
    assert (record["format"], record["weights"], record["block"]) == ("fp8", "block", [32, 32])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel"])
def test_an_fp8_checkpoint_engine_on_the_gpu_passes_the_gate(root, fmt):
    """On a GPU with FP8 tensor cores the bf16 engine's GEMMs take e4m3 tokens (the block GEMM for `fp8-block`);
    the peer rounds its tokens the same way. `python3 -m pytest -m gpu tests/test_fp8_checkpoints.py`."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)")
    from serving.engine import load_engine
    from serving.engine.linear_fp8_block import BlockScaled, Fp8BlockLinear

    runner = load_engine(engine(root, fmt), device="cuda")
    if fmt == "fp8-block":
        layers = [m for m in runner.model.modules() if isinstance(m, Fp8BlockLinear)]
        assert layers and all(isinstance(route, BlockScaled) for layer in layers for _, route in layer.routes)
    result = validate_engine(engine(root, fmt), checkpoint(root, fmt), SPEC, runner=runner)
    print(render_report(result))
    assert result.passed, result.failures


def test_input_and_kv_cache_scales_are_not_used_and_the_record_says_so(root):
    """A ModelOpt export with `kv_cache_quant_algo: FP8` adds k/v scales; static input scales are there anyway."""
    hf = root / "modelopt-kv"
    shutil.copytree(checkpoint(root, "modelopt"), hf, dirs_exist_ok=True)
    tensors = load_file(hf / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.input_scale" in tensors
    for i in range(2):
        for kv in "kv":
            tensors[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"] = torch.tensor(0.02)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    converted = convert_checkpoint(hf, root / "ckpt-modelopt-kv", dtype="bfloat16", quantization=QuantInfo(FP8))
    meta = read_checkpoint_meta(converted)
    assert not [n for n in meta["weights"] if "input_scale" in n or n.endswith(("k_scale", "v_scale"))]
    record = meta["quantization"]["checkpoint"]
    assert record["activations"] == "static per tensor (input_scale)" and "input_scale, k_scale, v_scale" in record["unused"]


def test_a_sharded_checkpoint_whose_scales_lie_in_another_shard_converts_the_same(root):
    """Scales found in a later shard than their weights (and a fused part split over shards) wait for them."""
    hf = root / "hf-fp8-block-sharded"
    shutil.copytree(checkpoint(root, "fp8-block"), hf, dirs_exist_ok=True)
    tensors = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    later = {n for n in tensors if n.endswith("_scale_inv") or ".k_proj." in n}
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if n not in later},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if n in later}}
    for file, part in shards.items():
        save_file(part, str(hf / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = engine_tensors(build_engine(convert_checkpoint(hf, root / "ckpt-sharded", dtype="bfloat16",
                                                             quantization=QuantInfo(FP8)),
                                          root / "engine-sharded", limits=LIMITS).path)
    whole = engine_tensors(engine(root, "fp8-block"))
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[n].view(torch.uint8), whole[n].view(torch.uint8)) for n in whole)
