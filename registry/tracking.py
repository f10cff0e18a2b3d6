"""Thin functions over ``MlflowClient`` for the release run: params, metrics, artifacts, status.

No global MLflow state: every function takes a client or an explicit tracking URI.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException

from registry._client import ClientOrUri, error_code, mlflow_client
from registry.errors import RegistryError

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value

# MLflow 3.x lists the runs of an experiment without this tag under GenAI "Evaluation runs"; release runs
# are model development, shown with their params, metrics and artifacts.
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# Run tags the UI reads: "Created by" (user), the source (a job, its name) and the git commit.
TAG_RUN_USER = "mlflow.user"
TAG_SOURCE_NAME = "mlflow.source.name"
TAG_SOURCE_TYPE = "mlflow.source.type"
TAG_SOURCE_COMMIT = "mlflow.source.git.commit"


def default_artifact_location(tracking_uri: str) -> str | None:
    """``file://<folder of the db>/mlruns`` for a ``sqlite:///`` file URI, else None (the server decides).

    Without it MLflow would put run artifacts in ``./mlruns`` of whatever the current directory is.
    """
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix) or ":memory:" in tracking_uri:
        return None
    db_path = Path(tracking_uri[len(prefix):].split("?", 1)[0])
    if not db_path.is_absolute():
        db_path = db_path.absolute()
    return (db_path.parent / "mlruns").as_uri()


def get_or_create_experiment(client_or_uri: ClientOrUri, name: str, *, artifact_location: str | None = None) -> str:
    """The id of experiment ``name``, created when missing.

    ``artifact_location`` defaults to :func:`default_artifact_location` of the tracking URI.
    """
    client = mlflow_client(client_or_uri)
    found = client.get_experiment_by_name(name)
    if found is not None:
        if TAG_EXPERIMENT_KIND not in (found.tags or {}):
            client.set_experiment_tag(found.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
        return found.experiment_id
    if artifact_location is None:
        artifact_location = default_artifact_location(client.tracking_uri)
    try:
        return client.create_experiment(name, artifact_location=artifact_location,
                                        tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND})
    except MlflowException as e:
        if error_code(e) != "RESOURCE_ALREADY_EXISTS":
            raise
        found = client.get_experiment_by_name(name)  # created concurrently
        assert found is not None
        return found.experiment_id


def run_metrics(client_or_uri: ClientOrUri, run_id: str) -> dict[str, float]:
    """The latest value of each metric of a run."""
    return dict(mlflow_client(client_or_uri).get_run(run_id).data.metrics)


def experiment_id_of_run(client_or_uri: ClientOrUri, run_id: str) -> str:
    return mlflow_client(client_or_uri).get_run(run_id).info.experiment_id


def start_release_run(
    tracking_uri: ClientOrUri,
    experiment: str,
    *,
    run_name: str,
    params: Mapping[str, Any],
    tags: Mapping[str, str],
    artifact_location: str | None = None,
) -> str:
    """Create a run in ``experiment`` with params and tags; return its run id."""
    client = mlflow_client(tracking_uri)
    experiment_id = get_or_create_experiment(client, experiment, artifact_location=artifact_location)
    run = client.create_run(experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()})
    log_params(client, run.info.run_id, params)
    return run.info.run_id


def log_params(client_or_uri: ClientOrUri, run_id: str, params: Mapping[str, Any]) -> None:
    """Log params (values stringified; refused if longer than MLflow's 6000 characters)."""
    items = []
    for key, value in params.items():
        text = str(value)
        if len(text) > MAX_PARAM_CHARS:
            raise RegistryError(
                f"Param '{key}' of run {run_id} is {len(text)} characters, over MLflow's {MAX_PARAM_CHARS}: "
                "log it as an artifact instead."
            )
        items.append(Param(key, text))
    for start in range(0, len(items), 100):  # log_batch accepts at most 100 params per call
        mlflow_client(client_or_uri).log_batch(run_id, params=items[start : start + 100])


def set_run_tags(client_or_uri: ClientOrUri, run_id: str, tags: Mapping[str, str]) -> None:
    """Set run tags."""
    mlflow_client(client_or_uri).log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_metrics(
    client_or_uri: ClientOrUri, run_id: str, metrics: Mapping[str, float], *, step: int = 0
) -> None:
    """Log metric values at ``step`` with the current timestamp."""
    now = int(time.time() * 1000)
    items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    for start in range(0, len(items), 1000):
        mlflow_client(client_or_uri).log_batch(run_id, metrics=items[start : start + 1000])


def log_artifact_file(
    client_or_uri: ClientOrUri, run_id: str, path: Path, *, artifact_path: str | None = None
) -> None:
    """Upload one local file into the run's artifacts (under ``artifact_path`` if given)."""
    if not Path(path).is_file():
        raise RegistryError(f"Cannot log artifact '{path}' to run {run_id}: not a file.")
    mlflow_client(client_or_uri).log_artifact(run_id, str(path), artifact_path=artifact_path)


def log_text(client_or_uri: ClientOrUri, run_id: str, text: str, artifact_file: str) -> None:
    """Write ``text`` as the run artifact ``artifact_file`` (e.g. ``reports/validation.md``)."""
    mlflow_client(client_or_uri).log_text(run_id, text, artifact_file)


def log_artifact_dir(
    client_or_uri: ClientOrUri, run_id: str, path: Path, *, artifact_path: str | None = None
) -> None:
    """Upload a local folder's contents into the run's artifacts (under ``artifact_path`` if given)."""
    if not Path(path).is_dir():
        raise RegistryError(f"Cannot log artifact folder '{path}' to run {run_id}: not a directory.")
    mlflow_client(client_or_uri).log_artifacts(run_id, str(path), artifact_path=artifact_path)


def end_run(client_or_uri: ClientOrUri, run_id: str, status: str = "FINISHED") -> None:
    """Mark the run terminated with ``status`` (FINISHED, FAILED or KILLED)."""
    allowed = ("FINISHED", "FAILED", "KILLED")
    if status not in allowed:
        raise RegistryError(f"Invalid run status '{status}' for run {run_id}: expected one of {allowed}.")
    mlflow_client(client_or_uri).set_terminated(run_id, status=RunStatus.to_string(RunStatus.from_string(status)))
