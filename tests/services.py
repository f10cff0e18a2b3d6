"""Real services for tests, on loopback: an ``mlflow server`` process and moto's S3 server.

Use from a test module (or list ``"services"`` in ``pytest_plugins`` of ``tests/conftest.py``)::

    from services import mlflow_server, s3_bucket, s3_env, s3_server  # noqa: F401

Fixtures:

- ``mlflow_server`` (session): ``MlflowServer`` with ``tracking_uri`` / ``ui_base``; a real
  ``mlflow server`` (sqlite backend, proxied artifacts in a temp folder, webhooks to loopback
  allowed), started once per test session and stopped by PID at the end.
- ``mlflow_embedded`` (session): ``EmbeddedLocations`` of a sqlite tracking URI and ``file://``
  folders in a temp state folder, no server.
- ``s3_server`` (session): ``S3Server`` with ``endpoint_url`` and test credentials; moto's
  ``ThreadedMotoServer`` on 127.0.0.1 (in-process thread, real HTTP).
- ``s3_env`` (function): sets ``ENGINEWRIGHT_S3_ENDPOINT_URL``, ``MLFLOW_S3_ENDPOINT_URL`` and the
  ``AWS_*`` test credentials in the environment for the test.
- ``s3_bucket`` (function): a fresh, empty bucket name (``s3_env`` applied).

Session fixtures are shared even when several modules import them: each service is started on
first use, reference-counted, and stopped when the last user finishes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest

from registry.embedded import EmbeddedLocations, embedded_locations

T = TypeVar("T")

MLFLOW_START_TIMEOUT_S = 120.0
# The xdist controller's ``mlflow server`` (``mlflow_server``), as JSON: one for every worker instead of one
# per worker that runs a file using it (8-15 s of CPU a start; each file names its models uniquely).
MLFLOW_SHARED_ENV = "ENGINEWRIGHT_TEST_MLFLOW"
TEST_ACCESS_KEY_ID = "testing"
TEST_SECRET_ACCESS_KEY = "testing"  # moto accepts any credentials
TEST_REGION = "us-east-1"
AUTH_CACHE_TTL_S = 3600


class _Shared(Generic[T]):
    """A service started on first acquire and stopped when the last holder releases it."""

    def __init__(self, start: Callable[[Path], T], stop: Callable[[T], None]) -> None:
        self._start, self._stop = start, stop
        self._value: T | None = None
        self._holders = 0

    def acquire(self, workdir: Path) -> T:
        if self._holders == 0:
            self._value = self._start(workdir)
        self._holders += 1
        assert self._value is not None
        return self._value

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self._value is not None:
            value, self._value = self._value, None
            self._stop(value)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- MLflow server -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlflowServer:
    """A running ``mlflow server`` on loopback."""

    tracking_uri: str
    ui_base: str
    pid: int
    port: int
    backend_store_uri: str
    artifacts_destination: str
    log_path: Path
    startup_s: float


def start_mlflow_server(
    workdir: Path,
    *,
    env: dict[str, str] | None = None,
    artifacts_destination: str | None = None,
    extra_args: list[str] | None = None,
) -> MlflowServer:
    """Start ``mlflow server`` (sqlite, proxied artifacts under ``workdir``) and wait for ``/health``."""
    server, proc = launch_mlflow_server(workdir, env=env, artifacts_destination=artifacts_destination,
                                        extra_args=extra_args)
    return wait_mlflow_server(server, proc)


def launch_mlflow_server(
    workdir: Path,
    *,
    env: dict[str, str] | None = None,
    artifacts_destination: str | None = None,
    extra_args: list[str] | None = None,
) -> tuple[MlflowServer, subprocess.Popen]:
    """Start ``mlflow server`` and return at once (``wait_mlflow_server`` waits for ``/health``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    backend = f"sqlite:///{workdir / 'mlflow.db'}"
    artifacts = artifacts_destination or str(workdir / "mlartifacts")
    log_path = workdir / "mlflow-server.log"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    child_env.update(
        MLFLOW_WEBHOOK_ALLOWED_SCHEMES="http,https",
        MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS="true",
        MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY=_fernet_key(),
        # MLflow's job runner (GenAI evaluation, scorers) is not used here, and each server it runs in
        # leaves a huey store folder in /dev/shm that nothing removes (mlflow/server/__init__.py, 3.17)
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
    )
    child_env.update(env or {})
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", backend,
        "--artifacts-destination", artifacts,
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
        # open keep-alive connections from clients would otherwise hold shutdown for ~10 s
        "--uvicorn-opts", "--timeout-graceful-shutdown 1",
        *(extra_args or []),
    ]
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=workdir, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    server = MlflowServer(tracking_uri=url, ui_base=url, pid=proc.pid, port=port, backend_store_uri=backend,
                          artifacts_destination=artifacts, log_path=log_path, startup_s=t0)
    return server, proc


