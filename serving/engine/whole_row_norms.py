"""Inductor's row reductions in one pass over the row (persistent), for the decode step's norms.

Inductor loops over a reduction of more than 1,024 elements (`InductorChoices.should_use_persistent_reduction`):
the decode step's residual add + RMSNorm over Llama's 2,048 or 4,096 hidden columns then walks each row
in a loop to sum its squares, and in a second loop again to scale it. A persistent reduction holds the
row in registers and makes one pass. `whole_row_reductions()` is a context for compiling the step with
that choice for rows of up to 2,048 columns at any batch, and of up to 4,096 at batch 1; its kernels are
named `triton_per_...` where inductor's own are `triton_red_...`.

On an H200 (`bench profile`, the shipped step with and without it alternated in one process, twice each):
Llama-1B batch 64 1.037-1.039 against 1.076 ms, batch 1 0.865-0.866 against 0.881 ms; Llama-8B batch 1
4.115-4.117 against 4.145-4.148 ms. At Llama-8B batch 64 the 4,096-column rows were slower persistent,
4.806-4.807 against 4.787-4.791 ms, so rows that wide stay looped there.

The choice is not part of inductor's cache keys by itself: a step compiled under it must not share FX
graph cache entries with one compiled without it. `compile_options` puts it in the key, as a no-op
post-grad pass whose `uuid` (which inductor hashes into every FX graph and AOTAutograd cache key) names
the choice and this file's content, so the step stays cacheable (`serving.engine.compile_cache`).

Imports: torch only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch._inductor import config
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.ir import ReductionHint
from torch._inductor.virtualized import V

MAX_COLUMNS = 2048  # persistent at any batch
MAX_COLUMNS_ONE_ROW = 4096  # persistent when the kernel reduces a single row


class WholeRowChoices(InductorChoices):
    """Inductor's choices, with inner reductions over rows of up to MAX_COLUMNS (one row: MAX_COLUMNS_ONE_ROW)
    elements persistent."""

    @staticmethod
    def should_use_persistent_reduction(features: Any, cooperative_reduction: bool) -> bool:
        if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
            return True
        if (not config.triton.persistent_reductions or cooperative_reduction
                or features.get_reduction_hint() != ReductionHint.INNER):
            return False
        sizes = V.graph.sizevars
        one_row = sizes.statically_known_equals(features.numel, 1)  # numel: the rows, without the columns
        return sizes.statically_known_leq(features.reduction_numel, MAX_COLUMNS_ONE_ROW if one_row else MAX_COLUMNS)


@contextlib.contextmanager
def whole_row_reductions(enabled: bool = True) -> Iterator[None]:
    """Inductor compiles with `WholeRowChoices` inside this context (on this thread), else as it would."""
    if not enabled:
        yield
        return
    with V.set_choices_handler(WholeRowChoices()):
        yield


class WholeRowCacheKey(CustomGraphPass):
    """A post-grad pass that changes nothing: its `uuid` puts `WholeRowChoices` into inductor's cache keys."""

    def __call__(self, graph: Any) -> None:
        return None

    def uuid(self) -> str:
        return f"whole-row-norms:{MAX_COLUMNS}:{MAX_COLUMNS_ONE_ROW}:{get_hash_for_files((__file__,)).hex()}"


def compile_options(enabled: bool) -> dict[str, Any]:
    """Inductor settings for a compile under `whole_row_reductions(enabled)`: the choice in the cache keys."""
    return {"post_grad_custom_post_pass": WholeRowCacheKey()} if enabled else {}
