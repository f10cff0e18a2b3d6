"""Helpers for tests that touch Triton: a fake ``triton_python_backend_utils``, an engine-shaped fake
runner, a tiny real engine builder and a ``TritonServers`` factory that stops every server by PID.

Import from tests as ``from triton_support import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from serving.triton.process import TritonProcess, start_triton

# ---------------------------------------------------------------- fake triton_python_backend_utils


class FakeTritonError(Exception):
    def __init__(self, msg: str, code: int | None = None) -> None:
        super().__init__(msg)
        self.msg = msg

    def message(self) -> str:
        return self.msg


class FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeResponse:
    def __init__(self, output_tensors: list[FakeTensor] | None = None, error: FakeTritonError | None = None) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error

    def output_tensors(self) -> list[FakeTensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> FakeTritonError | None:
        return self._error

    def output(self, name: str) -> np.ndarray | None:
        for t in self._outputs:
            if t.name() == name:
                return t.as_numpy()
        return None


class FakeStubQueue:
    """The stub's stub-to-parent queue as the bundled python backend (r24.10) runs it, for decoupled BLS
    calls: a finished call's cleanup waits in the queue (the stub still holds the call) until a later round
    trip through it (``is_cancelled``) has gone by. ``freed_by_stub`` counts the calls the model let go of
    before that: the real stub would have freed their tensors on its own thread, without the GIL."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued: list[dict[str, bool]] = []
        self.freed_by_stub = 0

    def queue_cleanup(self, call: dict[str, bool]) -> None:
        with self.lock:
            self.queued.append(call)

    def round_trip(self) -> None:
        with self.lock:
            for call in self.queued:
                call["released"] = True
            self.queued.clear()

    def dropped(self, call: dict[str, bool]) -> None:
        if not call["released"]:
            with self.lock:
                self.freed_by_stub += 1


STUB_QUEUE = FakeStubQueue()


class FakeDecoupledCall:
    """What ``exec(decoupled=True)`` returns: an iterator of responses whose cleanup is queued when the last
    one has been taken (`FakeStubQueue`)."""

    def __init__(self, responses: list[Any]) -> None:
        self._responses = iter(responses)
        self._call = {"finished": False, "released": False}
        weakref.finalize(self, STUB_QUEUE.dropped, self._call)

    def __iter__(self) -> FakeDecoupledCall:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._responses)
        except StopIteration:
            if not self._call["finished"]:
                self._call["finished"] = True
                STUB_QUEUE.queue_cleanup(self._call)
            raise


class FakeSender:
    """A request's response sender: records ``(response, flags)``; ``done`` is set by a final flag.
    ``pruned``: the names of outputs sent that the request did not ask for (``requested``; none named:
    all), which the real stub's send drops without the GIL."""

    def __init__(self, requested: tuple[str, ...] = ()) -> None:
        self.sent: list[tuple[Any, int]] = []
        self.done = threading.Event()
        self.requested = frozenset(requested)
        self.pruned: list[str] = []
        self.cancelled = False

    def send(self, response: Any = None, flags: int = 0) -> None:
        if response is not None and self.requested:
            self.pruned += [t.name() for t in response.output_tensors() if t.name() not in self.requested]
        self.sent.append((response, flags))
        if flags & COMPLETE_FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        if not self.cancelled:  # the real flag, once true, is answered from a cache
            STUB_QUEUE.round_trip()
        return self.cancelled


COMPLETE_FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


