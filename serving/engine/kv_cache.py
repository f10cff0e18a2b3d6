"""A paged KV cache: fixed-size blocks shared by every sequence, a block allocator, sizing and its checks.

The cache of each layer is one pool of `num_blocks` blocks of `block_size` token positions each:
`k[layer]`, `v[layer]`: `[num_blocks, block_size, Hkv, hd]` (flash-attention's paged layout), so that
`pool.view(num_blocks * block_size, Hkv, hd)[slot]` is one token's keys, `slot = block * block_size +
offset`. A sequence owns a list of blocks (its block table): position p lives in block
`table[p // block_size]` at offset `p % block_size`. Blocks are taken from the allocator as a sequence
grows and given back when it finishes (or is preempted), so a 128-token request holds
`ceil(128 / block_size)` blocks, not room for `max_seq_len`.

Sizing (`KVCacheConfig`): an explicit `num_blocks`; or a fraction of the device memory that is free once
the weights are loaded (TensorRT-LLM's `kv_cache_free_gpu_mem_fraction`; CUDA only: the CPU has no such
figure); by default room for `max_batch_size` sequences of `max_seq_len` (the memory a static cache at the
engine's limits took), so admission never waits for blocks. `check_kv_cache_config` refuses impossible combinations with
the numbers: a pool smaller than one sequence of `max_seq_len`, a step budget (`max_num_tokens`) smaller
than one block, and so on.

KV cache dtype (`KVCacheConfig.kv_cache_dtype`): "auto" stores K/V in the model's dtype; "fp8" stores them as
float8_e4m3fn (TensorRT-LLM's and vLLM's `kv_cache_dtype=fp8`), half the bytes of bf16: the pool holds twice
the blocks and a decode step reads half the bytes. Values are divided by one per-tensor scale
(`KV_FP8_SCALE`, 1.0: vLLM's default for an uncalibrated fp8 KV cache, where K/V of these models lie well
inside e4m3's range), clamped to +-448 (`KV_FP8_MAX`: e4m3fn has no infinity, and a cast of an
out-of-range value is not guaranteed to saturate) and rounded to nearest. Readers dequantize: `gather_tables`
returns the model's dtype, the attention and rotation kernels convert in registers. A calibrated scale
(per layer, from K/V statistics) would replace the constant and be passed to `write`/`gather_tables` and to the
kernels (folded into the softmax scale for K and into the output for V); with 1.0 they skip the multiply.
fp8 storage needs e4m3 conversions on a GPU (compute capability 8.9 or later, `check_kv_cache_device`);
the CPU casts through torch.

Imports: stdlib, torch and `serving.engine.quantize`'s constants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from serving.engine.errors import EngineLimitError
from serving.engine.quantize import require_e4m3

DEFAULT_BLOCK_SIZE = 32
AUTO, FP8 = "auto", "fp8"
KV_CACHE_DTYPES = (AUTO, FP8)  # kv_cache.kv_cache_dtype: the model's dtype, or float8_e4m3fn storage
KV_FP8_DTYPE = torch.float8_e4m3fn
KV_FP8_MAX = torch.finfo(KV_FP8_DTYPE).max  # 448.0: stored values are clamped to +-this before the cast
KV_FP8_SCALE = 1.0  # per-tensor: stored = x / scale (uncalibrated, as vLLM's default); see the module doc


@dataclass(frozen=True)
class KVCacheConfig:
    """How the engine sizes its KV cache and its steps (resolved once; recorded in engine.json by the build as
    `kv_cache`). Live requests are capped by the engine's `limits.max_batch_size`."""

    block_size: int = DEFAULT_BLOCK_SIZE  # token positions per block
    num_blocks: int | None = None  # explicit pool size; None: free_mem_fraction, or room for the limits
    free_mem_fraction: float | None = None  # of the device memory free after the weights (CUDA), when num_blocks is None
    max_num_tokens: int = 8192  # tokens (prefill chunks + decodes) one step computes at most
    max_waiting: int | None = None  # served requests waiting for admission at most (more: refused); None: no limit
    kv_cache_dtype: str = AUTO  # one of KV_CACHE_DTYPES: "auto" (the model's dtype) or "fp8" (e4m3 storage)
    prefix_caching: bool = False  # full blocks of computed K/V shared by prompts that start alike (prefix_cache)

    def to_dict(self) -> dict[str, Any]:
        """The settings for engine.json's `kv_cache`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, setting: str = "kv_cache") -> KVCacheConfig:
        """Read engine.json's `kv_cache` (or an earlier release's `paged`, the same settings where a missing
        `kv_cache_dtype` is "auto"); unknown keys and values refused, naming `setting`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown {setting} settings {unknown} (known: {sorted(names)})")
        config = cls(**d)
        check_kv_cache_dtype(config.kv_cache_dtype)
        if not isinstance(config.prefix_caching, bool):
            raise TypeError(f"{setting}.prefix_caching={config.prefix_caching!r} must be true or false")
        return config

    @property
    def fp8(self) -> bool:
        """Whether K/V are stored as float8_e4m3fn."""
        return self.kv_cache_dtype == FP8


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Refuse, naming the value and the setting, a KV cache dtype that is not one of KV_CACHE_DTYPES."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise EngineLimitError(f"kv_cache.kv_cache_dtype={kv_cache_dtype!r} is not supported; choose one of "
                               f"{list(KV_CACHE_DTYPES)} ('auto': the model's dtype, 'fp8': float8_e4m3fn)")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pools hold for `kv_cache_dtype` in an engine of `model_dtype`."""
    check_kv_cache_dtype(kv_cache_dtype)
    return KV_FP8_DTYPE if kv_cache_dtype == FP8 else model_dtype


def kv_element_bytes(kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """Bytes of one stored K or V element: 1 for fp8, else the model dtype's (`kv_block_bytes`' element_bytes)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return KV_FP8_DTYPE.itemsize if kv_cache_dtype == FP8 else model_dtype_bytes


