"""How much device memory an engine takes once loaded, estimated from its folder and its limits.

weights (the bytes of its weight files) + a KV cache of ``max_batch_size x max_seq_len`` tokens (keys and
values for every layer and KV head, in the engine's dtype): the static caches the runner allocates. What
the runtime adds on top (activations, CUDA graphs, the python stub) is the caller's margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


def kv_cache_bytes(*, n_layers: int, n_kv_heads: int, head_dim: int, max_batch_size: int, max_seq_len: int,
                   dtype: str) -> int:
    """Keys + values of every layer for ``max_batch_size`` sequences of ``max_seq_len`` tokens."""
    return 2 * n_layers * n_kv_heads * head_dim * max_batch_size * max_seq_len * DTYPE_BYTES[dtype]


def estimate_engine_memory(engine_dir: Path) -> MemoryEstimate:
    """The memory estimate of the ``torch`` engine in ``engine_dir`` (its ``engine.json`` and weight files)."""
    from serving.engine.build import read_engine_info

    info = read_engine_info(engine_dir)
    weights = sum((Path(engine_dir) / name).stat().st_size for name in info.weight_files)
    kv = kv_cache_bytes(n_layers=info.model.n_layers, n_kv_heads=info.model.n_kv_heads, head_dim=info.model.head_dim,
                        max_batch_size=info.limits.max_batch_size, max_seq_len=info.limits.max_seq_len,
                        dtype=info.limits.dtype)
    return MemoryEstimate(weights, kv)
