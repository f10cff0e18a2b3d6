"""Qwen3 and Phi-3 / Phi-4 (`serving/engine/models/qwen3.py`, `phi3.py`): the validation gate passes each tiny
family and refuses a seeded bug in its conversion; the quantized engines stay within their precision's budget;
the config options the engine does not reproduce are refused naming the value and what is supported.

Greedy tokens and logits against HF float32 are `tests/test_engine_equivalence.py`'s (its ARCHS list both);
the release flow over each family is `tests/test_release_families.py`'s (over `tasks.tiny_model.FAMILY_ARCHS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from serving.engine import EngineLimits, build_engine, convert_checkpoint
from serving.engine.errors import EngineLimitError, UnsupportedArchitectureError
from serving.engine.models import qwen3
from serving.engine.models.registry import architecture_of, model_args_of
from serving.engine.quantize import FP8, INT8_WEIGHT_ONLY, QuantInfo
from tasks.tiny_model import FAMILY_ARCHS, make_tiny_model
from tasks.validate import ReferenceRun, ValidationSpec, reference_run, validate_engine
from tests.gate_faults import Tensors, edited_runner

LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=48, max_seq_len=96)
SPEC = ValidationSpec(prompts=["Once upon a time", "The quick brown"], max_new_tokens=6,
                      passages=["The quick brown fox jumps over the lazy dog."])


def build(hf: Path, root: Path, name: str, quantization: QuantInfo | None = None) -> Path:
    ckpt = convert_checkpoint(hf, root / f"ckpt-{name}", dtype="float32", quantization=quantization)
    return Path(build_engine(ckpt, root / f"engine-{name}", limits=LIMITS).path)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> Callable[[str], tuple[Path, Path, ReferenceRun]]:
    """arch -> (HF checkpoint, float32 engine, HF float32 reference run) of that tiny family, made once."""
    made: dict[str, tuple[Path, Path, ReferenceRun]] = {}

    def family(arch: str) -> tuple[Path, Path, ReferenceRun]:
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            hf = make_tiny_model(root / "hf", arch=arch, seed=5)
            made[arch] = (hf, build(hf, root, "float32"), reference_run(
                hf, SPEC, "float32", max_seq_len=LIMITS.max_seq_len, max_input_len=LIMITS.max_input_len))
        return made[arch]
    return family


def swap_gate_up(tensors: Tensors, args: dict) -> None:
    """gate_up_proj's halves taken the other way round: up * silu(gate) computed as gate * silu(up)."""
    for i in range(args["n_layers"]):
        gate, up = tensors[f"layers.{i}.feed_forward.w13.weight"].chunk(2)
        tensors[f"layers.{i}.feed_forward.w13.weight"] = torch.cat([up, gate])


def split_kv_wrong(tensors: Tensors, args: dict) -> None:
    """qkv_proj split as if k and v were the other way round (v's rows read as keys, k's as values)."""
    q_size, kv_size = args["n_heads"] * args["head_dim"], args["n_kv_heads"] * args["head_dim"]
    for i in range(args["n_layers"]):
        q, k, v = tensors[f"layers.{i}.attention.wqkv.weight"].split([q_size, kv_size, kv_size])
        tensors[f"layers.{i}.attention.wqkv.weight"] = torch.cat([q, v, k])


def test_both_families_are_registered_and_released_over_in_ci():
    assert {"qwen3", "phi3"} <= set(FAMILY_ARCHS)
    assert architecture_of({"model_type": "qwen3"}).name == "Qwen3ForCausalLM"
    assert architecture_of({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}).name == "Phi3ForCausalLM"
    with pytest.raises(UnsupportedArchitectureError, match=r"supported: .*Qwen3ForCausalLM \(model_type 'qwen3'\)"
                       r".*Phi3ForCausalLM \(model_type 'phi3'\)"):
        architecture_of({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"})


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "phi3-longrope"])
def test_the_gate_passes_the_family(families, arch):
    hf, engine, reference = families(arch)
    good = validate_engine(engine, hf, SPEC, reference=reference)
    assert good.passed, f"{arch}: {good.failures}"
    assert good.top1_agreement == 1.0


def test_the_gate_refuses_qwen3_converted_with_its_q_and_k_norms_swapped(families, tmp_path, monkeypatch):
    """The seeded bug in the conversion itself: the weight table maps q_norm to k_norm and back."""
    hf, _, reference = families("qwen3")
    q, k = "model.layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"
    monkeypatch.setitem(qwen3.HF_TO_ENGINE, q, qwen3.HF_TO_ENGINE[k])
    monkeypatch.setitem(qwen3.HF_TO_ENGINE, k, ("layers.{i}.attention.q_norm.weight", 0, 1))
    swapped = build(hf, tmp_path, "swapped-norms")
    bad = validate_engine(swapped, hf, SPEC, reference=reference)
    print(f"refused: {bad.failures}")
    assert not bad.passed and any("diverged" in f or "KL" in f for f in bad.failures), bad.failures


@pytest.mark.parametrize("bug", [swap_gate_up, split_kv_wrong], ids=["gate-up-swapped", "k-v-split-wrong"])
def test_the_gate_refuses_phi3_with_its_packed_tensors_split_wrong(families, bug):
    """The seeded bugs of a conversion that split Phi-3's packed tensors instead of copying them whole."""
    hf, engine, reference = families("phi3")
    bad = validate_engine(engine, hf, SPEC, reference=reference, runner=edited_runner(engine, bug))
    print(f"refused: {bad.failures}")
    assert not bad.passed and any("diverged" in f or "KL" in f for f in bad.failures), bad.failures


