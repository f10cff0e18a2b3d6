"""How fast the python backend sends decoupled responses, one thread against several at once.

A burst of `burst` final responses (one per held request, as when closed-loop clients' requests end
together) is sent by the bundled Triton's python backend on 1, 2, 4, ... threads, alternating, several
rounds each; the figure is the burst's wall time inside the model. It tells whether the `llm` model's
``idle_senders`` can shorten the final-response burst on a given machine: a send releases the GIL
while it waits for Triton's process, so threads overlap only where the cores and Triton's own
threads have room.
"""

from __future__ import annotations

import json
import queue
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

CONFIG = """name: "sends"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 2 ] } ]
output [ { name: "out" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "reason" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""


def write_repository(root: Path) -> Path:
    model = root / "sends"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(CONFIG)
    shutil.copyfile(Path(__file__).with_name("send_model.py"), model / "1" / "model.py")
    return root


def _request(n: int, k: int) -> Any:
    import numpy as np
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput("N", [2], "INT32")
    tensor.set_data_from_numpy(np.asarray([n, k], dtype=np.int32))
    return [tensor]


def run_send_bench(work: Path, *, burst: int = 64, threads: tuple[int, ...] = (1, 2, 4, 8), rounds: int = 5,
                   out_json: Path | None = None) -> dict[str, Any]:
    """Burst wall times (ms) per thread count -> {threads: {median_ms, per_response_ms, samples_ms}}."""
    import tritonclient.grpc as grpcclient

    from serving.triton.process import start_triton

    root = write_repository(work / "send-repo")
    proc = start_triton(root, log_path=work / "send-triton.log", ready_timeout_s=120)
    results: dict[int, list[float]] = {k: [] for k in threads}
    try:
        proc.control().load_model("sends", timeout_s=120)
        replies: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(proc.grpc_url)
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        try:
            for _ in range(rounds):
                for k in threads:
                    for _ in range(burst):
                        client.async_stream_infer("sends", _request(0, 0))
                    time.sleep(0.2)  # every held request reached the model
                    client.async_stream_infer("sends", _request(burst, k))
                    while True:
                        result, error = replies.get(timeout=60)
                        if error is not None:
                            raise RuntimeError(f"send benchmark: {error}")
                        if result.as_numpy("reason")[0] == b"done":
                            took_us, sent = (int(x) for x in result.as_numpy("out"))
                            break
                    if sent != burst:
                        raise RuntimeError(f"send benchmark: {sent} of {burst} responses sent")
                    results[k].append(took_us / 1e3)
        finally:
            client.stop_stream()
            client.close()
    finally:
        proc.stop(timeout_s=20)
    report = {"burst": burst, "rounds": rounds, "threads": {
        str(k): {"median_ms": statistics.median(v), "per_response_ms": statistics.median(v) / burst,
                 "samples_ms": [round(x, 3) for x in v]} for k, v in results.items()}}
    if out_json is not None:
        out_json.write_text(json.dumps(report, indent=1))
    return report
