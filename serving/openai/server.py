"""Run the OpenAI-compatible front with uvicorn on loopback by default."""

from __future__ import annotations

from serving.openai.app import create_app
from serving.openai.backend import TritonBackend
from serving.openai.limits import FrontLimits


def run_server(*, grpc_url: str, models: list[str], host: str = "127.0.0.1", port: int = 8080,
               timeout_s: float = 60.0, limits: FrontLimits | None = None) -> None:
    import uvicorn

    app = create_app(TritonBackend(grpc_url, timeout_s=timeout_s), models, limits)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