def check_kv_cache_device(kv_cache_dtype: str, device: torch.device | str, *, where: str) -> None:
    """Refuse, naming the setting and the device, an fp8 KV cache on a CUDA GPU below compute capability 8.9
    (no e4m3 conversions: the kernels could not read or write the pools). The CPU casts through torch."""
    if kv_cache_dtype == FP8:
        require_e4m3(device, where=where, setting="kv_cache.kv_cache_dtype", instead="kv_cache.kv_cache_dtype='auto'")


def to_kv_fp8(x: torch.Tensor) -> torch.Tensor:
    """K or V in e4m3 as the pools store them: divided by KV_FP8_SCALE, clamped to +-KV_FP8_MAX (never NaN
    for a finite value), rounded to nearest."""
    if KV_FP8_SCALE != 1.0:
        x = x / KV_FP8_SCALE
    return x.clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE)


def from_kv_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3 K or V back in `dtype` (times KV_FP8_SCALE)."""
    x = x.to(dtype)
    return x * KV_FP8_SCALE if KV_FP8_SCALE != 1.0 else x


def kv_block_bytes(*, n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, element_bytes: int) -> int:
    """Keys + values of every layer for one block of `block_size` positions."""
    return 2 * n_layers * n_kv_heads * head_dim * block_size * element_bytes


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


def blocks_from_memory(free_bytes: int, fraction: float, block_bytes: int) -> int:
    """Blocks that fit in `fraction` of `free_bytes`."""
    return int(free_bytes * fraction) // block_bytes


def static_pool_blocks(block_size: int, *, max_batch_size: int, max_seq_len: int) -> int:
    """Blocks for `max_batch_size` sequences of `max_seq_len` positions: the room of a static cache at the
    engine's limits, so that admission never waits for blocks."""
    return max_batch_size * blocks_for(max_seq_len, block_size)


def check_kv_cache_config(config: KVCacheConfig, *, max_seq_len: int, max_batch_size: int, block_bytes: int,
                          num_blocks: int | None = None) -> None:
    """Raise EngineLimitError naming the values when the KV cache cannot serve the engine's limits
    (`num_blocks`: the pool's size, when known; the build knows it only when it is explicit)."""
    if config.block_size < 1:
        raise EngineLimitError(f"kv_cache.block_size={config.block_size} must be >= 1")
    if config.max_num_tokens < config.block_size:
        raise EngineLimitError(f"kv_cache.max_num_tokens={config.max_num_tokens} is smaller than one block "
                               f"(kv_cache.block_size={config.block_size}); raise max_num_tokens")
    if config.max_num_tokens < max_batch_size:
        raise EngineLimitError(f"kv_cache.max_num_tokens={config.max_num_tokens} < limits.max_batch_size="
                               f"{max_batch_size}: a step could not give every live request its decode token")
    if config.free_mem_fraction is not None and not 0.0 < config.free_mem_fraction <= 1.0:
        raise EngineLimitError(f"kv_cache.free_mem_fraction={config.free_mem_fraction} must be in (0, 1]")
    if config.max_waiting is not None and config.max_waiting < 1:
        raise EngineLimitError(f"kv_cache.max_waiting={config.max_waiting} must be >= 1 (or unset: no limit)")
    if config.num_blocks is not None and config.num_blocks < 1:
        raise EngineLimitError(f"kv_cache.num_blocks={config.num_blocks} must be >= 1")
    check_kv_cache_dtype(config.kv_cache_dtype)
    num_blocks = config.num_blocks if num_blocks is None else num_blocks
    need = blocks_for(max_seq_len, config.block_size)
    if num_blocks is not None and num_blocks < need:
        raise EngineLimitError(
            f"the KV cache has {num_blocks} blocks of {config.block_size} positions "
            f"({num_blocks * block_bytes / 2**20:.1f} MiB) but one sequence of limits.max_seq_len={max_seq_len} "
            f"needs {need} blocks ({need * block_bytes / 2**20:.1f} MiB): raise kv_cache.num_blocks / "
            f"kv_cache.free_mem_fraction or lower max_seq_len")


