"""Entry points of the scheduled and event-triggered deployments: they take a spec file path, so a
schedule or an event needs only that one parameter."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.release import release_flow
from flows.spec import load_spec


@flow(name="release-from-spec-file", log_prints=True)
def release_from_spec_file(spec_path: str, checkpoint: str | None = None):
    """Release the spec at `spec_path`; `checkpoint` (from a 'new checkpoint' event) overrides the source."""
    spec = load_spec(Path(spec_path))
    if checkpoint:
        spec = spec.model_copy(update={"source": spec.source.model_copy(update={"checkpoint": Path(checkpoint)})})
    return release_flow(spec)
