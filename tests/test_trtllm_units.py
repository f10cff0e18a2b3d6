"""TensorRT-LLM kinds without TensorRT-LLM: options, command lines vs the documented flags, subprocess
steps (with fake tools), artifacts, toolchain policy, trtllm-bench dataset/report, spec and dispatch."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

from serving.trtllm import (
    TrtllmOptionError,
    TrtllmOptions,
    TrtllmStepError,
    TrtllmToolchainMismatchError,
    TrtllmUnavailableError,
    bench_command,
    build_command,
    build_trtllm_engine,
    check_trtllm_toolchain,
    convert_command,
    convert_trtllm_checkpoint,
    llm_args,
    modelopt_command,
    parse_bench_report,
    prepare_llmapi_artifact,
    read_artifact,
    verify_artifact,
    write_bench_dataset,
)
from serving.trtllm.bench import read_bench_dataset
from serving.trtllm.errors import TrtllmArtifactError, TrtllmBenchError
from serving.trtllm.flags import TRTLLM_BUILD, check_command
from serving.trtllm.steps import run_step
from tasks.engine_spec import EngineSpec

GOLDEN = Path(__file__).parent / "golden" / "trtllm"
UPDATE = os.environ.get("ENGINEWRIGHT_UPDATE_GOLDEN") == "1"
TOOLCHAIN = {"tensorrt_llm": "1.2.0", "tensorrt": "10.13.2", "cuda": "12.9", "container_image": None,
             "compute_capability": "9.0"}


def reference_engine() -> EngineSpec:
    return EngineSpec.model_validate(yaml.safe_load((GOLDEN / "spec.yaml").read_text())["engine"])


def reference_options() -> TrtllmOptions:
    from tasks.kind_trtllm import trtllm_options

    return trtllm_options(reference_engine())


def golden_json(name: str, value: object) -> None:
    path = GOLDEN / name
    text = json.dumps(value, indent=2, sort_keys=True) + "\n"
    if UPDATE or not path.exists():
        path.write_text(text)
    assert json.loads(path.read_text()) == json.loads(text), f"{name} differs from the golden (see README.md)"


# ---------------------------------------------------------------- spec and options


def test_spec_kinds_and_defaults() -> None:
    assert EngineSpec().kind == "torch"
    e = reference_engine()
    assert e.kind == "trtllm-engine" and e.trtllm.quantization == "fp8"
    with pytest.raises(ValueError, match="kind"):
        EngineSpec(kind="trtllm")
    with pytest.raises(ValueError, match="quantization"):
        EngineSpec.model_validate({"kind": "trtllm-engine", "trtllm": {"quantization": "int3"}})


def test_options_cross_field_rules_name_the_setting() -> None:
    with pytest.raises(TrtllmOptionError, match="engine.trtllm.quantization.*float32"):
        TrtllmOptions(dtype="float32", quantization="fp8").check()
    with pytest.raises(TrtllmOptionError, match="gemm_plugin='fp8'"):
        TrtllmOptions(gemm_plugin="fp8").check()
    with pytest.raises(TrtllmOptionError, match="max_num_tokens"):
        TrtllmOptions(max_input_len=4096, max_seq_len=8192, max_num_tokens=1024).check()
    TrtllmOptions(max_input_len=4096, max_seq_len=8192, max_num_tokens=1024, enable_chunked_context=True).check()


# ---------------------------------------------------------------- command lines vs documented flags


def test_golden_commands_match_documented_flags(tmp_path: Path) -> None:
    opts = reference_options()
    ex = Path("/app/tensorrt_llm/examples")
    cmds = {
        "convert": convert_command(opts, Path("/hf"), Path("/ckpt"), python="python3", examples=ex),
        "convert_none": convert_command(TrtllmOptions(dtype="float16", kv_cache_dtype="fp8"), Path("/hf"),
                                        Path("/ckpt"), python="python3", examples=ex),
        "convert_int4_awq": convert_command(TrtllmOptions(quantization="int4_awq", tp_size=2), Path("/hf"),
                                            Path("/ckpt"), python="python3", examples=ex),
        "build": build_command(opts, Path("/ckpt"), Path("/engine")),
        "modelopt": modelopt_command(TrtllmOptions(kind="trtllm-llmapi", quantization="fp8", kv_cache_dtype="fp8"),
                                     Path("/hf"), Path("/out"), python="python3", examples=Path("/modelopt/examples")),
        "bench": bench_command(model="meta-llama/Llama-3.1-8B", dataset=Path("/d.jsonl"), engine_dir=Path("/engine"),
                               max_batch_size=64, max_num_tokens=8192, kv_cache_free_gpu_mem_fraction=0.85),
    }
    golden_json("commands.json", cmds)
    assert cmds["convert"][1].endswith("quantization/quantize.py") and "--qformat" in cmds["convert"]
    assert cmds["convert_none"][1].endswith("models/core/llama/convert_checkpoint.py")
    assert "--fp8_kv_cache" in cmds["convert_none"]
    b = cmds["build"]
    for flag, value in (("--max_batch_size", "64"), ("--max_input_len", "2048"), ("--max_seq_len", "4096"),
                        ("--max_num_tokens", "8192"), ("--kv_cache_type", "paged"), ("--gemm_plugin", "fp8"),
                        ("--use_paged_context_fmha", "enable"), ("--use_fp8_context_fmha", "enable")):
        assert b[b.index(flag) + 1] == value


def test_check_command_refuses_undocumented_flags_and_values() -> None:
    with pytest.raises(TrtllmOptionError, match="--max_output_len is not in the documented"):
        check_command(["trtllm-build", "--max_output_len", "5"], TRTLLM_BUILD)
    with pytest.raises(TrtllmOptionError, match="'maybe' is not one of"):
        check_command(["trtllm-build", "--context_fmha", "maybe"], TRTLLM_BUILD)
    with pytest.raises(ValueError):
        check_command(["trtllm-build", "--max_batch_size", "many"], TRTLLM_BUILD)


def test_llm_args_golden_and_documented() -> None:
    args = llm_args(TrtllmOptions.from_mapping({**reference_options().__dict__, "kind": "trtllm-llmapi"}))
    golden_json("llm_args.json", args)
    assert args["kv_cache_config"] == {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": True, "dtype": "fp8"}


# ---------------------------------------------------------------- subprocess steps with fake tools


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


FAKE_CONVERT = """
import argparse, json, pathlib
p = argparse.ArgumentParser()
for f in ("--model_dir", "--output_dir", "--dtype", "--tp_size", "--pp_size", "--qformat", "--calib_size",
          "--kv_cache_dtype", "--awq_block_size", "--weight_only_precision"):
    p.add_argument(f)