def resolve_num_blocks(config: KVCacheConfig, device: torch.device, block_bytes: int, *, max_batch_size: int,
                       max_seq_len: int) -> int:
    """The pool size: `config.num_blocks`; else `free_mem_fraction` of the free CUDA memory; else the room of
    `max_batch_size` sequences of `max_seq_len` (`static_pool_blocks`)."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.free_mem_fraction is None:
        return static_pool_blocks(config.block_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    if device.type != "cuda":
        raise EngineLimitError(f"kv_cache.free_mem_fraction={config.free_mem_fraction} sizes the cache from CUDA's "
                               f"free memory, which device {device} does not have: set kv_cache.num_blocks, or "
                               "leave both unset for room for the engine's limits")
    free, _total = torch.cuda.mem_get_info(device)
    return blocks_from_memory(free, config.free_mem_fraction, block_bytes)


class BlockAllocator:
    """Free block ids of one pool, taken and given back in whole lists. Not thread-safe (the scheduler
    thread owns it)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest ids first
        self._taken = [False] * num_blocks

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def take(self, n: int) -> list[int] | None:
        """`n` blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._taken[b] = True
        return out

    def give_back(self, blocks: list[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks or not self._taken[b]:
                raise ValueError(f"block {b} is not taken (pool of {self.num_blocks}); a double free")
            self._taken[b] = False
            self._free.append(b)


class PagedKVCache:
    """The block pools of every layer, on one device: K/V computed in `dtype` (the model's), stored in
    `kv_storage_dtype(kv_cache_dtype, dtype)` (fp8: see the module doc)."""

    def __init__(self, *, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = AUTO) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype  # what `gather_tables` returns and the attention computes in
        self.fp8 = kv_cache_dtype == FP8
        storage = kv_storage_dtype(kv_cache_dtype, dtype)
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=storage, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=storage, device=device) for _ in range(n_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys/values of T tokens ([T, Hkv, hd]) into their `slots` ([T], block * block_size + offset);
        clamped and rounded to e4m3 (`to_kv_fp8`) for fp8 pools."""
        kp, vp = self.k[layer], self.v[layer]
        if self.fp8:
            k, v = to_kv_fp8(k), to_kv_fp8(v)
        kp.view(-1, *kp.shape[2:])[slots] = k
        vp.view(-1, *vp.shape[2:])[slots] = v

    def gather_tables(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position of the blocks of m block tables ([m, W] long) -> keys, values [m, Hkv, W * block_size,
        hd] (a copy, in the compute dtype: fp8 pools dequantized)."""
        m, width = tables.shape
        kp, vp = self.k[layer], self.v[layer]
        keys = kp[tables].reshape(m, width * self.block_size, *kp.shape[2:]).transpose(1, 2)
        values = vp[tables].reshape(m, width * self.block_size, *vp.shape[2:]).transpose(1, 2)
        if self.fp8:
            keys, values = from_kv_fp8(keys, self.dtype), from_kv_fp8(values, self.dtype)
        return keys, values


def cache_bytes(cache: PagedKVCache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.k + cache.v)


def describe(num_blocks: int, block_size: int, block_bytes: int, kv_cache_dtype: str = AUTO) -> str:
    """One line of a pool's size: blocks, tokens, GiB (and "fp8 e4m3" when K/V are stored so)."""
    stored = ", K/V in fp8 e4m3" if kv_cache_dtype == FP8 else ""
    return (f"{num_blocks} blocks x {block_size} positions = {num_blocks * block_size} tokens, "
            f"{num_blocks * block_bytes / 2**30:.2f} GiB{stored}")

