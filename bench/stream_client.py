"""One streaming gRPC client of the served benchmark (a spawned process: imports no torch).

`stream_client` opens one stream to Triton and waits at the barrier, so that every client starts
together. With `lanes` > 1 the stream carries that many requests at once: the prompts are dealt round-robin
to `lanes` threads, each sending its own one after the other, and responses are routed to their lane by
request id (an error without one reaches every lane), so a few processes hold a thousand streams' worth of
requests in flight. With `warmup`, every client first sends those prompts, one a lane at once, and the
clients wait for each other again: the round is the served counterpart of the offline benchmark's warm-up,
which its timing leaves out too (one prompt a client warms the server up lightly; one a lane, at the timed
round's width, meets every batch size and pool size the timed round will). Then each client sends its
prompts one after the other (`stream=True`) and puts each request's record on `out` (as a one-item list) as
soon as it is done: send time, the arrival time and token count of every response (a response carries one
token, or several when the server fell behind), an error if any, and `warmup: True` on the warm-up's
records. `None` on `out` means the client has finished.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

MODEL = "bench"


def _request(client: Any, events: queue.Queue, model: str, prompt: list[int], gen_len: int,
             request_id: str = "") -> dict[str, Any]:
    """Send one streaming request and wait for its final response: its record."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, arr, dt in (("input_ids", np.asarray([prompt], dtype=np.int32), "INT32"),
                          ("max_tokens", np.asarray([[gen_len]], dtype=np.int32), "INT32"),
                          ("stream", np.asarray([[True]], dtype=bool), "BOOL"),
                          # fixed-length generations, as trtllm-bench and vllm bench measure: EOS does not end them
                          ("ignore_eos", np.asarray([[True]], dtype=bool), "BOOL")):
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    sent = time.perf_counter()
    client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
    stamps, error = [], None
    while True:
        at, result, err = events.get(timeout=600)
        if err is not None:
            error = str(err)
            break
        resp = result.get_response()
        ids = result.as_numpy("output_ids")
        if ids is not None and ids.size:
            stamps.append((at, int(ids.size)))
        if resp.parameters["triton_final_response"].bool_param:
            break
    return {"sent": sent, "stamps": stamps, "error": error}


def stream_client(url: str, prompts: list[list[int]], gen_len: int, out: Any, barrier: Any = None,
                  model: str = MODEL + "_v1", warmup: list[list[int]] | None = None, lanes: int = 1) -> None:
    import tritonclient.grpc as grpcclient

    queues: dict[str, queue.Queue] = {str(lane): queue.Queue() for lane in range(lanes)}

    def route(result: Any, error: Any) -> None:
        at = time.perf_counter()
        lane = result.get_response().id.partition("-")[0] if result is not None else None
        for name in [lane] if lane in queues else list(queues):
            queues[name].put((at, result, error))

    def run_lane(lane: int, round_prompts: list[list[int]], tag: str) -> None:
        for i, prompt in enumerate(round_prompts[lane::lanes]):
            record = _request(client, queues[str(lane)], model, prompt, gen_len, f"{lane}-{tag}{i}")
            out.put([{**record, "warmup": True} if tag else record])

    def run_round(round_prompts: list[list[int]], tag: str = "") -> None:
        threads = [threading.Thread(target=_guarded, args=(run_lane, lane, out, round_prompts, tag), daemon=True)
                   for lane in range(min(lanes, len(round_prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=route)
    try:
        if barrier is not None:  # every client connected and imported before the first request
            barrier.wait(timeout=300)
        if warmup:
            run_round(warmup, "warmup")
            if barrier is not None:  # the timed requests start together, after every warm-up
                barrier.wait(timeout=600)
        run_round(prompts)
    except Exception as exc:  # noqa: BLE001 - reported, never a hang of the parent
        out.put([_failure(exc)])
    finally:
        client.stop_stream()
        client.close()
        out.put(None)


def _guarded(run_lane: Any, lane: int, out: Any, round_prompts: list[list[int]], tag: str) -> None:
    try:
        run_lane(lane, round_prompts, tag)
    except Exception as exc:  # noqa: BLE001 - reported, never a hang of the parent
        out.put([{**_failure(exc), "warmup": True} if tag else _failure(exc)])


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"sent": time.perf_counter(), "stamps": [], "error": f"{type(exc).__name__}: {exc}"}
