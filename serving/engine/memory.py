"""How much device memory an engine takes once loaded, estimated from its folder and its limits.

weights (the bytes of its weight files) + the KV cache's pool (keys and values for every layer and KV head, in
the engine's dtype, or one byte each for ``kv_cache_dtype`` fp8): ``num_blocks`` blocks when the build fixed
them, by default the blocks of ``max_batch_size`` sequences of ``max_seq_len`` (plus, in both cases, the one
block the decode graphs' padding rows write to); a pool sized at load from ``free_mem_fraction`` of the memory
free after the weights is estimated as the least memory that lets the load succeed: one sequence of
``max_seq_len`` must fit in that fraction, so the estimate is that sequence's blocks divided by the fraction.
What the runtime adds on top (activations, CUDA graphs, the python stub) is the caller's margin.

An engine of ``tensor_parallel`` N runs on N devices, each rank holding 1/N of both figures (its heads, its MLP
columns, its vocabulary rows, its KV heads; the norms, whole on every rank, are a rounding): ``per_rank_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_cache_bytes: int
    kv_cache: str  # how the KV figure was reached, for the fit check's lines
    ranks: int = 1  # devices (GPUs) the engine runs on: its tensor_parallel

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes

    @property
    def per_rank_bytes(self) -> int:
        """What each of the `ranks` devices holds (module doc)."""
        return -(-self.total_bytes // self.ranks)


def kv_cache_bytes(*, n_layers: int, n_kv_heads: int, head_dim: int, max_batch_size: int, max_seq_len: int,
                   dtype: str) -> int:
    """Keys + values of every layer for ``max_batch_size`` sequences of ``max_seq_len`` tokens."""
    return 2 * n_layers * n_kv_heads * head_dim * max_batch_size * max_seq_len * DTYPE_BYTES[dtype]


def estimate_engine_memory(engine_dir: Path) -> MemoryEstimate:
    """The memory estimate of the ``torch`` engine in ``engine_dir`` (its ``engine.json`` and weight files)."""
    from serving.engine.build import read_engine_info

    info = read_engine_info(engine_dir)
    weights = sum((Path(engine_dir) / name).stat().st_size for name in info.weight_files)
    return MemoryEstimate(weights, *pool_bytes(info), ranks=info.tensor_parallel)


def pool_bytes(info) -> tuple[int, str]:
    """An engine's KV-cache pool (``info``: its ``EngineInfo``) in bytes, and how it was reached (module doc)."""
    from serving.engine.kv_cache import blocks_for, kv_block_bytes, kv_element_bytes, static_pool_blocks

    a, p, lim = info.model, info.kv_cache, info.limits
    block = kv_block_bytes(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, block_size=p.block_size,
                           element_bytes=kv_element_bytes(p.kv_cache_dtype, DTYPE_BYTES[lim.dtype]))
    stored = ", K/V in fp8" if p.fp8 else ""
    if p.num_blocks is None and p.free_mem_fraction is not None:
        least = blocks_for(lim.max_seq_len, p.block_size)
        how = (f"pool sized at load from {p.free_mem_fraction:.0%} of the free memory; at least {least} blocks "
               f"(one sequence of max_seq_len {lim.max_seq_len}){stored}")
        return int(least * block / p.free_mem_fraction), how
    if p.num_blocks is not None:
        return (p.num_blocks + 1) * block, f"pool of {p.num_blocks} blocks of {p.block_size} (+1 for padding){stored}"
    blocks = static_pool_blocks(p.block_size, max_batch_size=lim.max_batch_size, max_seq_len=lim.max_seq_len)
    how = f"pool of {blocks} blocks of {p.block_size} (+1 for padding): max_batch_size x max_seq_len{stored}"
    return (blocks + 1) * block, how
