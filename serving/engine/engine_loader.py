"""Load an engine folder the way it was built: paged when its `engine.json` records `paged`, else static.

`load_as_built(engine_dir, device=..., **options)` is what every consumer of a built engine calls (the
release gates, the Triton `llm` model's default `engine_loader`): a user who sets `engine.paged` in the
spec gets the paged KV cache everywhere the engine runs, not only where a loader is named by hand.
`options` are `load_engine`'s (`decode_attention`, `decode_gemm`; `cuda_graphs` for a static engine).

Imports: stdlib and torch only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.engine.build import read_engine_info
from serving.engine.paged_runner import PagedRunner, load_paged_engine
from serving.engine.runner import EngineRunner, load_engine


def is_paged(engine_dir: Path) -> bool:
    """Whether the engine in `engine_dir` was built with a paged KV cache (`engine.json` has `paged`)."""
    return read_engine_info(Path(engine_dir)).paged is not None


def load_as_built(engine_dir: Path, *, device: str = "auto", **options: Any) -> EngineRunner | PagedRunner:
    """`load_paged_engine` for an engine built with `paged` (its own settings), `load_engine` otherwise."""
    if is_paged(engine_dir):
        options.pop("cuda_graphs", None)  # the paged runner has no static-cache graphs to turn off
        return load_paged_engine(Path(engine_dir), device=device, **options)
    return load_engine(Path(engine_dir), device=device, **options)
