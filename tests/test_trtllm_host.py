"""Integration tests on a TensorRT-LLM host (marker ``trtllm``); skipped here with the reason.

Run inside ``nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3`` on a GPU (docs/tensorrt-llm.md):

    ENGINEWRIGHT_TRTLLM=1 TRTLLM_EXAMPLES_DIR=/path/to/TensorRT-LLM/examples \\
        python3 -m pytest -q -m trtllm tests/test_trtllm_host.py
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from serving.trtllm import TrtllmOptions, trtllm_installed
from serving.trtllm.flags import CONVERT_CHECKPOINT, LLM_KWARGS, QUANTIZE, TRTLLM_BENCH, TRTLLM_BUILD

pytestmark = [
    pytest.mark.trtllm,
    pytest.mark.skipif(not trtllm_installed(), reason="TensorRT-LLM is not installed here (its PyPI entry is a "
                       "stub); run on a TensorRT-LLM host, see docs/tensorrt-llm.md"),
    pytest.mark.skipif(os.environ.get("ENGINEWRIGHT_TRTLLM") != "1", reason="set ENGINEWRIGHT_TRTLLM=1 to run "
                       "the TensorRT-LLM integration tests"),
]


def _help(argv: list[str]) -> str:
    return subprocess.run(argv + ["--help"], check=False, capture_output=True, text=True, timeout=300).stdout


@pytest.mark.parametrize("table", [TRTLLM_BUILD, TRTLLM_BENCH], ids=lambda t: t.command)
def test_documented_flags_exist_in_installed_cli(table) -> None:
    text = _help([table.command]) + (_help([table.command, "--model", "x", "throughput"])
                                     if table is TRTLLM_BENCH else "")
    missing = [f for f in table.flags if f not in text]
    assert not missing, f"{table.command} --help lacks {missing}"


@pytest.mark.parametrize("table,script", [(CONVERT_CHECKPOINT, "models/core/llama/convert_checkpoint.py"),
                                          (QUANTIZE, "quantization/quantize.py")], ids=["convert", "quantize"])
def test_documented_flags_exist_in_example_scripts(table, script) -> None:
    from serving.trtllm.commands import examples_dir

    text = _help(["python3", str(examples_dir(TrtllmOptions()) / script)])
    missing = [f for f in table.flags if f not in text]
    assert not missing, f"{script} --help lacks {missing}"


def test_llm_signature_accepts_our_arguments() -> None:
    from tensorrt_llm import LLM

    params = inspect.signature(LLM.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        assert LLM_KWARGS <= set(params)


def test_tiny_engine_build_and_stage(tmp_path: Path) -> None:
    """Convert + trtllm-build the offline tiny Llama, check its toolchain, stage it into a repository."""
    from serving.triton.trtllm_repository import stage_trtllm_version
    from serving.trtllm import (
        build_trtllm_engine,
        convert_trtllm_checkpoint,
        current_toolchain,
        verify_artifact,
    )
    from tasks.tiny_model import make_tiny_model

    assert shutil.which("trtllm-build")
    hf = make_tiny_model(tmp_path / "hf", arch="llama")
    opts = TrtllmOptions(dtype="float16", max_batch_size=4, max_input_len=32, max_seq_len=64, max_num_tokens=128)
    ckpt = convert_trtllm_checkpoint(hf, tmp_path / "ckpt", opts, log_dir=tmp_path / "logs", progress=print)
    art = build_trtllm_engine(ckpt, ckpt / "hf_tokenizer", tmp_path / "engine", opts, log_dir=tmp_path / "logs",
                              progress=print)
    verify_artifact(art.path)
    assert art.toolchain["tensorrt_llm"] == json.loads((art.path / "engine" / "config.json").read_text())["version"]
    stage_trtllm_version(tmp_path / "repo", "tiny", art.path, target_toolchain=current_toolchain())
