"""engine.quantization on the TensorRT-LLM kinds: the mapping to engine.trtllm.quantization and QuantConfig
(QuantAlgo FP8 / W8A16), the trtllm-engine version warning (no TensorRT-LLM needed; written against the
documented LLM API, which cannot run here)."""

from __future__ import annotations

import sys
import types

import pytest

from serving.trtllm import commands
from serving.trtllm.errors import TrtllmOptionError
from serving.trtllm.flags import check_llm_args
from serving.trtllm.options import TRTLLM_ENGINE_VERSIONS
from tasks.engine_spec import EngineSpec
from tasks.kind_trtllm import trtllm_options


def spec(**kw) -> EngineSpec:
    return EngineSpec(dtype="bfloat16", **kw)


@pytest.mark.parametrize(("method", "route", "algo"), [("fp8", "fp8", "FP8"),
                                                        ("int8-weight-only", "int8_weight_only", "W8A16")])
def test_engine_quantization_maps_to_the_trtllm_quantization(method, route, algo):
    options = trtllm_options(spec(kind="trtllm-llmapi", quantization=method))
    assert options.quantization == route and options.quant_algo == algo
    args = commands.llm_args(options)
    if method == "fp8":  # ModelOpt's export carries hf_quant_config.json (FP8), which the PyTorch backend reads
        assert options.llmapi_quantizes_with_modelopt and "quant_config" not in args
    else:  # no ModelOpt format: LLM(quant_config=QuantConfig(quant_algo=QuantAlgo.W8A16))
        assert args["quant_config"] == {"quant_algo": "W8A16"}
    assert trtllm_options(spec(kind="trtllm-llmapi")).quant_algo is None


def test_both_fields_must_agree():
    same = trtllm_options(spec(kind="trtllm-llmapi", quantization="fp8", trtllm={"quantization": "fp8"}))
    assert same.quantization == "fp8"
    with pytest.raises(TrtllmOptionError, match="engine.quantization='fp8'.*engine.trtllm.quantization='int4_awq'"):
        trtllm_options(spec(kind="trtllm-llmapi", quantization="fp8", trtllm={"quantization": "int4_awq"}))


def test_trtllm_engine_warns_which_versions_it_is_for():
    with pytest.warns(FutureWarning, match=r"TensorRT-LLM <= 1\.2.*trtllm-llmapi"):
        trtllm_options(spec(kind="trtllm-engine"))
    assert "removed in Jul 2026" in TRTLLM_ENGINE_VERSIONS


def test_quant_config_fields_are_checked():
    with pytest.raises(TrtllmOptionError, match="QuantConfig fields"):
        check_llm_args({"model": "m", "quant_config": {"quant_algo": "FP8", "group_size": 64}})


def test_make_llm_builds_the_documented_quant_config(monkeypatch, tmp_path):
    """A recorded stand-in of tensorrt_llm's LLM API: make_llm turns the argument file's quant_config into
    QuantConfig(quant_algo=QuantAlgo.W8A16)."""
    seen = {}

    class QuantConfig:
        def __init__(self, **kw):
            self.kw = kw

    llmapi = types.SimpleNamespace(KvCacheConfig=dict, QuantConfig=QuantConfig,
                                   QuantAlgo={"W8A16": "QuantAlgo.W8A16", "FP8": "QuantAlgo.FP8"})
    root = types.SimpleNamespace(LLM=lambda **kw: seen.update(kw) or "llm", llmapi=llmapi)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", root)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    args = commands.llm_args(trtllm_options(spec(kind="trtllm-llmapi", quantization="int8-weight-only")))
    assert commands.make_llm(args, tmp_path) == "llm"
    assert seen["quant_config"].kw == {"quant_algo": "QuantAlgo.W8A16"}
