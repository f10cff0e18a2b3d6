"""One way to get an MlflowClient: from a client or an explicit tracking URI (no global state)."""

from __future__ import annotations

from mlflow import MlflowClient

ClientOrUri = MlflowClient | str


def mlflow_client(client_or_uri: ClientOrUri) -> MlflowClient:
    """The client itself, or a new client for the tracking URI (the registry URI is the same)."""
    if isinstance(client_or_uri, MlflowClient):
        return client_or_uri
    return MlflowClient(tracking_uri=client_or_uri, registry_uri=client_or_uri)


def error_code(exc: Exception) -> str | None:
    """The MLflow error code of an MlflowException (e.g. 'RESOURCE_DOES_NOT_EXIST'), else None."""
    return getattr(exc, "error_code", None)
