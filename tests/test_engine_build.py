"""build_engine / read_engine_info / check_toolchain / errors of convert (tiny llama, CPU)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serving.engine import (
    CheckpointNotFoundError,
    EngineExistsError,
    EngineIntegrityError,
    EngineLimitError,
    EngineLimits,
    ToolchainMismatchError,
    UnsupportedArchitectureError,
    build_engine,
    check_toolchain,
    convert_checkpoint,
    load_engine,
    read_engine_info,
    verify_engine,
)
from tasks.tiny_model import make_tiny_model

LIMITS = EngineLimits(dtype="float32", max_batch_size=2, max_input_len=32, max_seq_len=64)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hf") / "tiny")


@pytest.fixture(scope="module")
def ckpt(hf_dir, tmp_path_factory) -> Path:
    return convert_checkpoint(hf_dir, tmp_path_factory.mktemp("ck") / "ckpt", dtype="float32")


def test_engine_folder_layout_and_info(ckpt, tmp_path):
    info = build_engine(ckpt, tmp_path / "engine", limits=LIMITS)
    names = sorted(p.name for p in info.path.iterdir())
    assert names == ["engine.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "weights-00001-of-00001.pt"]
    assert not list(tmp_path.glob(".*tmp*")), "temp folder left behind"
    d = json.loads((info.path / "engine.json").read_text())
    assert d["limits"] == dataclasses.asdict(LIMITS) and d["kind"] == "torch"
    assert set(d["toolchain"]) == {"torch", "cuda", "compute_capability", "engine_format_version"}
    assert read_engine_info(info.path) == info
    assert info.model.n_kv_heads == 2 and info.model.head_dim == 16
    assert verify_engine(info.path).fingerprint == info.fingerprint
    # weights load with torch alone, mmap'd
    state = torch.load(info.path / "weights-00001-of-00001.pt", weights_only=True, mmap=True)
    assert state["layers.0.attention.wqkv.weight"].shape == (64 + 2 * 32, 64)
    assert state["layers.0.feed_forward.w13.weight"].shape == (2 * 128, 64)


def test_fingerprint_stable_and_sensitive(hf_dir, ckpt, tmp_path):
    a = build_engine(ckpt, tmp_path / "a", limits=LIMITS)
    ckpt2 = convert_checkpoint(hf_dir, tmp_path / "ckpt2", dtype="float32")
    b = build_engine(ckpt2, tmp_path / "b", limits=LIMITS)
    assert a.fingerprint == b.fingerprint  # identical inputs, independent runs
    assert build_engine(ckpt, tmp_path / "a", limits=LIMITS) == a  # idempotent rebuild into the same folder

    c = build_engine(ckpt, tmp_path / "c", limits=dataclasses.replace(LIMITS, max_batch_size=3))
    assert c.fingerprint != a.fingerprint  # limits are part of the engine

    w = ckpt2 / "weights-00001-of-00001.pt"
    state = torch.load(w, weights_only=True)
    state["norm.weight"][0] += 1e-3
    torch.save(state, w)
    d = build_engine(ckpt2, tmp_path / "d", limits=LIMITS)
    assert d.fingerprint != a.fingerprint and d.files["weights-00001-of-00001.pt"] != a.files[
        "weights-00001-of-00001.pt"]


def test_refuses_to_overwrite_a_different_engine(ckpt, tmp_path):
    build_engine(ckpt, tmp_path / "e", limits=LIMITS)
    with pytest.raises(EngineExistsError, match="holds a different engine"):
        build_engine(ckpt, tmp_path / "e", limits=dataclasses.replace(LIMITS, max_seq_len=48))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(EngineExistsError, match="not an engine"):
        build_engine(ckpt, tmp_path / "junk", limits=LIMITS)
    assert not list(tmp_path.glob(".*tmp*"))


def test_verify_engine_detects_tampering(ckpt, tmp_path):
    info = build_engine(ckpt, tmp_path / "e", limits=LIMITS)
    with open(info.path / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(EngineIntegrityError, match="tokenizer.json"):
        verify_engine(info.path)


@pytest.mark.parametrize(("limits", "message"), [
    (EngineLimits("float32", 2, 64, 64), "max_input_len=64 must be < limits.max_seq_len=64"),
    (EngineLimits("float32", 2, 32, 1024), "max_seq_len=1024 exceeds the model's max_position_embeddings=512"),
    (EngineLimits("float32", 0, 32, 64), "max_batch_size=0 must be >= 1"),
    (EngineLimits("int8", 2, 32, 64), "limits.dtype='int8' is not supported"),
    (EngineLimits("bfloat16", 2, 32, 64), "limits.dtype='bfloat16' but checkpoint .* dtype='float32'"),
])
def test_limit_validation(ckpt, tmp_path, limits, message):
    with pytest.raises(EngineLimitError, match=message):
        build_engine(ckpt, tmp_path / "e", limits=limits)
    assert not (tmp_path / "e").exists()


def test_toolchain_mismatch_names_both_sides(ckpt, tmp_path):
    info = build_engine(ckpt, tmp_path / "e", limits=LIMITS)
    check_toolchain(info, device="cpu")  # same machine: fine
    old = dataclasses.replace(info, toolchain={**info.toolchain, "torch": "1.13.1"})
    with pytest.raises(ToolchainMismatchError, match=rf"built with torch 1.13.1, runtime has torch {torch.__version__[:4]}"):
        check_toolchain(old, device="cpu")
    newer_minor = dataclasses.replace(info, toolchain={**info.toolchain, "torch": "2.99.0"})
    check_toolchain(newer_minor, device="cpu")  # CPU: same major is enough
    fmt = dataclasses.replace(info, toolchain={**info.toolchain, "engine_format_version": 99})
    with pytest.raises(ToolchainMismatchError, match="format version 99, this runtime reads version 1"):
        check_toolchain(fmt, device="cpu")
    # load_engine runs the check too
    d = json.loads((info.path / "engine.json").read_text())
    d["toolchain"]["torch"] = "1.13.1"
    (info.path / "engine.json").write_text(json.dumps(d))
    with pytest.raises(ToolchainMismatchError, match="1.13.1"):
        load_engine(info.path, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_needs_same_capability(ckpt, tmp_path):
    info = build_engine(ckpt, tmp_path / "e", limits=LIMITS)
    other = dataclasses.replace(info, toolchain={**info.toolchain, "compute_capability": "7.0"})
    with pytest.raises(ToolchainMismatchError, match="compute capability 7.0, runtime device"):
        check_toolchain(other, device="cuda")


def test_unsupported_architecture(hf_dir, tmp_path):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*'gpt2'.*supported: LlamaForCausalLM"):
        convert_checkpoint(bad, tmp_path / "out", dtype="float32")
    (bad / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(UnsupportedArchitectureError, match="rope type 'yarn'"):
        convert_checkpoint(bad, tmp_path / "out", dtype="float32")
    assert not (tmp_path / "out").exists()


def test_missing_paths_are_named(hf_dir, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "out", dtype="float32")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"has no config.json"):
        convert_checkpoint(tmp_path / "empty", tmp_path / "out", dtype="float32")
    with pytest.raises(CheckpointNotFoundError, match="checkpoint.json is missing"):
        build_engine(hf_dir, tmp_path / "e", limits=LIMITS)  # an HF folder is not an engine checkpoint
    with pytest.raises(CheckpointNotFoundError, match="engine.json is missing"):
        read_engine_info(tmp_path / "empty")
    with pytest.raises(EngineLimitError, match="dtype='fp8'"):
        convert_checkpoint(hf_dir, tmp_path / "out", dtype="fp8")


def test_serving_engine_imports_only_torch_numpy_stdlib(tmp_path):
    """serving.engine must import inside Triton's python backend: no safetensors/transformers/tokenizers. Loading
    an engine imports no torch._dynamo either (2.5 s of CPU in each Triton `llm` stub, for a compile most never
    run)."""
    from triton_support import make_tiny_engine

    engine = make_tiny_engine(tmp_path, seed=0)
    code = ("import sys, serving.engine; bad = [m for m in ('safetensors', 'transformers', 'tokenizers', "
            "'prefect', 'mlflow', 'boto3', 'pydantic') if m in sys.modules]; print(bad); "
            "from serving.engine.runner import load_engine; load_engine(sys.argv[1], device='cpu'); "
            "print('torch._dynamo' in sys.modules); "
            "sys.exit(1 if bad or 'torch._dynamo' in sys.modules else 0)")
    res = subprocess.run([sys.executable, "-c", code, str(engine)], check=False, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stdout + res.stderr


def test_reads_pre_v5_configs_llama31_and_qwen2():
    """Real hub configs use rope_theta + rope_scaling (transformers < 5): parsed like rope_parameters."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from serving.engine.model import rope_inv_freq
    from serving.engine.models.registry import model_args_of

    llama31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
               "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512,
               "vocab_size": 1000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "tie_word_embeddings": True}
    args = model_args_of(llama31)
    assert (args.rope_type, args.rope_theta, args.rope_factor, args.head_dim) == ("llama3", 500000.0, 8.0, 64)
    assert args.tie_word_embeddings and not args.qkv_bias
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**llama31), "cpu")
    assert torch.allclose(rope_inv_freq(args), ref.float(), rtol=1e-6)

    qwen = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
            "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24, "intermediate_size": 4864,
            "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": 32768,
            "use_sliding_window": False, "tie_word_embeddings": True}
    args = model_args_of(qwen)
    assert args.qkv_bias and not args.o_bias and args.sliding_window is None and args.head_dim == 64