@pytest.mark.parametrize("method", [FP8, INT8_WEIGHT_ONLY])
@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_quantized_engines_pass_their_budget(families, tmp_path, arch, method):
    """Per-channel quantization of the packed Phi-3 projections is the engine's of its fused ones, and Qwen3's
    head norms stay in the engine dtype: the gate's quantized HF peer and the engine agree within the budget."""
    hf, _, reference = families(arch)
    engine = build(hf, tmp_path, method, QuantInfo(method))
    result = validate_engine(engine, hf, SPEC, reference=reference_run(
        hf, SPEC, f"float32+{method}", max_seq_len=LIMITS.max_seq_len, max_input_len=LIMITS.max_input_len,
        base=reference))
    assert result.passed, f"{arch} {method}: {result.failures}"


def test_phi3_longrope_equals_hf_within_its_original_context_and_a_build_past_it_is_refused(families, tmp_path):
    """HF's short factors and attention factor up to original_max_position_embeddings (512 here, of 4096): the
    float32 engine's logits and greedy tokens are HF's; a longer max_seq_len is refused, naming the limit."""
    from transformers import AutoModelForCausalLM

    from serving.engine import load_engine

    hf, engine, _ = families("phi3-longrope")
    runner = load_engine(engine, device="cpu")
    assert runner.info.model.rope_type == "longrope"
    assert runner.info.model.rope_attention_factor == pytest.approx((1 + math.log(8) / math.log(512)) ** 0.5)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompt = list(range(3, 3 + LIMITS.max_seq_len))
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
        greedy = model.generate(torch.tensor([prompt[:30]]), max_new_tokens=30, do_sample=False, eos_token_id=None)
    got = runner.prefill_logits(prompt)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    assert runner.generate([prompt[:30]], max_new_tokens=30)[0].token_ids == greedy[0, 30:].tolist()
    ckpt = convert_checkpoint(hf, tmp_path / "ckpt", dtype="float32")
    past = EngineLimits(dtype="float32", max_batch_size=1, max_input_len=32, max_seq_len=513)
    with pytest.raises(EngineLimitError, match=r"limits.max_seq_len=513 exceeds the model's "
                       r"original_max_position_embeddings=512 \(rope type 'longrope'"):
        build_engine(ckpt, tmp_path / "engine", limits=past)


def phi3_config(**extra) -> dict:
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
            "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32, "intermediate_size": 8192,
            "vocab_size": 32064, "max_position_embeddings": 4096, "rope_theta": 10000.0, **extra}


def test_phi3_rope_options_are_read_or_refused_naming_them():
    args = model_args_of(phi3_config(rope_scaling=None, sliding_window=2047))  # Phi-3-mini-4k
    assert (args.rope_type, args.head_dim, args.sliding_window, args.qkv_bias) == ("default", 96, 2047, False)
    phi4 = model_args_of(phi3_config(hidden_size=5120, num_attention_heads=40, num_key_value_heads=10,
                                     num_hidden_layers=40, intermediate_size=17920, vocab_size=100352,
                                     max_position_embeddings=16384, rope_theta=250000.0, rope_scaling=None))
    assert (phi4.head_dim, phi4.n_kv_heads, phi4.qkv_size, phi4.rope_theta) == (128, 10, 7680, 250000.0)  # Phi-4
    factors = {"short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    for rope_type in ("longrope", "su"):  # Phi-3.5-mini, and Phi-3-mini-128k's first config
        args = model_args_of(phi3_config(rope_scaling={"type": rope_type, **factors}, max_position_embeddings=131072,
                                         original_max_position_embeddings=4096))
        assert (args.rope_type, args.rope_original_max_position_embeddings) == ("longrope", 4096)
        assert args.rope_attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    with pytest.raises(UnsupportedArchitectureError, match=r"rope type 'yarn' in config.json \(Phi3ForCausalLM\) "
                       r"is not supported; supported: \['default', 'longrope', 'su'\]"):
        model_args_of(phi3_config(rope_scaling={"type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedArchitectureError, match=r"rope short_factor=\[1.0, 1.0\] in config.json: "
                       r"longrope needs a list of head_dim / 2 = 48 numbers"):
        model_args_of(phi3_config(rope_scaling={"type": "longrope", "short_factor": [1.0, 1.0]}))
    with pytest.raises(UnsupportedArchitectureError, match=r"partial_rotary_factor=0.75 in config.json"):
        model_args_of(phi3_config(partial_rotary_factor=0.75))  # Phi-4-mini


def test_qwen3_reads_its_own_head_dim_and_its_sliding_window_only_when_used():
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36,
              "intermediate_size": 12288, "vocab_size": 151936, "max_position_embeddings": 40960,
              "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False, "attention_bias": False}
    args = model_args_of(config)  # Qwen3-8B
    assert (args.head_dim, args.q_size, args.qkv_bias, args.sliding_window) == (128, 4096, False, None)
    assert model_args_of({**config, "sliding_window": 4096}).sliding_window is None
    assert model_args_of({**config, "sliding_window": 4096, "use_sliding_window": True}).sliding_window == 4096
