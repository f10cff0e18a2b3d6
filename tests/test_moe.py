"""Mixtures of experts (Mixtral, Qwen3-MoE) on the CPU: the router's rule on ties against Hugging Face, conversion
(the published per-expert layout and transformers' stacked one, quantized experts), the configs read or refused,
and the validation gate refusing a conversion that routes or gates wrong.

Greedy tokens and logits against HF on the tiny checkpoints are in tests/test_engine_equivalence.py; the grouped
GEMM kernels in tests/test_moe_gemm.py."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch
from gate_faults import edited_runner, permute_router, swap_gate_up
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
from serving.engine.errors import CheckpointError, UnsupportedArchitectureError
from serving.engine.models.moe import route
from serving.engine.models.registry import model_args_of
from serving.engine.quantize import QuantInfo
from tasks.tiny_model import make_tiny_model
from tasks.validate import ValidationSpec, quantize_hf_linears, reference_run, validate_engine

LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=96, max_seq_len=128)
PROMPTS = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 14, 15], [0, 100], [0, 42, 283, 78, 81, 265]]
NEW_TOKENS = 16


def engine_of(hf_dir: Path, root: Path, name: str, quantization: QuantInfo | None = None) -> Path:
    ckpt = convert_checkpoint(hf_dir, root / f"ckpt-{name}", dtype="float32", quantization=quantization)
    return Path(build_engine(ckpt, root / f"engine-{name}", limits=LIMITS).path)


def test_route_breaks_ties_to_the_lowest_expert_and_renormalizes_as_asked():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 5.0, 1.0]])
    weights, ids = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [0, 1], [2, 1]]  # the tie at the 2nd place of row 2 (experts 1, 3) goes to 1
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))
    raw, same = route(logits, 2, renormalize=False)
    assert torch.equal(same, ids)
    torch.testing.assert_close(raw, torch.softmax(logits, -1).gather(1, ids))
    assert bool((raw.sum(-1) < 1).all())
    x = torch.randn(64, 8)  # without ties: torch.topk's choice and order
    values, top = torch.topk(torch.softmax(x, -1), 3)
    got, ids = route(x, 3, renormalize=False)
    assert torch.equal(ids, top) and torch.equal(got, values)


def stable_topk(x: torch.Tensor, k: int, dim: int = -1, **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk with the engine's rule on ties (the lowest index wins), for HF's router."""
    order = torch.sort(x, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
    return x.gather(dim, order), order


@torch.no_grad()
def hf_greedy_lowest_index_ties(hf_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF float32 greedy (whole sequence every step) with its routers' top-k under the engine's tie rule."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with mock.patch("torch.topk", stable_topk):
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


def edit_hf(hf_dir: Path, edit) -> None:
    path = hf_dir / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def test_two_experts_tied_exactly_give_hf_tokens_under_the_lowest_index_rule(tmp_path):
    """Router rows of experts 1 and 2 equal in both layers: their probabilities tie exactly at every token, and
    where one other expert ranks above them the rule picks the expert. The engine's tokens are HF's with its top-k
    under that rule; swapping the two experts' weights changes HF's tokens, so the tie decides tokens here."""
    hf_dir = make_tiny_model(tmp_path / "hf", arch="mixtral", seed=3)

    def tie(state: dict[str, torch.Tensor]) -> None:
        for i in range(2):
            router = state[f"model.layers.{i}.block_sparse_moe.gate.weight"]
            router[2] = router[1]

    edit_hf(hf_dir, tie)
    runner = load_engine(engine_of(hf_dir, tmp_path, "tie"), device="cpu")
    gate = runner.model.layers[0].feed_forward.gate
    logits = gate(torch.randn(32, gate.in_features))
    assert torch.equal(logits[:, 1], logits[:, 2]), "the tie must be exact in the engine"
    got = [g.token_ids for g in runner.generate(PROMPTS, max_new_tokens=NEW_TOKENS)]
    want = hf_greedy_lowest_index_ties(hf_dir, PROMPTS)
    assert got == want

    swapped = tmp_path / "hf-swapped"
    swapped.mkdir()
    for f in hf_dir.iterdir():
        (swapped / f.name).write_bytes(f.read_bytes())

    def swap(state: dict[str, torch.Tensor]) -> None:
        for i in range(2):
            for w in ("w1", "w2", "w3"):
                a, b = (f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight" for e in (1, 2))
                state[a], state[b] = state[b], state[a]

    edit_hf(swapped, swap)
    assert hf_greedy_lowest_index_ties(swapped, PROMPTS) != want, "the tie should decide some tokens"


def test_transformers_stacked_layout_converts_to_the_same_engine(tmp_path):
    """A checkpoint written from transformers' own state dict (experts stacked [E, ...], router `mlp.gate`)
    converts to the tensors of the published per-expert layout."""
    hf_dir = make_tiny_model(tmp_path / "hf", arch="mixtral", seed=1)
    stacked = tmp_path / "hf-stacked"
    stacked.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (stacked / f.name).write_bytes(f.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, stacked / "model.safetensors", metadata={"format": "pt"})
    one = torch.load(next((engine_of(hf_dir, tmp_path, "hub")).glob("weights-*.pt")), weights_only=True)
    two = torch.load(next((engine_of(stacked, tmp_path, "stacked")).glob("weights-*.pt")), weights_only=True)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert one["layers.0.feed_forward.w13.weight"].shape == (4 * 2 * 128, 64)


def test_an_expert_the_config_does_not_have_is_refused_naming_it(tmp_path):
    hf_dir = make_tiny_model(tmp_path / "hf", arch="mixtral")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    with pytest.raises(CheckpointError, match=r"block_sparse_moe\.experts\.3\.w[123]\.weight'.*\(3 experts\)"):
        convert_checkpoint(hf_dir, tmp_path / "ckpt", dtype="float32")
    assert not (tmp_path / "ckpt").exists()


def make_random_mixtral(out: Path, *, shards: int = 2, dim: int = 256, experts: int = 8, layers: int = 8) -> int:
    """A float32 Mixtral-shaped checkpoint in the published per-expert layout, in `shards` files; the largest file's
    bytes. At the defaults ~105 MB, a layer's experts 12.6 MB, about a quarter of a shard as in the published
    checkpoints (Mixtral-8x7B: 2.8 GB of a layer's experts, shards of 5 GB), one layer straddling the shards."""
    out.mkdir()
    inter = 2 * dim
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": dim, "hidden_size": dim,
           "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": inter,
           "num_local_experts": experts, "num_experts_per_tok": 2, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(cfg))
    shapes = {"model.embed_tokens.weight": (dim, dim), "model.norm.weight": (dim,), "lm_head.weight": (dim, dim)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + f"self_attn.{x}_proj.weight": (dim, dim) for x in "qkvo"}
        shapes |= {p + "block_sparse_moe.gate.weight": (experts, dim), p + "input_layernorm.weight": (dim,),
                   p + "post_attention_layernorm.weight": (dim,)}
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            shapes |= {q + "w1.weight": (inter, dim), q + "w3.weight": (inter, dim), q + "w2.weight": (dim, inter)}
    g = torch.Generator().manual_seed(0)
    names, per, weight_map, largest = list(shapes), -(-len(shapes) // shards), {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        group = {n: torch.randn(shapes[n], generator=g) for n in names[s * per:(s + 1) * per]}
        save_file(group, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
        largest = max(largest, (out / file).stat().st_size)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return largest


def test_experts_convert_in_the_bounded_memory_of_a_shard(tmp_path):
    """Peak RSS growth while converting a sharded Mixtral stays under 1.5x the largest shard, as for the dense
    families (tests/test_engine_convert.py); the figure is printed."""
    import subprocess
    import sys

    from test_engine_convert import MEASURE, REPO

    largest = make_random_mixtral(tmp_path / "hf")
    res = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "hf"), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=REPO, check=True)
    before, peak = map(int, res.stdout.split())
    print(f"\nconvert peak RSS growth {(peak - before) / 2**20:.1f} MiB; largest shard {largest / 2**20:.1f} MiB "
          f"(ratio {(peak - before) / largest:.2f})")
    assert peak - before < 1.5 * largest
    meta = json.loads((tmp_path / "out" / "checkpoint.json").read_text())
    assert len(meta["weights"]) == 3 + 8 * 7  # + per layer wqkv, wo, gate, w13, w2, 2 norms


@pytest.mark.parametrize("method", ["fp8", "int8-weight-only"])
def test_quantized_experts_are_stacked_with_per_expert_row_scales_and_equal_hf_with_the_same_rounding(tmp_path,
                                                                                                      method):
    """Experts quantized per row of the stacked weights (per expert and output channel), the router kept in the
    model's dtype; the engine's logits are HF's with every linear and expert weight rounded the same way (the
    validation gate's quantized peer, `quantize_hf_linears`)."""
    hf_dir = make_tiny_model(tmp_path / "hf", arch="qwen3-moe", seed=2, shards=3)
    engine = engine_of(hf_dir, tmp_path, method, QuantInfo(method))
    weights = json.loads((tmp_path / f"ckpt-{method}" / "checkpoint.json").read_text())["weights"]
    assert "layers.0.feed_forward.w13.weight_scale" in weights and "layers.1.feed_forward.w13.weight_scale" in weights
    assert "layers.0.feed_forward.gate.weight" in weights and "layers.0.feed_forward.gate.weight_scale" not in weights
    runner = load_engine(engine, device="cpu")
    ff = runner.model.layers[0].feed_forward
    assert ff.w13.weight.dtype != torch.float32 and ff.w13.weight_scale.shape == (8 * 2 * 64,)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    quantize_hf_linears(hf, method, lm_head=False, scale_tokens=False)
    prompt = list(range(3, 40))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(runner.prefill_logits(prompt), want, rtol=1e-4, atol=1e-4)


def test_configs_read_dense_layers_and_refuse_a_routing_the_engine_cannot_run(tmp_path):
    config = json.loads((make_tiny_model(tmp_path / "hf", arch="qwen3-moe") / "config.json").read_text())
    args = model_args_of(config)
    assert (args.n_experts, args.n_experts_per_tok, args.moe_renormalize, args.dense_layers) == (8, 2, False, (1,))
    step = model_args_of({**config, "mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 4,
                          "norm_topk_prob": True})
    assert step.dense_layers == (0, 2) and step.moe_renormalize
    with pytest.raises(UnsupportedArchitectureError, match="num_experts_per_tok=9 with 8 experts"):
        model_args_of({**config, "num_experts_per_tok": 9})


SPEC = ValidationSpec(prompts=["The quick brown fox", "Once upon a time"], max_new_tokens=8,
                      passages=["The release pipeline converts the checkpoint, builds the engine and checks it."])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3-moe"])
def test_the_validation_gate_refuses_experts_routed_or_gated_wrong(tmp_path, arch):
    """A clean float32 engine passes; the same engine with the router's rows of experts 0 and 1 swapped, or one
    expert's gate and up projections swapped (w1 <-> w3), is refused."""
    hf_dir = make_tiny_model(tmp_path / "hf", arch=arch)
    engine = engine_of(hf_dir, tmp_path, arch)
    reference = reference_run(hf_dir, SPEC, "float32", max_seq_len=LIMITS.max_seq_len,
                              max_input_len=LIMITS.max_input_len)
    clean = validate_engine(engine, hf_dir, SPEC, reference=reference)
    assert clean.passed, clean.failures
    for fault in (permute_router(0), swap_gate_up(0, expert=1)):
        result = validate_engine(engine, hf_dir, SPEC, reference=reference, runner=edited_runner(engine, fault))
        assert not result.passed
        assert any(f.startswith("mean per-token KL(reference || engine) ") for f in result.failures), result.failures


def test_a_quantized_mixtral_passes_against_a_peer_with_its_experts_quantized(tmp_path):
    """fp8 experts judged against HF with the same experts quantized (tasks.validate.quantize_hf_linears): it
    passes, and its router permuted is refused."""
    hf_dir = make_tiny_model(tmp_path / "hf", arch="mixtral")
    engine = engine_of(hf_dir, tmp_path, "fp8", QuantInfo("fp8"))
    reference = reference_run(hf_dir, SPEC, "float32+fp8", max_seq_len=LIMITS.max_seq_len,
                              max_input_len=LIMITS.max_input_len)
    clean = validate_engine(engine, hf_dir, SPEC, reference=reference)
    assert clean.passed and clean.precision == "float32+fp8", clean.failures
    wrong = validate_engine(engine, hf_dir, SPEC, reference=reference, runner=edited_runner(engine, permute_router(0)))
    assert not wrong.passed
