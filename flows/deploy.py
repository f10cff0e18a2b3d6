"""Register the Prefect deployments of deployments/prefect.yaml on a Prefect server.

The work pools are created first when missing (a process pool and a Kubernetes pool), then
`prefect deploy --all` registers every deployment with its schedules and event triggers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POOLS = {"enginewright-process": "process", "enginewright-k8s": "kubernetes"}


class DeployError(Exception):
    """The deployments could not be registered; the message names the setting."""


def prefect_cli() -> list[str]:
    return [sys.executable, "-m", "prefect"]


def _run(args: list[str], env: dict[str, str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*prefect_cli(), *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def check_api(api_url: str) -> None:
    import httpx

    try:
        healthy = httpx.get(f"{api_url.rstrip('/')}/health", timeout=10).status_code == 200
    except httpx.HTTPError as exc:
        raise DeployError(f"Prefect API at {api_url} (setting PREFECT_API_URL) is not reachable: {exc}") from None
    if not healthy:
        raise DeployError(f"Prefect API at {api_url} (setting PREFECT_API_URL) is not healthy")


def existing_pools(api_url: str) -> set[str]:
    """The names of the server's work pools, read over its REST API (no `prefect` process to start: each costs
    seconds of CPU importing Prefect)."""
    import httpx

    resp = httpx.post(f"{api_url.rstrip('/')}/work_pools/filter", json={}, timeout=30)
    if resp.status_code != 200:
        raise DeployError(f"Prefect API at {api_url} (setting PREFECT_API_URL) answered {resp.status_code} to "
                          f"listing work pools: {resp.text[:500]}")
    return {pool["name"] for pool in resp.json()}


def ensure_pools(env: dict[str, str], api_url: str) -> list[str]:
    """Create the work pools that do not exist yet; return the names created."""
    created = []
    existing = existing_pools(api_url)
    for name, kind in POOLS.items():
        if name in existing:
            continue
        done = _run(["work-pool", "create", name, "--type", kind], env)
        if done.returncode != 0:
            raise DeployError(f"could not create work pool {name} ({kind}): {done.stdout[-500:]}{done.stderr[-500:]}")
        created.append(name)
    return created


def deploy(api_url: str | None = None, *, prefect_file: Path = ROOT / "deployments" / "prefect.yaml") -> str:
    """Create missing pools and register every deployment; return a short summary."""
    api_url = api_url or os.environ.get("PREFECT_API_URL")
    if not api_url:
        raise DeployError("no Prefect server: set PREFECT_API_URL (or pass --api-url) to the server's /api URL")
    check_api(api_url)
    env = {**os.environ, "PREFECT_API_URL": api_url, "ENGINEWRIGHT_HOME": str(ROOT)}
    created = ensure_pools(env, api_url)
    done = _run(["--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)], env)
    if done.returncode != 0:
        raise DeployError(f"prefect deploy failed for {prefect_file}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    names = [line.split("'")[1] for line in done.stdout.splitlines() if "Deployment '" in line]
    pools = f"created pools {created}" if created else "pools already there"
    return f"registered {len(names)} deployments on {api_url} ({pools}): " + ", ".join(names)