def wait_mlflow_server(server: MlflowServer, proc: subprocess.Popen | None = None) -> MlflowServer:
    """Wait until ``server`` answers ``/health``; ``proc``: its process, when this process started it (then an
    early exit is reported, and a server that never comes up is stopped). Returns it with ``startup_s`` set
    (``launch_mlflow_server`` left its start time there)."""
    t0 = server.startup_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{_tail(server.log_path)}")
        try:
            with urllib.request.urlopen(f"{server.tracking_uri}/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() - t0 > MLFLOW_START_TIMEOUT_S:
            if proc is not None:
                _kill_group(proc.pid)
            raise RuntimeError(f"mlflow server not healthy after {MLFLOW_START_TIMEOUT_S} s:\n{_tail(server.log_path)}")
        time.sleep(0.3)
    return replace(server, startup_s=time.monotonic() - t0)


def mlflow_server_to_env(server: MlflowServer) -> str:
    """``server`` as the value of ``MLFLOW_SHARED_ENV`` (what a worker reads back with ``mlflow_server_from_env``)."""
    import json

    return json.dumps({**asdict(server), "log_path": str(server.log_path)})


def mlflow_server_from_env(value: str) -> MlflowServer:
    import json

    fields = json.loads(value)
    return MlflowServer(**{**fields, "log_path": Path(fields["log_path"])})


def stop_mlflow_server(server: MlflowServer) -> None:
    """Stop the server's process group by its PID (SIGTERM, then SIGKILL after 10 s)."""
    _kill_group(server.pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done == pid:
            break
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)  # workers left behind, if any
    except ProcessLookupError:
        pass


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def _fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


# -- S3 (moto) -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Server:
    """moto's S3 server on loopback, with the credentials tests use."""

    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    region: str
    server: Any

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3, enginewright and MLflow at this server."""
        return {
            "ENGINEWRIGHT_S3_ENDPOINT_URL": self.endpoint_url,
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self) -> Any:
        """A plain boto3 S3 client for this server (for test set-up and tampering)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            region_name=self.region,
        )


