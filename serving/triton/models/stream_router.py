"""The ``<name>_stream`` Triton python-backend model: the stable name of a gray release for streaming clients.

It is written beside the ``router`` model of a release whose llm is decoupled (in-flight batching) and
routes by the router's routing file (``routing_file``: weights, ``load_id``), followed before each batch;
a weight change reloads neither. It is itself decoupled: per request it picks a
version the way the router does (sticky ``routing_key``, else by weight), calls that version with
``exec(decoupled=True)`` and sends each of its responses on as it comes, with ``routed_version`` added,
then an empty final response. A failed call, or an error response of the version, is the stream's final
response.

Each instance forwards one stream at a time, inside ``execute`` (several instances serve streams side by
side): in the bundled python backend (r24.10) two decoupled BLS calls of several responses each in one
stub deadlock when one starts while the other's thread wakes for a response (the GIL, the stub's map of
calls and the call's own mutex, taken in a cycle; `serving.triton.models.bls`). On threads in one
instance, a CPU stress run of 16 streams (`python3 -m bench bls-stress --router stream`) hung a
stub within a minute. The router's calls, one response each, cannot close that cycle.

Counters go into the router's counter files (parameter ``counters_model``: the router's folder), so the
router's stats and a rollout's analysis count streaming requests too: one request per stream, its latency
from the call to the version's last response, its tokens.

Imports: numpy, stdlib and the pure routing helpers.
"""

from __future__ import annotations

import faulthandler
import time
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

try:  # only present inside Triton's python backend
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - exercised outside Triton
    pb_utils = None

NOT_FORWARDED = frozenset({"routing_key"})
ROUTER_ONLY_OUTPUTS = frozenset({"routed_version"})


class TritonPythonModel:
    """Weighted streaming BLS router in front of the versions of ``target_model``."""

    def initialize(self, args: dict[str, str]) -> None:
        faulthandler.enable(all_threads=True)  # a crash of this stub leaves its stack in Triton's log
        self.model_name = args["model_name"]
        read = read_router_params(self.model_name, args["model_config"], required=("counters_model",))
        self.target_model, self.rng = read.target_model, read.rng
        router_dir = Path(args["model_repository"]).parent / read.params["counters_model"]
        self.routing = open_routing(self.model_name, router_dir, self.target_model)

    def execute(self, requests: list[Any]) -> None:
        try:
            self.routing.refresh()
        except RoutingFileError as exc:  # keep routing by the weights in force
            logger = getattr(pb_utils, "Logger", None)
            message = f"[{self.model_name}] {exc}; still routing with {self.routing.weights}"
            logger.log_error(message) if logger is not None else print(message, flush=True)
        for request in requests:  # one stream at a time (module docstring)
            sender = request.get_response_sender()
            try:
                version, bls, client = self._forwarded(request)
            except Exception as exc:  # noqa: BLE001 - a bad request is its own error, never a crash
                sender.send(_error(f"{self.model_name}: {exc}"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self._stream(bls, version, client, sender, self.routing.stats)

    def _forwarded(self, request: Any) -> tuple[int, Any, frozenset[str]]:
        """The version, the BLS request to it and the outputs the client asked for (none named: all)."""
        version = pick_version(self.routing.weights, pb_utils.get_input_tensor_by_name(request, "routing_key"), self.rng)
        inputs = [t for t in request.inputs() if t.name() not in NOT_FORWARDED]
        client = client_outputs(request)
        requested = forwarded_outputs(client, {t.name() for t in inputs}, ROUTER_ONLY_OUTPUTS)
        return version, target_request(pb_utils, self.target_model, version, requested, inputs), frozenset(client)

    def _stream(self, bls: Any, version: int, client: frozenset[str], sender: Any, stats: RouterStats) -> None:
        """Forward one stream; it counts in ``stats``, the generation that routed it."""
        routed = pb_utils.Tensor("routed_version", np.asarray([[version]], dtype=np.int32))
        started, tokens, error = time.monotonic(), 0, None
        try:
            for response in decoupled_responses(bls, sender):
                if response.has_error():
                    error = f"{target_label(self.target_model, version)}: {response.error().message()}"
                    break
                outputs = list(response.output_tensors())
                if not outputs:  # the version's empty final response
                    continue
                tokens += sum(int(np.asarray(t.as_numpy()).size) for t in outputs if t.name() == "output_ids")
                outputs = requested_only([*outputs, routed], client)
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs))
        except Exception as exc:  # noqa: BLE001 - the stream's error, never a crash
            error = f"{self.model_name}: forwarding to {target_label(self.target_model, version)} failed: {exc}"
        # counted before the final response: a client that reads the stats next sees its stream
        stats.record(version, ok=error is None, latency_s=time.monotonic() - started, output_tokens=tokens)
        stats.persist()
        try:
            sender.send(None if error is None else _error(error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # noqa: BLE001, S110 - the client is gone: nothing left to tell it
            pass

    def finalize(self) -> None:
        self.routing.stats.persist(final=True)


def _error(message: str) -> Any:
    code = target_error_code(message, None, pb_utils.TritonError)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
