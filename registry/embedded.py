"""The embedded default: MLflow tracking + registry in sqlite and artifacts in local folders.

Everything lives under one state folder and works without any server (``MlflowClient`` talks to
the sqlite store directly). A person approves through ``mlflow ui`` started on the same database.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedLocations:
    """URIs of the embedded MLflow database, its run artifacts and the engine artifact store."""

    state_dir: Path
    tracking_uri: str
    mlflow_artifact_location: str
    artifacts_uri: str

    def ui_command(self, port: int = 5000) -> list[str]:
        """The command that serves the MLflow UI (for approvals) on this database, on loopback."""
        return [
            "mlflow", "ui",
            "--backend-store-uri", self.tracking_uri,
            "--default-artifact-root", self.mlflow_artifact_location,
            "--host", "127.0.0.1", "--port", str(port),
        ]


def embedded_locations(state_dir: Path) -> EmbeddedLocations:
    """``sqlite:///<state>/mlflow.db``, ``file://<state>/mlruns`` and ``file://<state>/artifacts`` (folders created)."""
    state = Path(state_dir).absolute()
    (state / "mlruns").mkdir(parents=True, exist_ok=True)
    (state / "artifacts").mkdir(parents=True, exist_ok=True)
    return EmbeddedLocations(
        state_dir=state,
        tracking_uri=f"sqlite:///{state / 'mlflow.db'}",
        mlflow_artifact_location=(state / "mlruns").as_uri(),
        artifacts_uri=(state / "artifacts").as_uri(),
    )
