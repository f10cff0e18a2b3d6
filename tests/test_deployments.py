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


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_UI_API_URL": api, "PREFECT_API_URL": api}
    with open(home / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (home / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError("prefect server did not become healthy")
        yield api, {**env, "PREFECT_HOME": str(home / "client")}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def run_in(env: dict[str, str], coro_fn):
    """Run a coroutine with the Prefect client pointed at the test server."""
    code = f"import asyncio, json, sys\n{coro_fn}\nprint(json.dumps(asyncio.run(main())))"
    done = subprocess.run([sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])


WAIT_FOR_RUN = '''
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.events import emit_event
async def main():
    emit_event(event=sys.argv[1] if len(sys.argv) > 1 else EVENT, resource=RESOURCE, payload=PAYLOAD)
    async with get_client() as client:
        for _ in range(60):
            runs = await client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[DEPLOYMENT])))
            if runs:
                return [r.parameters for r in runs]
            await asyncio.sleep(1)
    return []
'''


def test_deploy_registers_everything_and_events_start_runs(prefect_server):
    _, env = prefect_server
    done = subprocess.run([sys.executable, "-m", "flows.cli", "deploy"], env=env, check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "registered 6 deployments" in done.stdout

    deployments = run_in(env, '''
from prefect.client.orchestration import get_client
async def main():
    async with get_client() as client:
        found = await client.read_deployments()
        return {d.name: {"pool": d.work_pool_name, "schedules": len(d.schedules)} for d in found}
''')
    assert deployments["release-nightly"] == {"pool": "enginewright-process", "schedules": 1}
    assert deployments["promote-on-approval-k8s"]["pool"] == "enginewright-k8s"

    approval = WAIT_FOR_RUN.replace("EVENT", '"enginewright.approval.approved"').replace(
        "RESOURCE", '{"prefect.resource.id": "mlflow.model-version.tiny-llama.7", "mlflow.model.name": "tiny-llama", '
        '"mlflow.model.version": "7"}').replace("PAYLOAD", "{}").replace("DEPLOYMENT", '"promote-on-approval"')
    runs = run_in(env, approval)
    assert {"spec_path": "deployments/specs/tiny-llama.yaml", "model_name": "tiny-llama", "version": "7"} in runs

    checkpoint = WAIT_FOR_RUN.replace("EVENT", '"enginewright.checkpoint.published"').replace(
        "RESOURCE", '{"prefect.resource.id": "checkpoint.tiny-llama"}').replace(
        "PAYLOAD", '{"spec_path": "deployments/specs/tiny-llama.yaml", "checkpoint": "/data/tiny-llama-v2"}').replace(
        "DEPLOYMENT", '"release-on-new-checkpoint"')
    runs = run_in(env, checkpoint)
    assert {"spec_path": "deployments/specs/tiny-llama.yaml", "checkpoint": "/data/tiny-llama-v2"} in runs


def test_deploy_without_a_server_names_the_setting(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "deploy"], env={**env, "PREFECT_HOME": str(tmp_path)},
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "PREFECT_API_URL" in done.stderr