class FakeRequest:
    """A server-side request: named numpy inputs (with the batch dim), requested output names and its
    response sender (``sender``)."""

    def __init__(self, inputs: dict[str, Any], requested: tuple[str, ...] = ()) -> None:
        self._inputs = [FakeTensor(k, np.asarray(v)) for k, v in inputs.items()]
        self._requested = list(requested)
        self.sender = FakeSender(tuple(requested))

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def inputs(self) -> list[FakeTensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested


def make_fake_pb_utils(bls_handler: Any = None) -> types.ModuleType:
    """A module with the parts of ``triton_python_backend_utils`` our models use.

    ``bls_handler(model_name, model_version, inputs, requested) -> FakeResponse`` answers BLS calls.
    """
    mod = types.ModuleType("triton_python_backend_utils")
    mod.TritonError = FakeTritonError
    mod.Tensor = FakeTensor
    mod.InferenceResponse = FakeResponse
    mod.calls = []
    mod.TRITONSERVER_RESPONSE_COMPLETE_FINAL = COMPLETE_FINAL
    mod.TRITONSERVER_MEMORY_CPU = 0
    mod.PreferredMemory = lambda memory_type, device_id: ("preferred", memory_type, device_id)
    mod.preferred_memory = []  # of every BLS request

    def get_input_tensor_by_name(request: FakeRequest, name: str) -> FakeTensor | None:
        return next((t for t in request.inputs() if t.name() == name), None)

    class InferenceRequest:
        def __init__(self, *, model_name: str, model_version: int = -1, requested_output_names: list[str],
                     inputs: list[FakeTensor], preferred_memory: Any = None) -> None:
            self.args = (model_name, model_version, list(inputs), list(requested_output_names))
            mod.preferred_memory.append(preferred_memory)

        def exec(self, decoupled: bool = False) -> Any:
            """One response, or (decoupled) an iterator of them: the handler's one, or each of its list (a
            list is a decoupled model's answer, which a plain call is refused)."""
            mod.calls.append(self.args)
            answer = bls_handler(*self.args)
            if isinstance(answer, list) and not decoupled:  # Triton's refusal, as the bundled 2.51 words it
                return FakeResponse(error=FakeTritonError(
                    f"Model {self.args[0]} is using the decoupled. The current BLS request call doesn't support "
                    "models using the decoupled transaction policy. Please use 'decoupled=True' argument to the "
                    "'exec' or 'async_exec' calls for decoupled models.'"))
            if not decoupled:
                return answer
            return FakeDecoupledCall(answer if isinstance(answer, list) else [answer])

        async def async_exec(self, decoupled: bool = False) -> Any:
            return self.exec(decoupled=decoupled)

    class Logger:
        lines: ClassVar[list[str]] = []

        @classmethod
        def log_info(cls, msg: str) -> None:
            cls.lines.append(msg)

        log_verbose = log_error = log_warn = log_info

    mod.get_input_tensor_by_name = get_input_tensor_by_name
    mod.InferenceRequest = InferenceRequest
    mod.Logger = Logger
    return mod


def answers(model: Any, requests: list[FakeRequest], *, timeout_s: float = 10.0) -> list[Any]:
    """Each request's one final response after ``model.execute(requests)`` (a router answers through the
    senders, from threads of its own); AssertionError when one has none within ``timeout_s``."""
    freed_by_stub = STUB_QUEUE.freed_by_stub
    assert model.execute(requests) is None
    for i, request in enumerate(requests):
        assert request.sender.done.wait(timeout_s), f"request {i} got no final response"
        finals = [r for r, flags in request.sender.sent if flags & COMPLETE_FINAL]
        assert len(finals) == 1 and len(request.sender.sent) == 1, request.sender.sent
        assert not request.sender.pruned, f"request {i}: sent outputs it did not ask for: {request.sender.pruned}"
    gc.collect()
    assert STUB_QUEUE.freed_by_stub == freed_by_stub, "a decoupled BLS call was let go before the stub was done"
    return [request.sender.sent[0][0] for request in requests]


# ---------------------------------------------------------------- engine-shaped fake runner


@dataclass(frozen=True)
class FakeLimits:
    max_batch_size: int = 4
    max_input_len: int = 16
    max_seq_len: int = 32


@dataclass(frozen=True)
class FakeInfo:
    limits: FakeLimits = field(default_factory=FakeLimits)
    fingerprint: str = "fake"


@dataclass
class FakeGeneration:
    token_ids: list[int]
    finish_reason: str = "length"


class FakeRunner:
    """Deterministic: the new tokens are ``last + 1, last + 2, ...``; records every generate call."""

    def __init__(self, limits: FakeLimits | None = None) -> None:
        self.info = FakeInfo(limits or FakeLimits())
        self.calls: list[dict[str, Any]] = []

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, sampling: Any = None,
                 stop_token_ids: tuple[int, ...] = ()) -> list[FakeGeneration]:
        self.calls.append({"prompts": prompts, "max_new_tokens": max_new_tokens, "sampling": sampling,
                           "stop_token_ids": tuple(stop_token_ids)})
        if len(prompts) > self.info.limits.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} > max_batch_size")
        out = []
        for p in prompts:
            ids, reason = [], "length"
            for k in range(max_new_tokens):
                ids.append(p[-1] + k + 1)
                if ids[-1] in stop_token_ids:
                    reason = "stop"
                    break
            out.append(FakeGeneration(ids, reason))
        return out


# ---------------------------------------------------------------- real tiny engine


