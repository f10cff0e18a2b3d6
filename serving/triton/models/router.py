"""The ``router`` Triton python-backend model (BLS): the stable name clients call during a gray release.

Parameters (config ``parameters``): ``target_model`` (``<name>_v{version}``: one model per engine version),
``routing_file`` and optionally ``seed``. The weights (JSON ``{"1": 90, "2": 10}``), the counters'
``load_id`` and ``target_decoupled`` live in the routing file beside the config (``routing_file``), which
every instance checks before each batch: a weight change reloads nothing. Per request it picks a
version by weight, forwards the request's inputs to that version with a BLS call, and answers with
the target's outputs plus ``routed_version``; an error from the target comes back as this request's
error.

Each request is forwarded on a thread of its own and answered through its response sender, so
``execute`` returns at once and one instance forwards any number of requests at once. The BLS calls and
sends go through `serving.triton.models.bls`, which keeps the bundled python backend (r24.10) from freeing
their tensors without the GIL (on the H200, the segfaults that failed most requests of a rollout).
Its requests never stream, so the llm answers each call in one response: concurrent calls of several
responses each can deadlock a stub (`bls`).

A decoupled target (the llm with in-flight batching) is called with ``exec(decoupled=True)`` (which
serves a plain llm too), and its responses are merged into this request's one answer: every token, the
last ``finish_reason``. The router knows the target is decoupled from the routing file's
``target_decoupled`` (written when the llm is staged decoupled), or learns it from the target's refusal of
a plain BLS call, which names ``decoupled=True`` (the fallback; the refusal can take 20-30 s to come back
under traffic). So a release may turn it on under a live router and no request fails. The router itself
is not decoupled (one response per request), so HTTP clients keep working; streaming clients call the
release's streaming router ``<name>_stream``.

Sticky routing: a request carrying the optional ``routing_key`` BYTES input goes to the version whose
slice of [0, 1) holds the key's SHA-256 point (``routing.choose_sticky``), so one user (or session)
stays on one version while the weights move in one direction; requests without a key are weighted at
random. ``routing_key`` is not forwarded.

Counters per version (requests, errors, latency sum/max/histogram, output tokens) live in memory and
are written to ``<router dir>/counters/<generation>.json`` after every request (before its response goes
out), at a weight change (a new generation) and at finalize, so a weight change loses nothing and the router's
several instances (each its own generation) add up. Triton's own metrics count an error response as a
success, so these are the error counts to trust. The controller reads them from the model repository
(``serving.triton.repository.router_stats``); no input of the router exposes them to clients.
"""

from __future__ import annotations

import faulthandler
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serving.triton.models.bls import client_outputs, decoupled_responses, requested_only, target_request
from serving.triton.models.routing import (
    RouterStats,
    forwarded_outputs,
    pick_version,
    read_router_params,
    target_error_code,
    target_label,
)
from serving.triton.models.routing_file import RoutingFileError, open_routing

try:  # only present inside Triton's python backend; unit tests install a fake module
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - exercised outside Triton
    pb_utils = None

ROUTER_INPUTS_ONLY = frozenset({"routing_key"})
ROUTER_OUTPUTS_ONLY = frozenset({"routed_version"})
LOG_EVERY_S = 30.0
DECOUPLED_REFUSAL = "decoupled=True"  # in Triton's answer to a plain BLS call of a decoupled model
FINALIZE_JOIN_S = 30.0  # per forward still running at unload (Triton waits for final responses first)


def _log(level: str, msg: str) -> None:
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        getattr(logger, f"log_{level}")(msg)
    else:
        print(msg, flush=True)


def _forwarded_error(message: str, error: Any) -> Any:
    """A TritonError with ``message`` and the code the target meant (`target_error_code`)."""
    code = target_error_code(message, error, pb_utils.TritonError)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


