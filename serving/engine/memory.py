"""How much device memory an engine takes once loaded, estimated from its folder and its limits.

weights (the bytes of its weight files) + the KV cache (keys and values for every layer and KV head, in the
engine's dtype, or one byte each for a paged cache of ``kv_cache_dtype`` fp8): for a static engine
``max_batch_size x max_seq_len`` tokens, the caches the runner allocates; for a paged engine (``engine.json``
has ``paged``) its pool: ``num_blocks`` blocks when the build fixed them (plus the one block the decode
graphs' padding rows write to), else (a pool sized at load from ``free_mem_fraction`` of the memory free after
the weights) the least memory that lets the load succeed: one sequence of ``max_seq_len`` must fit in that
fraction, so the estimate is that sequence's blocks divided by the fraction. What the runtime adds on top
(activations, CUDA graphs, the python stub) is the caller's margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STATIC_KV = "static, max_batch_size x max_seq_len"


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_cache_bytes: int
    kv_cache: str = STATIC_KV  # how the KV figure was reached, for the fit check's lines

    @property
    def paged(self) -> bool:
        return self.kv_cache != STATIC_KV

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
    if info.paged is not None:
        return MemoryEstimate(weights, *paged_pool_bytes(info))
    kv = kv_cache_bytes(n_layers=info.model.n_layers, n_kv_heads=info.model.n_kv_heads, head_dim=info.model.head_dim,
                        max_batch_size=info.limits.max_batch_size, max_seq_len=info.limits.max_seq_len,
                        dtype=info.limits.dtype)
    return MemoryEstimate(weights, kv)


def paged_pool_bytes(info) -> tuple[int, str]:
    """A paged engine's pool (``info``: its ``EngineInfo``) in bytes, and how it was reached (module doc)."""
    from serving.engine.paged_cache import blocks_for, kv_block_bytes, kv_element_bytes

    a, p = info.model, info.paged
    block = kv_block_bytes(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, block_size=p.block_size,
                           element_bytes=kv_element_bytes(p.kv_cache_dtype, DTYPE_BYTES[info.limits.dtype]))
    stored = ", K/V in fp8" if p.fp8 else ""
    if p.num_blocks is not None:
        return ((p.num_blocks + 1) * block,
                f"paged pool of {p.num_blocks} blocks of {p.block_size} (+1 for padding){stored}")
    least = blocks_for(info.limits.max_seq_len, p.block_size)
    how = (f"paged pool sized at load from {p.free_mem_fraction:.0%} of the free memory; at least {least} blocks "
           f"(one sequence of max_seq_len {info.limits.max_seq_len}){stored}")
    return int(least * block / p.free_mem_fraction), how
