"""The engines a release's gates judge, each loaded once per release.

Validation, the fixed evaluation and the perf A/B all take the candidate's runner, and the last two
production's, from here: before, each gate loaded its own (the candidate three times, production twice),
and on a GPU every load compiles the decode step again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE


def load_gate_runner(engine_dir: Path) -> Any:
    """The engine in `engine_dir` loaded for the gates as it was built (its KV cache as engine.json records it), on
    its default device."""
    from serving.engine.runner import load_engine

    return load_engine(Path(engine_dir))


# cache_policy NONE: Prefect would otherwise hash the inputs of this task and of the gates it feeds, and a
# runner hashes by pickling its whole model.
@task(name="load-engine", retries=0, cache_policy=NONE)
def load_gate_runner_task(engine_dir: Path) -> Any:
    """Load one engine for the gates of this release (on a GPU this compiles its decode step)."""
    return load_gate_runner(engine_dir)