@dataclass(frozen=True)
class Forwarded:
    """The outputs a request asks of the target (``target``) and those its client asked for (``client``;
    none named: all)."""

    target: list[str]
    client: frozenset[str]


class TritonPythonModel:
    """Weighted BLS router in front of the versions of ``target_model``."""

    def initialize(self, args: dict[str, str]) -> None:
        faulthandler.enable(all_threads=True)  # a crash of this stub leaves its stack in Triton's log
        self.model_name = args["model_name"]
        read = read_router_params(self.model_name, args["model_config"])
        self.target_model, self.rng = read.target_model, read.rng
        self.routing = open_routing(self.model_name, Path(args["model_repository"]), self.target_model)
        self.target_decoupled = self.routing.routing.target_decoupled  # or learnt from a refusal
        self.persisting = threading.Lock()  # one writer of a generation's file at a time, newest last
        self.forwards: set[threading.Thread] = set()
        self.lock = threading.Lock()
        self._last_log = time.monotonic()
        _log("info", f"[{self.model_name}] routing to {self.target_model} with weights {self.weights}"
                     + (" (decoupled BLS)" if self.target_decoupled else ""))

    @property
    def weights(self) -> dict[int, int]:
        return self.routing.weights

    @property
    def stats(self) -> RouterStats:  # the generation in force
        return self.routing.stats

    def _follow_routing(self) -> None:
        try:
            with self.persisting:  # a closing generation's final write, beside the forwards' writes
                changed = self.routing.refresh()
        except RoutingFileError as exc:  # keep routing by the weights in force
            _log("error", f"[{self.model_name}] {exc}; still routing with {self.weights}")
            return
        if changed is not None:
            self.target_decoupled = changed.target_decoupled
            _log("info", f"[{self.model_name}] routing with weights {self.weights}"
                         + (" (decoupled BLS)" if self.target_decoupled else ""))

    def execute(self, requests: list[Any]) -> None:
        self._follow_routing()
        for request in requests:
            sender = request.get_response_sender()
            try:
                version, forwarded, inputs = self._forwarded(request)
            except Exception as exc:  # noqa: BLE001 - a bad request is its own error, never a crash
                _send_final(sender, pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    f"{self.model_name}: {exc}")))
                continue
            thread = threading.Thread(target=self._forward, daemon=True,
                                      args=(version, forwarded, inputs, sender, self.stats))
            with self.lock:
                self.forwards.add(thread)
            thread.start()

    def _forwarded(self, request: Any) -> tuple[int, Forwarded, list[Any]]:
        version = pick_version(self.weights, pb_utils.get_input_tensor_by_name(request, "routing_key"), self.rng)
        inputs = [t for t in request.inputs() if t.name() not in ROUTER_INPUTS_ONLY]
        client = client_outputs(request)
        target = forwarded_outputs(client, {t.name() for t in inputs}, ROUTER_OUTPUTS_ONLY)
        return version, Forwarded(target, frozenset(client)), inputs

    def _forward(self, version: int, forwarded: Forwarded, inputs: list[Any], sender: Any,
                 stats: RouterStats) -> None:
        """Answer one request; it counts in ``stats``, the generation that routed it."""
        try:
            response = self._route(version, forwarded, inputs, sender, stats)
            self._persist(stats)  # counted before the response: a client that reads the stats next sees it
            self._log_counters()
            _send_final(sender, response)
        finally:
            with self.lock:
                self.forwards.discard(threading.current_thread())

    def _route(self, version: int, forwarded: Forwarded, inputs: list[Any], sender: Any,
               stats: RouterStats) -> Any:
        started = time.monotonic()
        try:
            response = self._call(version, forwarded.target, inputs, sender)
        except Exception as exc:  # noqa: BLE001 - a BLS failure is this request's error, never a crash
            stats.record(version, ok=False, latency_s=time.monotonic() - started)
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                f"{self.model_name}: forwarding to {target_label(self.target_model, version)} failed: {exc}"))
        latency = time.monotonic() - started
        if response.has_error():
            stats.record(version, ok=False, latency_s=latency)
            return pb_utils.InferenceResponse(output_tensors=[], error=_forwarded_error(
                f"{target_label(self.target_model, version)}: {response.error().message()}", response.error()))
        outputs = list(response.output_tensors())
        stats.record(version, ok=True, latency_s=latency, output_tokens=_count_tokens(outputs))
        outputs.append(pb_utils.Tensor("routed_version", np.asarray([[version]], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=requested_only(outputs, forwarded.client))

    def _call(self, version: int, requested: list[str], inputs: list[Any], sender: Any) -> Any:
        def request() -> Any:
            return target_request(pb_utils, self.target_model, version, requested, inputs)

        if not self.target_decoupled:
            response = request().exec()
            if not (response.has_error() and DECOUPLED_REFUSAL in response.error().message()):
                return response
            self.target_decoupled = True
            _log("info", f"[{self.model_name}] {self.target_model} is decoupled: calling it with decoupled BLS")
        return _Merged(list(decoupled_responses(request(), sender)))

    def _persist(self, stats: RouterStats, *, final: bool = False) -> None:
        try:
            with self.persisting:
                stats.persist(final=final)
        except OSError as exc:  # counters on disk are a convenience; serving goes on
            _log("warn", f"[{self.model_name}] cannot write counters: {exc}")

    def _log_counters(self) -> None:
        with self.lock:
            due = time.monotonic() - self._last_log > LOG_EVERY_S
            if due:
                self._last_log = time.monotonic()
        if due:
            _log("info", f"[{self.model_name}] counters {self.stats.to_json()}")

    def finalize(self) -> None:
        with self.lock:
            forwards = list(self.forwards)
        for thread in forwards:  # Triton unloads a model once its requests have their final responses
            thread.join(FINALIZE_JOIN_S)
        self._persist(self.stats, final=True)
        _log("info", f"[{self.model_name}] final counters {self.stats.to_json()}")


def _send_final(sender: Any, response: Any) -> None:
    try:
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as exc:  # noqa: BLE001 - the client is gone: nothing left to tell it
        _log("verbose", f"router: a response could not be sent: {exc}")


def _count_tokens(outputs: list[Any]) -> int:
    for tensor in outputs:
        if tensor.name() == "output_ids":
            return int(np.asarray(tensor.as_numpy()).size)
    return 0


class _Merged:
    """A decoupled target's responses as one: the first error, or every output merged (token ids and
    text joined in order, the last finish reason)."""

    def __init__(self, responses: list[Any]) -> None:
        self._error = next((r.error() for r in responses if r.has_error()), None)
        parts: dict[str, list[np.ndarray]] = {}
        for response in responses:
            for tensor in response.output_tensors():
                parts.setdefault(tensor.name(), []).append(np.asarray(tensor.as_numpy()))
        self._outputs = [pb_utils.Tensor(name, _joined(name, arrays)) for name, arrays in parts.items()]

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Any:
        return self._error

    def output_tensors(self) -> list[Any]:
        return self._outputs


def _joined(name: str, arrays: list[np.ndarray]) -> np.ndarray:
    if name == "output_ids":
        return np.concatenate([a.reshape(1, -1) for a in arrays], axis=1)
    if name == "text_output":
        return np.asarray([[b"".join(bytes(a.reshape(-1)[0]) for a in arrays)]], dtype=np.object_)
    if name == "output_logprobs":  # JSON per response (`logprob_output`): the tokens in order, the prompt once
        merged: dict[str, list] = {"tokens": []}
        for part in (json.loads(bytes(a.reshape(-1)[0])) for a in arrays):
            merged["tokens"] += part.get("tokens", [])
            if "prompt" in part:
                merged["prompt"] = part["prompt"]
        return np.asarray([[json.dumps(merged).encode()]], dtype=np.object_)
    return arrays[-1]