p.add_argument("--fp8_kv_cache", action="store_true"); p.add_argument("--use_weight_only", action="store_true")
a = p.parse_args()
out = pathlib.Path(a.output_dir); out.mkdir(parents=True, exist_ok=True)
print("converting", a.model_dir, flush=True)
(out / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM", "dtype": a.dtype}))
(out / "rank0.safetensors").write_bytes(b"weights")
"""

FAKE_BUILD = """
import json, pathlib, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
out = pathlib.Path(args["--output_dir"]); out.mkdir(parents=True, exist_ok=True)
print("[TRT-LLM] [I] building", flush=True)
(out / "config.json").write_text(json.dumps({"version": "1.2.0", "build_config": {"max_batch_size": int(args["--max_batch_size"])}}))
(out / "rank0.engine").write_bytes(b"engine")
"""


def fake_hf(tmp_path: Path) -> Path:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 1}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7], "pad_token_id": 2}))
    (hf / "tokenizer.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"w")
    return hf


def test_convert_and_build_with_fake_tools(tmp_path: Path) -> None:
    ex = tmp_path / "examples"
    _script(ex / "models/core/llama/convert_checkpoint.py", FAKE_CONVERT)
    build = _script(tmp_path / "bin" / "trtllm-build", FAKE_BUILD)
    hf = fake_hf(tmp_path)
    opts = TrtllmOptions(dtype="bfloat16", examples_dir=str(ex), max_batch_size=4, max_input_len=16, max_seq_len=32,
                         max_num_tokens=64)
    lines: list[str] = []
    ckpt = convert_trtllm_checkpoint(hf, tmp_path / "ckpt", opts, log_dir=tmp_path / "logs", progress=lines.append)
    assert (ckpt / "config.json").is_file() and (ckpt / "hf_tokenizer" / "tokenizer.json").is_file()
    assert "converting" in (tmp_path / "logs" / "convert.log").read_text()
    art = build_trtllm_engine(ckpt, ckpt / "hf_tokenizer", tmp_path / "engine", opts, log_dir=tmp_path / "logs",
                              executable=str(build), toolchain=dict(TOOLCHAIN, tensorrt_llm=None))
    assert art.kind == "trtllm-engine" and art.toolchain["tensorrt_llm"] == "1.2.0"  # read from engine config.json
    assert art.special_tokens == {"end_id": 1, "pad_id": 2}
    assert (art.path / "engine" / "rank0.engine").is_file() and (art.path / "tokenizer" / "tokenizer.json").is_file()
    assert verify_artifact(art.path).fingerprint == art.fingerprint
    assert any("starting" in m for m in lines) and any("done" in m for m in lines)
    (art.path / "engine" / "rank0.engine").write_bytes(b"tampered")
    with pytest.raises(TrtllmArtifactError, match="changed since it was built"):
        verify_artifact(art.path)
    with pytest.raises(TrtllmArtifactError, match="already exists"):
        build_trtllm_engine(ckpt, hf, tmp_path / "engine", opts, log_dir=tmp_path / "logs", executable=str(build))


def test_step_failure_and_timeout_carry_the_log_tail(tmp_path: Path) -> None:
    bad = _script(tmp_path / "bad", "import sys\nprint('line one')\nprint('CUDA out of memory', flush=True)\nsys.exit(3)\n")
    with pytest.raises(TrtllmStepError, match="(?s)exit code 3.*CUDA out of memory"):
        run_step([str(bad)], what="trtllm-build", log_path=tmp_path / "b.log", timeout_s=30, setting="x")
    slow = _script(tmp_path / "slow", "import time\nprint('working', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(TrtllmStepError, match="(?s)within 0.5 s \\(setting engine.trtllm.build_timeout_s\\).*working"):
        run_step([str(slow)], what="trtllm-build", log_path=tmp_path / "s.log", timeout_s=0.5,
                 setting="engine.trtllm.build_timeout_s")
    with pytest.raises(TrtllmUnavailableError, match="cannot start"):
        run_step([str(tmp_path / "missing")], what="trtllm-build", log_path=tmp_path / "m.log", timeout_s=5, setting="x")


def test_failed_build_leaves_no_folder(tmp_path: Path) -> None:
    bad = _script(tmp_path / "trtllm-build", "import sys\nsys.exit(1)\n")
    with pytest.raises(TrtllmStepError):
        build_trtllm_engine(tmp_path, fake_hf(tmp_path), tmp_path / "engine", TrtllmOptions(max_input_len=16,
                            max_seq_len=32), log_dir=tmp_path / "logs", executable=str(bad))
    assert not (tmp_path / "engine").exists() and not list(tmp_path.glob(".engine.tmp-*"))


def test_llmapi_artifact(tmp_path: Path) -> None:
    hf = fake_hf(tmp_path)
    opts = TrtllmOptions(kind="trtllm-llmapi", max_input_len=16, max_seq_len=32)
    art = prepare_llmapi_artifact(hf, tmp_path / "art", opts, log_dir=tmp_path / "logs", toolchain=TOOLCHAIN)
    assert json.loads((art.path / "llm_args.json").read_text())["model"] == "checkpoint"
    assert (art.path / "checkpoint" / "model.safetensors").is_file()
    assert read_artifact(art.path).toolchain == TOOLCHAIN
    again = prepare_llmapi_artifact(hf, tmp_path / "art2", opts, log_dir=tmp_path / "logs", toolchain=TOOLCHAIN)
    assert again.fingerprint == art.fingerprint  # content only: no path or time in the fingerprint


# ---------------------------------------------------------------- toolchain


def test_toolchain_mismatch_names_both_sides() -> None:
    check_trtllm_toolchain(TOOLCHAIN, dict(TOOLCHAIN))
    with pytest.raises(TrtllmToolchainMismatchError, match="(?s)built for 9.0, target GPU is 8.0.*Recorded: "
                       "tensorrt_llm 1.2.0, compute capability 9.0.*Target: tensorrt_llm 1.2.0, compute capability 8.0"):
        check_trtllm_toolchain(TOOLCHAIN, dict(TOOLCHAIN, compute_capability="8.0"))
    with pytest.raises(TrtllmToolchainMismatchError, match="built with 1.2.0, target has 1.1.0"):
        check_trtllm_toolchain(TOOLCHAIN, dict(TOOLCHAIN, tensorrt_llm="1.1.0"))
    with pytest.raises(TrtllmToolchainMismatchError, match="target_toolchain.compute_capability"):
        check_trtllm_toolchain(TOOLCHAIN, dict(TOOLCHAIN, compute_capability=None))
    check_trtllm_toolchain(TOOLCHAIN, dict(TOOLCHAIN, tensorrt_llm="1.2.1", compute_capability="8.0"),
                           kind="trtllm-llmapi")
    with pytest.raises(TrtllmToolchainMismatchError, match="FP8 needs compute capability >= 8.9"):
        check_trtllm_toolchain(TOOLCHAIN, dict(TOOLCHAIN, compute_capability="8.0"), kind="trtllm-llmapi", uses_fp8=True)


# ---------------------------------------------------------------- trtllm-bench


def test_bench_dataset_documented_schema(tmp_path: Path) -> None:
    path = write_bench_dataset(tmp_path / "d.jsonl", [[5, 6, 7], [8]], 16)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"task_id": 0, "input_ids": [5, 6, 7], "output_tokens": 16}
    assert len(read_bench_dataset(path)) == 2
    with pytest.raises(TrtllmBenchError):
        write_bench_dataset(tmp_path / "e.jsonl", [[]], 4)


def test_parse_recorded_bench_report() -> None:
    report = parse_bench_report((GOLDEN / "trtllm_bench_throughput.txt").read_text())
    m = report["metrics"]
    assert m["output_tokens_per_s"] == pytest.approx(5276.2496)
    assert m["requests_per_s"] == pytest.approx(41.2207)
    assert m["ttft_avg_ms"] == pytest.approx(61.3188) and m["ttft_p99_ms"] == pytest.approx(97.6615)
    assert m["tpot_avg_ms"] == pytest.approx(10.8310)
    assert m["request_latency_p50_ms"] == pytest.approx(1421.5580)
    assert report["sections"]["WORLD + RUNTIME INFORMATION"]["Max Runtime Batch Size"] == 64
    with pytest.raises(TrtllmBenchError, match="PERFORMANCE OVERVIEW"):
        parse_bench_report("[TRT-LLM] crashed\n")


# ---------------------------------------------------------------- dispatch by engine.kind


def test_trtllm_kinds_fail_early_naming_engine_kind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import serving.trtllm.toolchain as tc
    from tasks.build import build
    from tasks.convert import ConvertedCheckpoint, convert

    monkeypatch.setattr(tc, "trtllm_installed", lambda: False)
    for kind in ("trtllm-engine", "trtllm-llmapi"):
        engine = EngineSpec(kind=kind, dtype="bfloat16")
        with pytest.raises(TrtllmUnavailableError, match=f"engine.kind='{kind}' needs TensorRT-LLM"):
            convert(tmp_path / "nowhere", engine, tmp_path)
        with pytest.raises(TrtllmUnavailableError, match="engine.kind"):
            build(ConvertedCheckpoint(tmp_path, "x"), engine, tmp_path)


def test_torch_build_key_unchanged_by_trtllm_section() -> None:
    from tasks.hashing import value_digest

    a, b = EngineSpec(), EngineSpec(trtllm={"quantization": "fp8"})
    assert value_digest(a.model_dump(exclude={"trtllm"})) == value_digest(b.model_dump(exclude={"trtllm"}))
