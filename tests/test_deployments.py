"""`enginewright deploy` against a real Prefect server started here: deployments with schedules and
triggers, and the approval / new-checkpoint events start flow runs with the right parameters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from serving.triton.process import free_port

pytestmark = pytest.mark.slow


class PrefectServer:
    """`prefect server start` on one port and home; `stop` and `start` again keep both (and its database)."""

    def __init__(self, home, port: int) -> None:
        self.home, self.port = home, port
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_SERVER_UI_API_URL": self.api, "PREFECT_API_URL": self.api}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.home / "server.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                          "--port", str(self.port)], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, (self.home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        raise AssertionError("prefect server did not become healthy")

    def stop(self) -> None:
        if self.proc is None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)
        self.proc = None


@pytest.fixture(scope="module")
def prefect(tmp_path_factory):
    server = PrefectServer(tmp_path_factory.mktemp("prefect-server"), free_port())
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prefect_server(prefect):
    return prefect.api, {**prefect.env, "PREFECT_HOME": str(prefect.home / "client")}


def on_server(api: str, read):
    """``await read(client)`` with a Prefect client of this process pointed at the test server (no process of
    its own: importing Prefect costs seconds on CI's two cores)."""
    import asyncio

    from prefect.client.orchestration import PrefectClient

    async def main():
        async with PrefectClient(api) as client:
            return await read(client)

    return asyncio.run(main())


def deployment_names(api: str) -> list[str]:
    async def read(client):
        return [d.name for d in await client.read_deployments()]

    return on_server(api, read)


def run_parameters(api: str, deployment: str) -> list[dict]:
    """The parameters of every flow run of ``deployment``."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    async def read(client):
        runs = await client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(
            any_=[deployment])))
        return [r.parameters for r in runs]

    return on_server(api, read)


def emit_and_wait_for_runs(api: str, event: str, resource: dict, payload: dict, deployment: str,
                           timeout_s: float = 60) -> list[dict]:
    """Post one event to the server's events API, then poll until ``deployment`` has a flow run."""
    from prefect.events import Event

    body = Event(event=event, resource=resource, payload=payload).model_dump(mode="json")
    httpx.post(f"{api}/events", json=[body], timeout=30).raise_for_status()
    deadline = time.monotonic() + timeout_s
    while not (runs := run_parameters(api, deployment)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return runs


def test_deploy_registers_everything_and_events_start_runs(prefect_server):
    _, env = prefect_server
    done = subprocess.run([sys.executable, "-m", "flows.cli", "deploy"], env=env, check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "registered 7 deployments" in done.stdout

    api = prefect_server[0]

    async def read(client):
        return {d.name: {"pool": d.work_pool_name, "schedules": len(d.schedules)} for d in await client.read_deployments()}

    deployments = on_server(api, read)
    from flows.deploy import POOLS, existing_pools

    assert existing_pools(api) >= set(POOLS), "what a second deploy reads to create no pool twice"
    assert deployments["release-nightly"] == {"pool": "enginewright-process", "schedules": 1}
    assert deployments["promote-on-approval-k8s"]["pool"] == "enginewright-k8s"

    runs = emit_and_wait_for_runs(api, "enginewright.approval.approved", {
        "prefect.resource.id": "mlflow.model-version.tiny-llama.7", "mlflow.model.name": "tiny-llama",
        "mlflow.model.version": "7"}, {}, "promote-on-approval")
    assert {"spec_path": "deployments/specs/tiny-llama.yaml", "model_name": "tiny-llama", "version": "7"} in runs

    runs = emit_and_wait_for_runs(api, "enginewright.checkpoint.published", {"prefect.resource.id": "checkpoint.tiny-llama"},
                                  {"spec_path": "deployments/specs/tiny-llama.yaml", "checkpoint": "/data/tiny-llama-v2"},
                                  "release-on-new-checkpoint")
    assert {"spec_path": "deployments/specs/tiny-llama.yaml", "checkpoint": "/data/tiny-llama-v2"} in runs


def test_deploy_without_a_server_names_the_setting(tmp_path, monkeypatch):
    """In this process (`flows.cli.main`, as test_cli_errors' run_cli): the test above runs `deploy` as a process
    of its own, and one more would cost 9 s of CPU importing torch, Prefect and MLflow for an error message."""
    from test_cli_errors import run_cli

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    done = run_cli("deploy", cwd=tmp_path)
    assert done.returncode == 2 and "PREFECT_API_URL" in done.stderr


def test_an_approval_delivered_while_prefect_is_down_starts_promote_exactly_once(prefect, prefect_server):
    """Acceptance (issue 23): the receiver answers 503 while Prefect is down (so MLflow retries), and once
    Prefect is back the retried delivery, a replay of it and a second delivery of the same decision (what
    the reconciliation re-emits) start the promote deployment exactly once. Runs last: it restarts Prefect."""
    from flows.approval_events import sign

    api, env = prefect_server
    if "promote-on-approval" not in deployment_names(api):
        deployed = subprocess.run([sys.executable, "-m", "flows.cli", "deploy"], env=env, check=False,
                                  capture_output=True, text=True, timeout=300)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    secret, port = "s3cret-for-the-test", free_port()
    receiver_env = {**env, "ENGINEWRIGHT_WEBHOOK_SECRET": secret}
    log_path = prefect.home / "receiver.log"
    with open(log_path, "wb") as log:
        receiver = subprocess.Popen([sys.executable, "-m", "flows.cli", "webhook-receiver", "--port", str(port)],
                                    env=receiver_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    body = (b'{"entity": "model_version_tag", "action": "set", "timestamp": 1, "data": {"name": "tiny-llama", '
            b'"version": "41", "key": "approval", "value": "approved"}}')

    def deliver(delivery_id: str) -> httpx.Response:
        now = str(int(time.time()))
        headers = {"X-MLflow-Delivery-Id": delivery_id, "X-MLflow-Timestamp": now,
                   "X-MLflow-Signature": sign(secret, delivery_id, now, body), "Content-Type": "application/json"}
        return httpx.post(url, content=body, headers=headers, timeout=30)

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert receiver.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
        prefect.stop()
        assert deliver("delivery-1").status_code == 503  # not 200: MLflow retries it
        assert deliver("delivery-1").status_code == 503
        prefect.start()
        assert deliver("delivery-1").status_code == 200  # MLflow's next retry
        replay = deliver("delivery-1")
        assert replay.status_code == 200 and "duplicate" in replay.text
        assert deliver("delivery-2").status_code == 200  # the same decision again: the same event id
        runs: list = []
        deadline = time.monotonic() + 60
        while not runs and time.monotonic() < deadline:
            runs = [r for r in run_parameters(api, "promote-on-approval") if r.get("version") == "41"]
            time.sleep(0.5)
        time.sleep(5)  # room for a second run, were one to come
        runs = [r for r in run_parameters(api, "promote-on-approval") if r.get("version") == "41"]
        assert runs == [{"spec_path": "deployments/specs/tiny-llama.yaml", "model_name": "tiny-llama",
                         "version": "41"}], runs
    finally:
        os.killpg(receiver.pid, signal.SIGTERM)
        receiver.wait(timeout=20)
    text = log_path.read_text()
    assert "webhook delivery delivery-1 accepted" in text and "could not emit" in text and secret not in text
