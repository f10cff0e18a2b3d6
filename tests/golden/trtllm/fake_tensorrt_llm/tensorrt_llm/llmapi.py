"""Fake ``tensorrt_llm.llmapi`` (see the package docstring)."""

from __future__ import annotations

from typing import Any

from tensorrt_llm import CALLS

KV_CACHE_SIGNATURE = frozenset({"free_gpu_memory_fraction", "enable_block_reuse", "dtype", "max_tokens",
                                "host_cache_size"})


class KvCacheConfig:
    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - KV_CACHE_SIGNATURE)
        if unknown:
            raise TypeError(f"KvCacheConfig() got unexpected keyword arguments {unknown}")
        CALLS.append(("KvCacheConfig", dict(kwargs)))
        self.__dict__.update(kwargs)