def start_s3_server(_workdir: Path | None = None) -> S3Server:
    """Start moto's ThreadedMotoServer on 127.0.0.1 and a free port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return S3Server(
        endpoint_url=f"http://{host}:{port}",
        access_key_id=TEST_ACCESS_KEY_ID,
        secret_access_key=TEST_SECRET_ACCESS_KEY,
        region=TEST_REGION,
        server=server,
    )


def stop_s3_server(s3: S3Server) -> None:
    """Stop the moto server thread."""
    s3.server.stop()


_MLFLOW: _Shared[MlflowServer] = _Shared(start_mlflow_server, stop_mlflow_server)
_S3: _Shared[S3Server] = _Shared(start_s3_server, stop_s3_server)


# -- MLflow with the basic-auth app and artifacts proxied to S3 -------------------------------------


@dataclass(frozen=True)
class Account:
    """An MLflow basic-auth account (the password is a fresh random secret per session)."""

    username: str
    password: str

    @property
    def auth(self) -> tuple[str, str]:
        return (self.username, self.password)

    def env(self) -> dict[str, str]:
        return {"MLFLOW_TRACKING_USERNAME": self.username, "MLFLOW_TRACKING_PASSWORD": self.password}


@dataclass(frozen=True)
class MlflowAuthServer:
    """``mlflow server --app-name basic-auth`` with run artifacts proxied to a moto S3 bucket."""

    server: MlflowServer
    admin: Account
    publisher: Account
    approver: Account
    outsider: Account
    artifacts_bucket: str
    s3: S3Server

    @property
    def tracking_uri(self) -> str:
        return self.server.tracking_uri

    @property
    def passwords(self) -> list[str]:
        return [a.password for a in (self.admin, self.publisher, self.approver, self.outsider)]


def _account(name: str) -> Account:
    return Account(name, f"{name}-{uuid.uuid4().hex}")


def start_mlflow_auth_server(workdir: Path, s3: S3Server) -> MlflowAuthServer:
    """Start the auth app (sqlite user store, fresh admin password), create the test accounts."""
    import requests

    workdir.mkdir(parents=True, exist_ok=True)
    admin = _account("admin")
    ini = workdir / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{workdir / 'auth.db'}\n"
        f"admin_username = {admin.username}\nadmin_password = {admin.password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # MLflow's own credential cache (off by default): without it every request of a test pays one
        # scrypt check (~0.1 s of CPU), which made this server the costliest process of the suite. The
        # server runs one worker, and no test changes a password, so nothing can go stale.
        f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n"
    )
    ini.chmod(0o600)
    bucket = f"mlartifacts-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    env = {**s3.env(), "MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": uuid.uuid4().hex,
           # the server caches each event's webhook list (60 s by default): a new webhook would stay silent
           "MLFLOW_WEBHOOK_CACHE_TTL": "1"}
    server = start_mlflow_server(workdir, env=env, artifacts_destination=f"s3://{bucket}/proxied",
                                 extra_args=["--app-name", "basic-auth"])
    accounts = {name: _account(name) for name in ("publisher", "approver", "outsider")}
    for account in accounts.values():
        resp = requests.post(f"{server.tracking_uri}/api/2.0/mlflow/users/create", auth=admin.auth, timeout=30,
                             json={"username": account.username, "password": account.password})
        resp.raise_for_status()
    return MlflowAuthServer(server, admin, accounts["publisher"], accounts["approver"], accounts["outsider"],
                            bucket, s3)


@pytest.fixture(scope="session")
def mlflow_auth_server(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[MlflowAuthServer]:
    """A real ``mlflow server --app-name basic-auth`` on loopback, artifacts proxied to moto S3."""
    auth = start_mlflow_auth_server(tmp_path_factory.mktemp("mlflow-auth"), s3_server)
    try:
        yield auth
    finally:
        stop_mlflow_server(auth.server)


# -- Prefect server: one per test run, shared by the pytest-xdist workers ---------------------------

PREFECT_SHARED_ENV = "ENGINEWRIGHT_TEST_PREFECT_API"  # the shared server's API URL, set by the xdist controller
PREFECT_START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class PrefectServer:
    """A Prefect API server on loopback (the app ``prefect_test_harness`` runs, on its own sqlite database)."""

    api_url: str
    workdir: Path
    log_path: Path
    popen: subprocess.Popen


def start_prefect_server(workdir: Path) -> PrefectServer:
    """Start the server and return at once (it takes 15-20 s to come up; ``wait_prefect_server`` waits).

    The command and settings are ``prefect_test_harness``'s (Prefect 3.9's ``SubprocessASGIServer``): the API
    only, no UI, the services an ephemeral server runs."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")  # its folder, without importing Prefect here
    assert spec is not None and spec.origin is not None, "prefect is not installed"
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(workdir / "home"), "PREFECT_UI_ENABLED": "0",
           "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{workdir / 'prefect.db'}"}
    log_path = workdir / "prefect-server.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
    return PrefectServer(f"http://127.0.0.1:{port}/api", workdir, log_path, popen)


