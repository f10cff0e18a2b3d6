"""Triton repositories for the TensorRT-LLM kinds: golden configs parsed with Triton's own protobuf
schema, staging into the gray-release layout (toolchain refused at stage time), and the adapter and
LLM-API python models under a fake ``triton_python_backend_utils`` and a recorded fake ``tensorrt_llm``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from google.protobuf import text_format
from triton_support import FakeRequest, FakeResponse, FakeTensor, make_fake_pb_utils
from tritonclient.grpc import model_config_pb2

from serving.triton.pbtxt import to_pbtxt
from serving.triton.repository import MODELS_DIR, served_versions
from serving.triton.trtllm_repository import (
    fill_template_commands,
    inflight_batcher_configs,
    stage_trtllm_version,
    template_values,
    trtllm_model_name,
    write_inflight_batcher_repository,
)
from serving.trtllm import TrtllmOptions, TrtllmToolchainMismatchError, prepare_llmapi_artifact
from serving.trtllm.artifacts import _finish, _meta

GOLDEN = Path(__file__).parent / "golden" / "trtllm"
UPDATE = os.environ.get("ENGINEWRIGHT_UPDATE_GOLDEN") == "1"
TOOLCHAIN = {"tensorrt_llm": "1.2.0", "tensorrt": "10.13.2", "cuda": "12.9", "container_image": None,
             "compute_capability": "9.0"}


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def reference_values() -> dict:
    from tasks.engine_spec import EngineSpec
    from tasks.kind_trtllm import trtllm_options

    spec = yaml.safe_load((GOLDEN / "spec.yaml").read_text())
    t = spec["triton"]
    return template_values(trtllm_options(EngineSpec.model_validate(spec["engine"])), engine_dir=t["engine_dir"],
                           tokenizer_dir=t["tokenizer_dir"], max_queue_delay_us=t["max_queue_delay_us"],
                           max_queue_size=t["max_queue_size"])


def golden_text(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        path.write_text(text)
    assert path.read_text() == text, f"{name} differs from the golden (see tests/golden/trtllm/README.md)"


def test_template_values_golden() -> None:
    values = reference_values()
    golden_text("template_values.json", json.dumps(values, indent=2, sort_keys=True) + "\n")
    for key, expected in (("triton_max_batch_size", "64"), ("decoupled_mode", "false"),
                          ("engine_dir", "/models/tensorrt_llm/1/engine"), ("batching_strategy", "inflight_fused_batching"),
                          ("kv_cache_free_gpu_mem_fraction", "0.85"), ("max_queue_delay_microseconds", "1000"),
                          ("max_queue_size", "128"), ("tokenizer_dir", "/models/tokenizer"), ("triton_backend", "tensorrtllm"),
                          ("encoder_input_features_data_type", "TYPE_BF16"), ("logits_datatype", "TYPE_FP32")):
        assert values[key] == expected, key


def test_inflight_batcher_set_parses_and_is_pinned(tmp_path: Path) -> None:
    values = reference_values()
    configs = write_inflight_batcher_repository(tmp_path / "repo", values)
    for template, config in configs.items():
        text = (tmp_path / "repo" / config["name"] / "config.pbtxt").read_text()
        msg = parse(text)
        assert msg.name == config["name"] and msg.max_batch_size == 64
        golden_text(f"{template}.config.pbtxt", text)
    llm = parse(to_pbtxt(configs["tensorrt_llm"]))
    p = {k: v.string_value for k, v in llm.parameters.items()}
    assert p["gpt_model_path"] == "/models/tensorrt_llm/1/engine" and p["gpt_model_type"] == "inflight_fused_batching"
    assert p["kv_cache_free_gpu_mem_fraction"] == "0.85" and p["enable_chunked_context"] == "true"
    assert "lora_prefetch_dir" not in p  # unset parameters are left out (the backend default applies)
    assert llm.backend == "tensorrtllm" and not llm.model_transaction_policy.decoupled
    assert llm.dynamic_batching.max_queue_delay_microseconds == 1000
    assert llm.dynamic_batching.default_queue_policy.max_queue_size == 128
    ens = parse(to_pbtxt(configs["ensemble"]))
    steps = [s.model_name for s in ens.ensemble_scheduling.step]
    assert steps == ["preprocessing", "tensorrt_llm", "postprocessing"]
    assert dict(ens.ensemble_scheduling.step[1].input_map)["request_output_len"] == "_REQUEST_OUTPUT_LEN"
    bls = parse(to_pbtxt(configs["tensorrt_llm_bls"]))
    assert bls.parameters["tensorrt_llm_model_name"].string_value == "tensorrt_llm"
    assert all(not t.startswith("$") for t in text_format.MessageToString(llm).split())


def test_renamed_set_and_fill_template_commands() -> None:
    names = {"preprocessing": "m_pre", "tensorrt_llm": "m_llm", "postprocessing": "m_post", "ensemble": "m",
             "tensorrt_llm_bls": "m_bls"}
    configs = inflight_batcher_configs(reference_values(), names)
    assert [s["model_name"] for s in configs["ensemble"]["ensemble_scheduling"]["step"]] == ["m_pre", "m_llm", "m_post"]
    assert configs["tensorrt_llm_bls"]["parameters"]["tensorrt_llm_model_name"]["string_value"] == "m_llm"
    cmds = fill_template_commands(reference_values())
    assert "engine_dir:/models/tensorrt_llm/1/engine" in cmds["tensorrt_llm"][-1]
    assert "lora_prefetch_dir" not in cmds["tensorrt_llm"][-1]


# ---------------------------------------------------------------- gray-release staging


def engine_artifact(tmp_path: Path, toolchain: dict = TOOLCHAIN, name: str = "art") -> Path:
    """A trtllm-engine artifact as build_trtllm_engine writes it (fake engine bytes)."""
    tmp = tmp_path / f".{name}.tmp"
    (tmp / "engine").mkdir(parents=True)
    (tmp / "engine" / "config.json").write_text(json.dumps({"version": toolchain["tensorrt_llm"]}))
    (tmp / "engine" / "rank0.engine").write_bytes(b"engine")
    (tmp / "tokenizer").mkdir()
    (tmp / "tokenizer" / "tokenizer.json").write_text("{}")
    opts = TrtllmOptions(max_batch_size=8, max_input_len=16, max_seq_len=32, max_num_tokens=64)
    return _finish(tmp, tmp_path / name, _meta("trtllm-engine", opts, toolchain, {"end_id": 1, "pad_id": 2}, [])).path


def test_stage_engine_version_layout(tmp_path: Path) -> None:
    art = engine_artifact(tmp_path)
    root = tmp_path / "repo"
    v = stage_trtllm_version(root, "m", art, target_toolchain=TOOLCHAIN, repository_mount="/models")
    assert v == 1 and served_versions(root, "m") == [1]
    target = trtllm_model_name("m", 1)
    llm = parse((root / target / "config.pbtxt").read_text())
    assert llm.name == target and llm.parameters["gpt_model_path"].string_value == f"/models/{target}/1/engine"
    assert (root / target / "1" / "engine" / "rank0.engine").is_file()
    engine_cfg = parse((root / "m_v1" / "config.pbtxt").read_text())
    assert engine_cfg.backend == "python" and engine_cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert {i.name for i in engine_cfg.input} >= {"input_ids", "text_input", "max_tokens"}  # router contract
    # the adapter answers in `execute`: Triton's dynamic batcher still gives it its batches
    assert engine_cfg.HasField("dynamic_batching") and "max_queue_size" not in engine_cfg.parameters
    vdir = root / "m_v1" / "1"
    assert (vdir / "model.py").read_text() == (MODELS_DIR / "trtllm_adapter.py").read_text()
    info = json.loads((vdir / "version.json").read_text())
    assert info["target_model"] == target and info["toolchain"] == TOOLCHAIN
    assert stage_trtllm_version(root, "m", engine_artifact(tmp_path, name="art2"), target_toolchain=TOOLCHAIN) == 2


@pytest.mark.parametrize("field,value,expected", [
    ("compute_capability", "8.0", "engine built for 9.0, target GPU is 8.0"),
    ("tensorrt_llm", "1.1.0", "built with 1.2.0, target has 1.1.0"),
])
def test_stage_refuses_toolchain_mismatch(tmp_path: Path, field: str, value: str, expected: str) -> None:
    art = engine_artifact(tmp_path)
    root = tmp_path / "repo"
    with pytest.raises(TrtllmToolchainMismatchError, match=expected) as err:
        stage_trtllm_version(root, "m", art, target_toolchain=dict(TOOLCHAIN, **{field: value}))
    assert "Recorded:" in str(err.value) and "Target:" in str(err.value)
    assert not (root / "m_v1").exists() and not list(root.glob("*trtllm*"))


def test_stage_toolchain_via_spec(tmp_path: Path) -> None:
    from tasks.engine_spec import EngineSpec
    from tasks.kind_trtllm import stage_for_kind

    art = engine_artifact(tmp_path)
    engine = EngineSpec(kind="trtllm-engine", dtype="bfloat16",
                        trtllm={"target_toolchain": {"tensorrt_llm": "1.2.0", "compute_capability": "10.0"}})
    with pytest.raises(TrtllmToolchainMismatchError, match="target GPU is 10.0"):
        stage_for_kind(tmp_path / "repo", "m", art, engine)


# ---------------------------------------------------------------- the adapter model


def load_model(monkeypatch, module_name: str, vdir_root: Path, handler=None, config: dict | None = None):
    import importlib

    mod = importlib.import_module(f"serving.triton.models.{module_name}")
    pb = make_fake_pb_utils(handler)
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    monkeypatch.setattr(mod, "pb_utils", pb)
    model = mod.TritonPythonModel()
    model.initialize({"model_name": "m_v1", "model_version": "1", "model_repository": str(vdir_root),
                      "model_config": json.dumps(config or {"parameters": {}})})
    return model, pb


def out(resp: FakeResponse, name: str):
    return resp.output(name)


def test_adapter_maps_router_contract_to_backend(monkeypatch, tmp_path: Path) -> None:
    import serving.trtllm.toolchain as tc

    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN))
    root = tmp_path / "repo"
    stage_trtllm_version(root, "m", engine_artifact(tmp_path), target_toolchain=TOOLCHAIN)

    def backend(model, version, inputs, requested):
        got = {t.name(): t.as_numpy() for t in inputs}
        assert model == "m_trtllm_v1" and requested == ["output_ids", "sequence_length"]
        if got["input_ids"][0][0] == 99:
            return FakeResponse(error=make_fake_pb_utils().TritonError("engine exploded"))
        n = int(got["request_output_len"][0][0])
        toks = [int(got["input_ids"][0][-1]) + 1 + i for i in range(n)] + [0, 0]
        return FakeResponse([FakeTensor("output_ids", np.asarray([[toks]], np.int32)),
                             FakeTensor("sequence_length", np.asarray([[n]], np.int32))])

    model, pb = load_model(monkeypatch, "trtllm_adapter", root / "m_v1", backend)
    reqs = [FakeRequest({"input_ids": [[5, 6, 7]], "max_tokens": [[3]], "top_k": [[4]], "seed": [[9]],
                         "stop_token_ids": [[9, 11]]}),
            FakeRequest({"input_ids": [[1] * 17], "max_tokens": [[2]]}),
            FakeRequest({"input_ids": [[99]], "max_tokens": [[2]]})]
    r = asyncio.run(model.execute(reqs))
    assert out(r[0], "output_ids").tolist() == [[8, 9, 10]]
    assert out(r[0], "finish_reason").tolist() == [[b"length"]]
    sent = {t.name(): t.as_numpy() for t in pb.calls[0][2]}
    assert sent["runtime_top_k"].tolist() == [[4]] and sent["seed"].dtype == np.uint64
    assert sent["stop_words_list"].tolist() == [[[9, 11], [1, 2]]] and sent["end_id"].tolist() == [[1]]
    assert sent["exclude_input_in_output"].tolist() == [[True]] and sent["input_lengths"].tolist() == [[3]]
    assert r[1].has_error() and "max_input_len 16" in r[1].error().message()
    assert r[2].has_error() and "engine exploded" in r[2].error().message()


def test_adapter_refuses_wrong_toolchain_at_load(monkeypatch, tmp_path: Path) -> None:
    import serving.trtllm.toolchain as tc

    root = tmp_path / "repo"
    stage_trtllm_version(root, "m", engine_artifact(tmp_path), target_toolchain=TOOLCHAIN)
    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN, compute_capability="8.6"))
    with pytest.raises(RuntimeError, match=r"\[m_v1 v1\].*target GPU is 8.6"):
        load_model(monkeypatch, "trtllm_adapter", root / "m_v1")


# ---------------------------------------------------------------- the LLM-API model with the recorded fake


@pytest.fixture()
def fake_trtllm(monkeypatch):
    monkeypatch.syspath_prepend(str(GOLDEN / "fake_tensorrt_llm"))
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)
    import tensorrt_llm

    assert tensorrt_llm.FAKE
    tensorrt_llm.CALLS.clear()
    yield tensorrt_llm
    for name in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        monkeypatch.delitem(sys.modules, name)


def llmapi_repo(tmp_path: Path, toolchain: dict = TOOLCHAIN) -> Path:
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    (hf / "model.safetensors").write_bytes(b"w")
    opts = TrtllmOptions(kind="trtllm-llmapi", max_batch_size=4, max_input_len=16, max_seq_len=32,
                         kv_cache_free_gpu_mem_fraction=0.5)
    art = prepare_llmapi_artifact(hf, tmp_path / "art", opts, log_dir=tmp_path / "logs", toolchain=toolchain)
    root = tmp_path / "repo"
    stage_trtllm_version(root, "m", art.path, target_toolchain=toolchain)
    return root


def test_llmapi_model_calls_documented_api(monkeypatch, tmp_path: Path, fake_trtllm) -> None:
    import serving.trtllm.toolchain as tc

    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN))
    root = llmapi_repo(tmp_path)
    model, _ = load_model(monkeypatch, "trtllm_llmapi", root / "m_v1")
    calls = dict(fake_trtllm.CALLS)
    assert calls["KvCacheConfig"] == {"free_gpu_memory_fraction": 0.5, "enable_block_reuse": False, "dtype": "auto"}
    assert calls["LLM"]["model"] == str(root / "m_v1" / "1" / "artifact" / "checkpoint")
    assert calls["LLM"]["max_batch_size"] == 4 and calls["LLM"]["backend"] == "pytorch"
    r = asyncio.run(model.execute([FakeRequest({"input_ids": [[3, 4]], "max_tokens": [[3]], "temperature": [[0.5]]}),
                                   FakeRequest({"max_tokens": [[3]]})]))
    assert out(r[0], "output_ids").tolist() == [[5, 6, 7]] and out(r[0], "finish_reason").tolist() == [[b"length"]]
    sp = next(c for c in fake_trtllm.CALLS if c[0] == "SamplingParams")[1]
    assert sp == {"max_tokens": 3, "temperature": 0.5, "end_id": 1}
    assert r[1].has_error() and "exactly one of inputs" in r[1].error().message()
    model.finalize()
    assert model.llm.closed


def test_llmapi_model_streams_when_decoupled(monkeypatch, tmp_path: Path, fake_trtllm) -> None:
    import serving.trtllm.toolchain as tc

    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN))
    root = llmapi_repo(tmp_path)
    model, _ = load_model(monkeypatch, "trtllm_llmapi", root / "m_v1",
                          config={"parameters": {}, "model_transaction_policy": {"decoupled": True}})
    sent: list = []

    class Sender:
        def send(self, response, flags=0):
            sent.append((response, flags))

    req = FakeRequest({"input_ids": [[3]], "max_tokens": [[3]]})
    req.get_response_sender = lambda: Sender()
    assert asyncio.run(model.execute([req])) is None
    assert [out(r, "output_ids").tolist() for r, _ in sent[:3]] == [[[4]], [[5]], [[6]]]
    assert sent[-1][1] == 1 and out(sent[-1][0], "finish_reason").tolist() == [[b"length"]]


def test_llmapi_model_without_trtllm_names_engine_kind(monkeypatch, tmp_path: Path) -> None:
    import serving.trtllm.toolchain as tc

    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN))
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import fails like on this machine
    root = llmapi_repo(tmp_path)
    with pytest.raises(RuntimeError, match="engine.kind='trtllm-llmapi' needs the tensorrt_llm package"):
        load_model(monkeypatch, "trtllm_llmapi", root / "m_v1")


def test_adapter_in_a_decoupled_engine_model_sends_final_responses(monkeypatch, tmp_path: Path) -> None:
    import serving.trtllm.toolchain as tc

    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN))
    root = tmp_path / "repo"
    stage_trtllm_version(root, "m", engine_artifact(tmp_path), target_toolchain=TOOLCHAIN)

    def backend(model, version, inputs, requested):
        return FakeResponse([FakeTensor("output_ids", np.asarray([[[7, 1]]], np.int32)),
                             FakeTensor("sequence_length", np.asarray([[2]], np.int32))])

    model, _ = load_model(monkeypatch, "trtllm_adapter", root / "m_v1", backend,
                          config={"parameters": {}, "model_transaction_policy": {"decoupled": True}})
    sent: list = []
    req = FakeRequest({"input_ids": [[5]], "max_tokens": [[4]], "stream": [[True]]})
    req.get_response_sender = lambda: type("S", (), {"send": lambda self, r, flags=0: sent.append((r, flags))})()
    assert asyncio.run(model.execute([req])) is None
    assert out(sent[0][0], "output_ids").tolist() == [[7, 1]] and sent[0][1] == 1
    assert out(sent[0][0], "finish_reason").tolist() == [[b"stop"]]  # ended on end_id 1 before max_tokens


# ---------------------------------------------------------------- chat, stop strings, ignore_eos, prompt_tokens

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
WORDS = ["<unk>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "hello", "world", "user", "assistant", "STOP", "<s>"]


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer with special tokens, a BOS post-processor and a chat template (what the
    adapters read from the checkpoint's tokenizer files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 10)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>",
                                                              "eos_token": "</s>"}))


CHAT = json.dumps([{"role": "user", "content": "hello world"}])
CHAT_IDS = [3, 7, 5, 6, 4, 3, 8]  # <|im_start|> user hello world <|im_end|> <|im_start|> assistant, no <s>


def test_adapter_maps_chat_stop_strings_ignore_eos_and_prompt_tokens(monkeypatch, tmp_path: Path) -> None:
    """The TensorRT backend's documented inputs: a chat rendered with the template and tokenized without
    special tokens; stop strings become stop_words_list entries beside stop ids ([ids..], [ends.., -1 pad]);
    ignore_eos sends end_id -1; the text is cut before a stop string; prompt_tokens is the prompt's length."""
    import serving.trtllm.toolchain as tc

    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN))
    art = engine_artifact(tmp_path)
    root = tmp_path / "repo"
    stage_trtllm_version(root, "m", art, target_toolchain=TOOLCHAIN, link=False, verify=False)
    write_tokenizer(root / "m_v1" / "1" / "tokenizer")
    answer = {"ids": [5, 6, 7]}

    def backend(model, version, inputs, requested):
        return FakeResponse([FakeTensor("output_ids", np.asarray([[answer["ids"]]], np.int32)),
                             FakeTensor("sequence_length", np.asarray([[len(answer["ids"])]], np.int32))])

    model, pb = load_model(monkeypatch, "trtllm_adapter", root / "m_v1", backend)
    chat = FakeRequest({"messages": np.array([[CHAT.encode()]], dtype=object), "max_tokens": [[4]],
                        "stop": np.array([[b"world", b"STOP hello"]], dtype=object), "stop_token_ids": [[9]],
                        "ignore_eos": [[True]]})
    text = FakeRequest({"text_input": np.array([[b"hello world"]], dtype=object), "max_tokens": [[3]]})
    r = asyncio.run(model.execute([chat, text]))
    sent = [{t.name(): t.as_numpy() for t in call[2]} for call in pb.calls]
    assert sent[0]["input_ids"].tolist() == [CHAT_IDS] and sent[0]["input_lengths"].tolist() == [[7]]
    assert sent[0]["stop_words_list"].tolist() == [[[9, 6, 9, 5], [1, 2, 4, -1]]]
    assert sent[0]["end_id"].tolist() == [[-1]]
    assert out(r[0], "text_output").tolist() == [[b"hello "]] and out(r[0], "finish_reason").tolist() == [[b"stop"]]
    assert out(r[0], "prompt_tokens").tolist() == [[7]]
    assert sent[1]["input_ids"].tolist() == [[10, 5, 6]] and sent[1]["end_id"].tolist() == [[1]]  # <s> added
    assert "stop_words_list" not in sent[1] and out(r[1], "prompt_tokens").tolist() == [[3]]
    assert out(r[1], "finish_reason").tolist() == [[b"length"]]


