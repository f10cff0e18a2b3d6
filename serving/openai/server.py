"""Run the OpenAI-compatible front with uvicorn on loopback by default."""

from __future__ import annotations

from serving.openai.app import create_app
from serving.openai.backend import TritonBackend
from serving.openai.limits import FrontLimits

# How long an idle client connection stays open. Longer than the idle expiry of the clients that pool connections
# (httpx and the OpenAI SDK: 5 s, uvicorn's own default, so a reused connection raced the server's close and the
# request failed with a read error) and of load balancers in front (an AWS ALB's 60 s).
KEEP_ALIVE_S = 75


def run_server(*, grpc_url: str, models: list[str], host: str = "127.0.0.1", port: int = 8080,
               timeout_s: float = 60.0, limits: FrontLimits | None = None) -> None:
    import uvicorn

    app = create_app(TritonBackend(grpc_url, timeout_s=timeout_s), models, limits)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
                timeout_keep_alive=KEEP_ALIVE_S)
