"""The python-backend model of the send benchmark (copied into a repository as ``model.py``).

A request with N = [0, 0] is only kept (its response sender is held, nothing is sent). A request with
N = [n, k] sends one final response (a 3-token ``out`` and a BYTES ``reason``, like the llm model's
final ones) to each of the n oldest kept requests, on k threads at once, and then answers itself with
the microseconds that took.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:  # only present inside Triton's python backend
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - exercised outside Triton
    pb_utils = None


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        self.kept: list = []

    def execute(self, requests: list) -> None:
        for request in requests:
            n, k = (int(x) for x in pb_utils.get_input_tensor_by_name(request, "N").as_numpy())
            sender = request.get_response_sender()
            if n == 0:
                self.kept.append(sender)
            else:
                burst, self.kept = self.kept[:n], self.kept[n:]
                threading.Thread(target=self._burst, args=(sender, burst, k), daemon=True).start()

    def _burst(self, trigger, senders: list, threads: int) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

        def send(sender) -> None:
            tensors = [pb_utils.Tensor("out", np.asarray([1, 2, 3], dtype=np.int32)),
                       pb_utils.Tensor("reason", np.asarray([b"length"], dtype=np.object_))]
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=final)

        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(send, senders))
        took_us = int((time.perf_counter() - started) * 1e6)
        tensors = [pb_utils.Tensor("out", np.asarray([took_us, len(senders)], dtype=np.int32)),
                   pb_utils.Tensor("reason", np.asarray([b"done"], dtype=np.object_))]
        trigger.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=final)