def test_adapter_refuses_a_chat_without_a_template(monkeypatch, tmp_path: Path) -> None:
    import serving.trtllm.toolchain as tc

    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN))
    root = tmp_path / "repo"
    stage_trtllm_version(root, "m", engine_artifact(tmp_path), target_toolchain=TOOLCHAIN, link=False, verify=False)
    write_tokenizer(root / "m_v1" / "1" / "tokenizer")
    (root / "m_v1" / "1" / "tokenizer" / "tokenizer_config.json").write_text("{}")
    model, pb = load_model(monkeypatch, "trtllm_adapter", root / "m_v1")
    r = asyncio.run(model.execute([FakeRequest({"messages": np.array([[CHAT.encode()]], dtype=object),
                                                "max_tokens": [[2]]})]))
    assert r[0].has_error() and "needs a chat template" in r[0].error().message() and not pb.calls


def test_llmapi_model_maps_chat_stop_ignore_eos_to_sampling_params(monkeypatch, tmp_path: Path, fake_trtllm) -> None:
    """The LLM API's documented SamplingParams names: stop, stop_token_ids, ignore_eos, end_id,
    add_special_tokens=False for a chat rendered with the checkpoint's template; prompt_tokens from
    RequestOutput.prompt_token_ids."""
    import serving.trtllm.toolchain as tc

    monkeypatch.setattr(tc, "current_toolchain", lambda: dict(TOOLCHAIN))
    write_tokenizer(tmp_path / "hf")
    root = llmapi_repo(tmp_path)
    model, _ = load_model(monkeypatch, "trtllm_llmapi", root / "m_v1")
    chat = FakeRequest({"messages": np.array([[CHAT.encode()]], dtype=object), "max_tokens": [[2]],
                        "stop": np.array([[b"world"]], dtype=object), "stop_token_ids": [[9]], "ignore_eos": [[True]]})
    r = asyncio.run(model.execute([chat, FakeRequest({"input_ids": [[3, 4]], "max_tokens": [[1]]})]))
    rendered = "<|im_start|>user hello world<|im_end|><|im_start|>assistant"
    prompts = [c[1]["inputs"] for c in fake_trtllm.CALLS if c[0] == "generate_async"]
    assert prompts == [rendered, [3, 4]]
    params = [c[1] for c in fake_trtllm.CALLS if c[0] == "SamplingParams"]
    assert params[0] == {"max_tokens": 2, "stop_token_ids": [9], "stop": ["world"], "ignore_eos": True,
                         "add_special_tokens": False, "end_id": 1}
    assert params[1] == {"max_tokens": 1, "end_id": 1}
    assert out(r[0], "prompt_tokens").tolist() == [[len(rendered)]] and out(r[1], "prompt_tokens").tolist() == [[2]]
