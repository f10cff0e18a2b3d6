"""Load an engine folder the way it was built: paged when its `engine.json` records `paged`, else static.

`load_as_built(engine_dir, device=..., **options)` is what every consumer of a built engine calls (the
release gates, the Triton `llm` model's default `engine_loader`): a user who sets `engine.paged` in the
spec gets the paged KV cache everywhere the engine runs, not only where a loader is named by hand.
`overrides` are `EngineOptions` fields for this load (`options.resolve_options`: the `llm` model's
`decode_gemm` and `decode_attention` parameters among them), `cuda_graphs` a static engine's, and
`prefix_caching` a paged engine's (overriding its build's setting for this load).

Imports: stdlib and torch only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serving.engine.build import read_engine_info
from serving.engine.errors import EngineLimitError
from serving.engine.paged_runner import PagedRunner, load_paged_engine
from serving.engine.runner import EngineRunner, load_engine


def is_paged(engine_dir: Path) -> bool:
    """Whether the engine in `engine_dir` was built with a paged KV cache (`engine.json` has `paged`)."""
    return read_engine_info(Path(engine_dir)).paged is not None


def load_as_built(engine_dir: Path, *, device: str = "auto", prefix_caching: bool | None = None,
                  overrides: Mapping[str, Any] | None = None, cuda_graphs: bool = True) -> EngineRunner | PagedRunner:
    """`load_paged_engine` for an engine built with `paged` (its own settings; `prefix_caching` None keeps its
    own, True / False overrides it), `load_engine` otherwise (where `prefix_caching` True is refused: a static
    cache has no blocks to share)."""
    if is_paged(engine_dir):  # (no static-cache graphs to turn off)
        return load_paged_engine(Path(engine_dir), device=device, prefix_caching=prefix_caching, overrides=overrides)
    if prefix_caching:
        raise EngineLimitError(f"prefix_caching needs an engine built with a paged KV cache (engine.paged); "
                               f"{Path(engine_dir)} has a static one")
    return load_engine(Path(engine_dir), device=device, cuda_graphs=cuda_graphs, overrides=overrides)
