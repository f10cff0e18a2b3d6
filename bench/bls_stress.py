"""The routers under concurrent BLS calls on real Triton: `python3 -m bench bls-stress` (any machine).

A numpy stand-in for an engine version (``s_v1``, decoupled, one thread per request) answers each call in
``responses`` responses (1: as the llm answers a request that does not stream; more: a stream), behind
the release's router ``s`` (HTTP clients, ``/infer``) or its streaming router ``s_stream`` (gRPC
streams). ``clients`` closed-loop clients call it for ``seconds``; a request not answered within 30 s
counts as failed and ends its client. The report: answered, failed, errors by message, and the lines of
Triton's log that tell of a crashed stub. ``model_file`` replaces the router's model file (an older
router, from ``git show <commit>:serving/triton/models/router.py``), to set two side by side.

This is how the bundled python backend's defects were measured (``serving.triton.models.bls``).
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

CRASH_WORDS = ("Segmentation fault", "Fatal Python error", "not healthy")
TIMEOUT_S = 30.0

TARGET = '''
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

RESPONSES = {responses}


class TritonPythonModel:
    def initialize(self, args):
        pass

    def execute(self, requests):
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "max_tokens").as_numpy().reshape(-1)[0])
            threading.Thread(target=self._answer, args=(r.get_response_sender(), n), daemon=True).start()
        return None

    def _answer(self, sender, n):
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if RESPONSES == 1:
            t = [pb_utils.Tensor("output_ids", np.asarray([list(range(n))], dtype=np.int32)),
                 pb_utils.Tensor("finish_reason", np.asarray([[b"length"]], dtype=np.object_))]
            sender.send(pb_utils.InferenceResponse(output_tensors=t), flags=final)
            return
        per = -(-n // RESPONSES)
        for i in range(0, n, per):
            t = [pb_utils.Tensor("output_ids", np.asarray([list(range(i, min(n, i + per)))], dtype=np.int32)),
                 pb_utils.Tensor("text_output", np.asarray([[b"word " * 4]], dtype=np.object_))]
            if i + per >= n:
                t.append(pb_utils.Tensor("finish_reason", np.asarray([[b"length"]], dtype=np.object_)))
            sender.send(pb_utils.InferenceResponse(output_tensors=t))
        sender.send(flags=final)
'''


def _repository(work: Path, *, responses: int, router: str, model_file: Path | None) -> Path:
    from serving.triton.model_configs import llm_inputs, llm_outputs
    from serving.triton.pbtxt import to_pbtxt
    from serving.triton.repository import init_repository, write_router, write_stream_router

    shutil.rmtree(work, ignore_errors=True)
    root = init_repository(work / "repository")
    (root / "s_v1" / "1").mkdir(parents=True)
    (root / "s_v1" / "1" / "model.py").write_text(TARGET.format(responses=int(responses)))
    config = {"name": "s_v1", "backend": "python", "max_batch_size": 1,
              "input": [*llm_inputs(), {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True}],
              "output": llm_outputs(), "model_transaction_policy": {"decoupled": True},
              "instance_group": [{"count": 1, "kind": "KIND_CPU"}]}
    (root / "s_v1" / "config.pbtxt").write_text(to_pbtxt(config))
    write_router(root, "s", {1: 100}, target_model="s_v{version}", target_decoupled=True)
    if router == "stream":
        write_stream_router(root, "s")
    if model_file is not None:
        (root / ("s_stream" if router == "stream" else "s") / "1" / "model.py").write_text(model_file.read_text())
    return root


def _http_client(url: str, tokens: int) -> str | None:
    from serving.triton.client import infer_ids

    result = infer_ids(url, "s", [1, 2, 3], max_tokens=tokens, timeout_s=TIMEOUT_S)
    return None if len(result.output_ids) == tokens else f"{len(result.output_ids)} of {tokens} tokens"


class _Stream:
    """One gRPC stream of a client to ``s_stream``."""

    def __init__(self, url: str) -> None:
        from tritonclient import grpc

        self.grpc = grpc
        self.answers: queue.Queue = queue.Queue()
        self.client = grpc.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)))
        self.count = 0

    def generate(self, tokens: int) -> str | None:
        g = self.grpc
        inputs = [g.InferInput("input_ids", [1, 3], "INT32"), g.InferInput("max_tokens", [1, 1], "INT32"),
                  g.InferInput("stream", [1, 1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.int32))
        inputs[1].set_data_from_numpy(np.array([[tokens]], dtype=np.int32))
        inputs[2].set_data_from_numpy(np.array([[True]]))
        self.count += 1
        self.client.async_stream_infer("s_stream", inputs, request_id=str(self.count), enable_empty_final_response=True,
                                       outputs=[g.InferRequestedOutput("output_ids")])
        got = 0
        while True:
            try:
                result, error = self.answers.get(timeout=TIMEOUT_S)
            except queue.Empty as exc:
                raise TimeoutError(f"no response within {TIMEOUT_S:.0f} s") from exc
            if error is not None:
                return str(error)[:200]
            if result.get_response().parameters.get("triton_final_response").bool_param:
                return None if got == tokens else f"{got} of {tokens} tokens"
            got += int(result.as_numpy("output_ids").size)


def run_bls_stress(work: Path, *, router: str = "router", clients: int = 32, seconds: float = 60.0,
                   responses: int = 25, tokens: int = 24, model_file: Path | None = None) -> dict[str, Any]:
    """Run the stress (module docstring); the report as a dict."""
    from serving.triton.process import start_triton

    root = _repository(work, responses=responses, router=router, model_file=model_file)
    server = start_triton(root, log_path=work / "triton.log")
    answered, errors, failed_at, lock = [0], {}, [], threading.Lock()
    try:
        control = server.control()
        for model in ("s_v1", "s", *(["s_stream"] if router == "stream" else [])):
            control.load_model(model)
        started = time.monotonic()

        def client() -> None:
            stream = _Stream(server.grpc_url) if router == "stream" else None
            while time.monotonic() < started + seconds:
                try:
                    error = stream.generate(tokens) if stream else _http_client(server.http_url, tokens)
                except Exception as exc:  # noqa: BLE001 - every failure is a data point
                    error = f"{type(exc).__name__}: {exc}"[:200]
                with lock:
                    if error is None:
                        answered[0] += 1
                    else:
                        errors[error] = errors.get(error, 0) + 1
                        failed_at.append(round(time.monotonic() - started, 1))
                if error is not None and "within" in error:
                    return  # a hung request: this client's connection is spent

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 2 * TIMEOUT_S)
    finally:
        server.stop()
    log = (work / "triton.log").read_text(errors="replace")
    return {"router": router, "clients": clients, "seconds": seconds, "responses_per_call": responses,
            "model_file": str(model_file) if model_file else None, "answered": answered[0],
            "failed": sum(errors.values()), "errors": errors, "failed_at_s": sorted(failed_at)[:20],
            "crash_lines": [line for line in log.splitlines() if any(w in line for w in CRASH_WORDS)][:10]}