def wait_prefect_server(api_url: str, timeout_s: float = PREFECT_START_TIMEOUT_S) -> None:
    """Wait until the server at ``api_url`` answers ``/health``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shared Prefect server at {api_url} did not answer /health within {timeout_s:g} s")
        time.sleep(0.3)


def stop_prefect_server(server: PrefectServer) -> None:
    """Stop the server's process group by its PID and remove its folder."""
    import shutil

    _kill_group(server.popen.pid)
    server.popen.wait(timeout=10)
    shutil.rmtree(server.workdir, ignore_errors=True)


def shares_prefect_server(config: pytest.Config) -> bool:
    """True in the controller of a pytest-xdist run: it starts one Prefect server for all its workers."""
    return not hasattr(config, "workerinput") and str(config.getoption("numprocesses", None) or 0) not in ("0", "")


@pytest.fixture(scope="session", autouse=True)
def shared_prefect_ready() -> None:
    """A worker of an xdist run waits for the controller's Prefect server before its first test (it was started
    while the workers collected, so this is normally at once)."""
    if api_url := os.environ.get(PREFECT_SHARED_ENV):
        wait_prefect_server(api_url)


@pytest.fixture(scope="session")
def prefect_harness():
    """A Prefect API for flows run in this process: the xdist run's shared server (``PREFECT_API_URL`` points at
    it already), else ``prefect_test_harness`` (a temporary server and database for this session)."""
    if os.environ.get(PREFECT_SHARED_ENV):
        yield
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` on loopback for the whole session (stopped by PID). In an xdist worker: the
    controller's (``MLFLOW_SHARED_ENV``, started while the workers collect), which the controller stops."""
    if shared := os.environ.get(MLFLOW_SHARED_ENV):
        yield wait_mlflow_server(mlflow_server_from_env(shared))
        return
    server = _MLFLOW.acquire(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        _MLFLOW.release()


@pytest.fixture(scope="session")
def mlflow_embedded(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedLocations:
    """Embedded MLflow (sqlite URI, ``file://`` folders) in a temp state folder, no server."""
    return embedded_locations(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server on loopback for the whole session."""
    s3 = _S3.acquire(tmp_path_factory.getbasetemp())
    try:
        yield s3
    finally:
        _S3.release()


def point_at_s3(monkeypatch: pytest.MonkeyPatch, s3_server: S3Server) -> None:
    """Set ENGINEWRIGHT_S3_ENDPOINT_URL, MLFLOW_S3_ENDPOINT_URL and AWS_* to the moto server (no profile or
    session token of the machine's own)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Point ENGINEWRIGHT_S3_ENDPOINT_URL, MLFLOW_S3_ENDPOINT_URL and AWS_* at the moto server."""
    point_at_s3(monkeypatch, s3_server)
    return s3_server


@pytest.fixture
def s3_bucket(s3_env: S3Server) -> str:
    """A fresh empty bucket on the moto server."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_env.client().create_bucket(Bucket=name)
    return name


# -- a stand-in engine folder for publishing tests ---------------------------------------------------


@dataclass(frozen=True)
class FakeEngine:
    """What ``tasks.publish.publish`` reads from a built engine: fingerprint, toolchain, path."""

    fingerprint: str
    path: str
    toolchain: dict[str, str]
    kind: str = "torch"


def make_engine_folder(root: Path, *, big_mib: int = 12, seed: int = 0) -> FakeEngine:
    """An engine-like folder (one multipart-sized weight file, small json files), random content."""
    import json
    import random

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "weights").mkdir(exist_ok=True)
    (root / "engine.json").write_text(json.dumps({"seed": seed, "kind": "torch"}))
    (root / "tokenizer.json").write_text(json.dumps({"vocab": [f"t{i}" for i in range(200)]}))
    (root / "weights" / "rank0.bin").write_bytes(rng.randbytes(big_mib * 1024 * 1024))
    (root / "weights" / "rank1.bin").write_bytes(rng.randbytes(3 * 1024 * 1024))
    return FakeEngine(f"fp{seed}-{uuid.uuid4().hex[:12]}", str(root), {"torch": "2.13.0", "cuda": "none"})
