"""Random-weight models of real shapes for the benchmark: an HF model of the shape's architecture and the
engine's model (its family's class in `models.registry`) holding the SAME weights (HF q/k/v and gate/up fused
through the conversion table).

No downloads: the shapes are the published `config.json` values (Llama-3.2-1B, Llama-3.1-8B, Qwen3-8B, Gemma-3-12B, Llama-3.3-70B).
transformers is imported lazily (only the benchmark needs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from serving.engine.build import EngineInfo, EngineLimits
from serving.engine.convert import map_hf_name
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.linears import apply_options
from serving.engine.model import ModelArgs
from serving.engine.models.registry import model_args_of, registered
from serving.engine.options import resolve_options
from serving.engine.runner import EngineRunner

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True,
        "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # google/gemma-3-12b-it's text_config: 5 sliding-window layers (1,024 positions, rope base 10,000) to each
    # global one (rope base 1e6, linear scaling 8)
    "gemma-3-12b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072, "sliding_window": 1024, "sliding_window_pattern": 6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
    },
    # Llama-3.3-70B-Instruct's config.json (issue 52's TensorRT-LLM comparison): random FP8 weights only
    # (bench.tensor_parallel.fp8_random_model), its bf16 weights would not fit one H200
    "llama-3.3-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001,
    },
    # a few-MB shape for CPU tests of the harness itself
    "tiny": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 1,
    },
}


def model_args(shape: str) -> ModelArgs:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    return model_args_of(SHAPES[shape], source=f"shape {shape}")


def engine_model(args: ModelArgs) -> torch.nn.Module:
    """The engine's model of `args` (its family's class), on the current default device."""
    return registered(args.architecture).model_class(args)


def random_hf_model(shape: str, *, dtype: torch.dtype, device: str, seed: int = 0) -> Any:
    """An HF model of `shape`'s architecture with random weights (normal, std 0.02), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    cfg = {k: v for k, v in SHAPES[shape].items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(SHAPES[shape]["model_type"], **cfg)
    with torch.device(device):
        model = getattr(transformers, SHAPES[shape]["architectures"][0])(config).to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def engine_state_from_hf(hf_state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF state dict -> engine tensors (fused wqkv / w13) through the conversion table."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    n_parts: dict[str, int] = {}
    for name, tensor in hf_state.items():
        mapped = map_hf_name(name, args)
        if mapped is None:
            continue
        target, part, n = mapped
        parts.setdefault(target, {})[part] = tensor
        n_parts[target] = n
    return {t: p[0] if n_parts[t] == 1 else torch.cat([p[i] for i in range(n_parts[t])], dim=0)
            for t, p in parts.items()}


def runner_from_hf(hf_model: Any, args: ModelArgs, limits: EngineLimits, *, cuda_graphs: bool = True,
                   ) -> EngineRunner:
    """An EngineRunner over the weights of `hf_model` (fused copies; norms and embeddings shared), its KV pool
    room for `limits.max_batch_size` sequences of `limits.max_seq_len` (the engine's default sizing)."""
    state = engine_state_from_hf(hf_model.state_dict(), args)
    device = hf_model.device
    with torch.device("meta"):
        model = engine_model(args)
    model.load_state_dict(state, strict=True, assign=True)
    model = model.eval().requires_grad_(False)
    config = KVCacheConfig()
    info = EngineInfo(fingerprint="random-weights", toolchain={}, limits=limits, model=args, path=Path("."),
                      kv_cache=config)
    apply_options(model, resolve_options(torch.device(device), info))
    return EngineRunner(info, model, torch.device(device), config, cuda_graphs=cuda_graphs)


def weight_bytes(args: ModelArgs, dtype: torch.dtype) -> int:
    """Bytes of every weight (the embedding table counted once when tied), as the issue's roofline."""
    with torch.device("meta"):
        model = engine_model(args)
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