def test_the_registry_maps_each_architecture_to_its_family_and_names_the_supported_ones():
    """`models.registry`: a new family is one file and one entry; the supported list is the registry's keys."""
    from serving.engine import SUPPORTED_ARCHITECTURES, Transformer
    from serving.engine.models import gemma3, llama
    from serving.engine.models.registry import ARCHITECTURES, architecture_of, registered

    assert SUPPORTED_ARCHITECTURES == tuple(ARCHITECTURES)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(ARCHITECTURES)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):  # llama.py's families
        arch = ARCHITECTURES[name]
        assert arch.model_class is Transformer and arch.weights is llama.HF_TO_ENGINE
    for name, arch in ARCHITECTURES.items():
        assert registered(name) is arch and arch.weights.keys() >= {"model.embed_tokens.weight", "model.norm.weight"}
    assert registered("Gemma3ForCausalLM").model_class is gemma3.Transformer
    assert architecture_of({"model_type": "mistral"}).name == "MistralForCausalLM"  # no `architectures`
    assert architecture_of({"model_type": "gemma3_text"}).name == "Gemma3ForCausalLM"
    with pytest.raises(UnsupportedArchitectureError, match=r"'FalconForCausalLM' is not one this runtime serves; "
                       r"supported: LlamaForCausalLM \(model_type 'llama'\), MistralForCausalLM"):
        registered("FalconForCausalLM")