def make_tiny_engine(work_dir: Path, *, seed: int = 0, max_batch_size: int = 8) -> Path:
    """Tiny HF model -> engine checkpoint -> CPU float32 engine folder (about 4 s)."""
    from serving.engine import EngineLimits, build_engine, convert_checkpoint
    from tasks.tiny_model import make_tiny_model

    hf = make_tiny_model(work_dir / f"hf-{seed}", seed=seed)
    ckpt = convert_checkpoint(hf, work_dir / f"ckpt-{seed}", dtype="float32")
    engine_dir = work_dir / f"engine-{seed}"
    build_engine(ckpt, engine_dir, limits=EngineLimits(dtype="float32", max_batch_size=max_batch_size,
                                                       max_input_len=128, max_seq_len=256))
    return engine_dir


# ---------------------------------------------------------------- servers


def one_thread_install() -> Any:
    """The bundled Triton with one OpenMP thread per python stub: a test server runs a dozen stubs (router
    instances, llm versions) on the 2-core CI machine, and torch's thread pool in each, spinning on every
    core, starved stubs past the python backend's one-second health check."""
    import dataclasses

    from serving.triton.install import locate_triton

    install = locate_triton()
    return dataclasses.replace(install, env={**install.env, "OMP_NUM_THREADS": "1"})


class TritonServers:
    """Start servers for a test; ``stop_all`` stops each by PID and removes its /tmp copies."""

    not_stopped: ClassVar[list[TritonProcess]] = []  # every server started and not yet stopped, for died_early()

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[TritonProcess] = []

    def start(self, repository: Path, **kwargs: Any) -> TritonProcess:
        kwargs.setdefault("install", one_thread_install())
        log_path = self.log_dir / f"triton-{len(self.started)}.log"
        proc = start_triton(repository, log_path=log_path, **kwargs)
        self.started.append(proc)
        TritonServers.not_stopped.append(proc)
        return proc

    @classmethod
    def died_early(cls) -> list[TritonProcess]:
        """Servers that exited by themselves (a crash), not through ``stop_all``."""
        return [proc for proc in cls.not_stopped if not proc.running()]

    def stop_all(self) -> None:
        TritonServers.not_stopped[:] = [p for p in TritonServers.not_stopped if p not in self.started]
        # SIGTERM every server first: each takes seconds to unload its models, so they shut down together.
        for proc in self.started:
            if proc.running():
                proc.note_tmp_copies()  # what stop() would note before signalling
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=10)
            proc.stop(timeout_s=10)  # one still running: SIGTERM again, then SIGKILL; removes its /tmp copies


def pid_alive(pid: int) -> bool:
    """True while a process (not a reaped zombie) with ``pid`` exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"



@contextlib.contextmanager
def tiny_models_served(work_dir: Path, queues: dict[str, int], decoupled: frozenset[str] = frozenset()
                       ) -> Iterator[TritonProcess]:
    """One Triton serving the tiny CPU engine behind a router under each name, with that engine queue size;
    the names in ``decoupled`` run in-flight batching (and get a streaming router)."""
    from serving.triton.operations import apply_router_weights, serve_versions
    from serving.triton.repository import init_repository, stage_engine_version

    repo = init_repository(work_dir / "repository")
    engine = make_tiny_engine(work_dir, max_batch_size=8)
    server = start_triton(repo, log_path=work_dir / "triton.log")
    try:
        for name, queue in queues.items():
            version = stage_engine_version(repo, name, engine, device_kind="cpu", max_queue_size=queue,
                                           parameters={"decoupled": "true"} if name in decoupled else None)
            serve_versions(server.control(), repo, name, [version])
            apply_router_weights(server.control(), repo, name, {version: 100})
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def openai_front(grpc_url: str, models: list[str], log_path: Path, *, ready_s: float = 60.0) -> Iterator[str]:
    """`enginewright serve` (the CLI's module) in front of `grpc_url` for `models`, on a free loopback port, until
    the block ends: yields its base URL once /health answers 200."""
    import httpx

    from serving.triton.process import free_port

    port = free_port()
    with open(log_path, "wb") as out:
        command = [sys.executable, "-m", "flows.cli", "serve", "--triton-grpc", grpc_url, "--port", str(port)]
        for model in models:
            command += ["--model", model]
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.2)
        else:
            raise AssertionError(f"front never became healthy: {log_path.read_text()}")
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)


def serve_only_version(server: Any, repo: Path, model: str, engine: Path, *, timeout_s: float = 300.0) -> int:
    """Stage `engine` as a decoupled version of `model` in `repo`, load it and route every request to it."""
    from serving.triton.operations import apply_router_weights, serve_versions
    from serving.triton.repository import stage_engine_version

    version = stage_engine_version(repo, model, engine, device_kind="cpu", parameters={"decoupled": "true"}, link=True)
    serve_versions(server.control(), repo, model, [version], timeout_s=timeout_s)
    apply_router_weights(server.control(), repo, model, {version: 100})
    return version
