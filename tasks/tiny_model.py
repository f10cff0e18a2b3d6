"""A tiny, offline, deterministic Hugging Face checkpoint for tests and demos.

`make_tiny_model(out_dir, arch=..., seed=...)` writes `config.json`, `generation_config.json`,
`model.safetensors` (or N shards + `model.safetensors.index.json`) and a byte-level BPE tokenizer
(`tokenizer.json`, `tokenizer_config.json`, ...) trained with `tokenizers` on a small embedded
English text. Weights are drawn with a large `initializer_range` so output distributions are
peaked: greedy argmax has clear margins and comparisons against HF are well defined.
Same arguments -> byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ARCHS = ("llama", "mistral", "qwen2", "llama3-rope", "llama-tied", "qwen3", "phi3", "phi3-longrope", "mixtral",
         "qwen3-moe", "mistral-window", "gemma3")
# one tiny checkpoint per registered architecture family: the ones the release flow is run over in CI
FAMILY_ARCHS = ("llama", "mistral-window", "qwen2", "qwen3", "phi3", "mixtral", "qwen3-moe", "gemma3")
SLIDING_WINDOW = 12  # the windowed tiny checkpoints' window: shorter than the tests' prompts and generations
# Gemma's norms scale by (1 + w) and its tied embeddings are scaled by sqrt(hidden_size): norms around 8 and the
# table halved keep the tiny model's greedy generations from repeating one token (the residual stream would be the
# input token's own embedding, which the tied head scores highest)
GEMMA_NORM_CENTER = (7.0, 0.5)  # (norm weights' mean, factor on the embedding table)
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
VOCAB_SIZE = 512

TEXT = """\
The quick brown fox jumps over the lazy dog. A small engine turns token ids into more token ids,
one step at a time, and never sees the text itself. The tokenizer lives beside the engine.
Once upon a time there was a little model that lived in a folder on a disk. Every morning it woke
up, read its config, loaded its weights and waited for prompts. Some prompts were short and some
were long, and the model answered each of them with a few words of its own.
In the beginning the weights were random, drawn from a normal distribution with a large spread,
so the model was very sure of itself and said strange things with great confidence.
The engineers did not mind: they only wanted to know that the engine and the reference agreed,
token for token, on every prompt, in every batch, with and without padding.
Rain fell on the river and the river ran to the sea. The sea was grey and the sky was grey too.
A ship sailed out of the harbour in the morning and came back in the evening with fish and salt.
The children ran along the shore, counting the waves and the birds and the boats on the water.
Numbers and letters: one, two, three, four, five, six, seven, eight, nine, ten. Alpha, beta,
gamma, delta. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February,
March, April, May, June, July, August, September, October, November, December.
What is the capital of France? Paris is the capital of France. What is two plus two? Four.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
How much wood would a woodchuck chuck if a woodchuck could chuck wood?
The release pipeline converts the checkpoint, builds the engine, checks it against the reference,
measures its speed, asks a person for approval and then shifts traffic to it step by step.
If anything goes wrong, the traffic goes back to the old version and a report says why.
"""


def _config(arch: str):
    common = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 512,
              "initializer_range": 0.5, "rms_norm_eps": 1e-6, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
              "pad_token_id": PAD_ID, "tie_word_embeddings": False}
    if arch == "llama":
        return LlamaConfig(**common), LlamaForCausalLM
    if arch == "llama-tied":
        return LlamaConfig(**{**common, "tie_word_embeddings": True}), LlamaForCausalLM
    if arch == "llama3-rope":
        # original context 64 < positions used in tests, so all three llama3 frequency bands matter
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**common, rope_scaling=rope), LlamaForCausalLM
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=4096), MistralForCausalLM
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0), Qwen2ForCausalLM
    if arch == "qwen3":  # head_dim 32, not hidden_size / heads = 16: the q/k norms and projections sized by it
        return Qwen3Config(**common, head_dim=32, rope_theta=1000000.0), Qwen3ForCausalLM
    if arch == "phi3":  # packed qkv_proj / gate_up_proj in the checkpoint
        return Phi3Config(**common, original_max_position_embeddings=512), Phi3ForCausalLM
    if arch == "phi3-longrope":  # Phi-3.5's rope scaling; its original context (512 of 4096) the engine's limit
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.3, 0.8, 2.0, 1.1, 3.0, 1.5, 0.9],
                "long_factor": [4.0] * 8}
        return Phi3Config(**{**common, "max_position_embeddings": 4096}, original_max_position_embeddings=512,
                          rope_scaling=rope), Phi3ForCausalLM
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2), MixtralForCausalLM
    if arch == "qwen3-moe":
        # no renormalization of the top-k (Mixtral has it), and layer 1 dense (mlp_only_layers)
        return Qwen3MoeConfig(**common, head_dim=16, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=64, norm_topk_prob=False, mlp_only_layers=[1]), Qwen3MoeForCausalLM
    if arch == "mistral-window":
        return MistralConfig(**common, sliding_window=SLIDING_WINDOW), MistralForCausalLM
    if arch == "gemma3":  # local (windowed, own rope base) and global layers; attention scale not head_dim's
        layers = ["sliding_attention", "full_attention", "sliding_attention"]
        return Gemma3TextConfig(**{**common, "tie_word_embeddings": True, "num_hidden_layers": len(layers)},
                                head_dim=16, layer_types=layers, sliding_window=SLIDING_WINDOW,
                                query_pre_attn_scalar=24, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                hidden_activation="gelu_pytorch_tanh"), Gemma3ForCausalLM
    raise ValueError(f"arch={arch!r} is not one of {ARCHS}")


# each expert's tensors as the published checkpoints hold them, for transformers' stacked experts [E, ...]:
# Mixtral's `block_sparse_moe.experts.{e}.w1` (gate) / `w3` (up) / `w2` (down), Qwen3-MoE's `mlp.experts.{e}.*_proj`
HUB_EXPERTS = {MixtralForCausalLM: ("block_sparse_moe", "w1", "w3", "w2"),
               Qwen3MoeForCausalLM: ("mlp", "gate_proj", "up_proj", "down_proj")}


def hub_layout(state: dict[str, torch.Tensor], model_cls: type) -> dict[str, torch.Tensor]:
    """`state` with transformers' stacked experts split into the published checkpoints' per-expert tensors."""
    if model_cls not in HUB_EXPERTS:
        return state
    block, gate, up, down = HUB_EXPERTS[model_cls]
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        prefix, _, rest = name.partition(".mlp.")
        if rest == "experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{block}.experts.{e}.{gate}.weight"] = t[e, :inter].clone()
                out[f"{prefix}.{block}.experts.{e}.{up}.weight"] = t[e, inter:].clone()
        elif rest == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.{block}.experts.{e}.{down}.weight"] = t[e].clone()
        elif rest == "gate.weight":
            out[f"{prefix}.{block}.gate.weight"] = t
        else:
            out[name] = t
    return out


def make_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (vocab <= VOCAB_SIZE) on TEXT and save it as a PreTrainedTokenizerFast."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT.splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[0]} $A", pair=f"{SPECIAL_TOKENS[0]} $A {SPECIAL_TOKENS[0]} $B",
        special_tokens=[(SPECIAL_TOKENS[0], BOS_ID)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0],
                                   eos_token=SPECIAL_TOKENS[1], pad_token=SPECIAL_TOKENS[2])
    fast.save_pretrained(out_dir)
    return fast


def _save_weights(state: dict[str, torch.Tensor], out_dir: Path, shards: int) -> None:
    """Unsharded `model.safetensors`, or up to `shards` files split by byte offset, plus the HF index.

    A tensor goes to shard `offset * shards // total`; shards left empty (a big tensor spanning a
    boundary) are dropped, so tiny models may get fewer files than asked for.
    """
    if shards <= 1:
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in state.values())
    groups: list[list[str]] = [[] for _ in range(shards)]
    offset = 0
    for name, t in state.items():
        groups[offset * shards // total].append(name)
        offset += t.numel() * t.element_size()
    groups = [g for g in groups if g]
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: state[n] for n in group}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_tiny_model(out_dir: Path, *, arch: str = "llama", seed: int = 0, shards: int = 1) -> Path:
    """Write a tiny random HF checkpoint of `arch` (see ARCHS) with a tokenizer into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config, model_cls = _config(arch)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # a larger spread also for biases and norms, so every parameter matters in the comparison
    gen = torch.Generator().manual_seed(seed + 1)
    norm_center, embedding_factor = GEMMA_NORM_CENTER if arch == "gemma3" else (1.0, 1.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(norm_center + 0.2 * torch.randn(p.shape, generator=gen))
        model.get_input_embeddings().weight.mul_(embedding_factor)
    state = hub_layout({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, model_cls)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config.architectures = [model_cls.__name__]
    config.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    _save_weights(state, out_dir, shards)
    make_tokenizer(out_dir)
    return out_dir
