"""Served benchmark: N concurrent streaming gRPC clients against Triton's decoupled llm (in-flight batching).

Builds a random-weight engine of a real shape (HF checkpoint -> `convert_checkpoint` -> `build_engine`),
stages it as a decoupled model (`compile_decode` on), starts the bundled tritonserver, then runs
`clients` client processes (one gRPC stream each, `requests_per_client` requests one after the other,
`stream=True`). Figures: output tok/s over the whole run, TTFT (send -> first token) and TPOT
(gaps between a request's tokens) p50/p99, plus raw samples for plots. Needs `tritonclient[grpc]`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import random
import time
from pathlib import Path
from typing import Any

from serving.bench.offline import percentile

MODEL = "bench"


def build_random_engine(shape: str, work: Path, *, max_batch_size: int, max_seq_len: int) -> Path:
    """Random bf16 weights of `shape` saved as an HF checkpoint, converted and built (skipped if present)."""
    import torch

    from serving.bench.models import random_hf_model
    from serving.engine import EngineLimits, build_engine, convert_checkpoint

    engine_dir = work / "engine"
    if (engine_dir / "engine.json").is_file():
        return engine_dir
    hf = random_hf_model(shape, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    hf.save_pretrained(work / "hf", safe_serialization=True, max_shard_size="1GB")
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ckpt = convert_checkpoint(work / "hf", work / "ckpt", dtype="bfloat16")
    limits = EngineLimits("bfloat16", max_batch_size=max_batch_size, max_input_len=max_seq_len - 1,
                          max_seq_len=max_seq_len)
    return build_engine(ckpt, engine_dir, limits=limits).path


def _client(url: str, prompts: list[list[int]], gen_len: int, out: Any) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
    records = []
    try:
        for prompt in prompts:
            inputs = []
            for name, arr, dt in (("input_ids", np.asarray([prompt], dtype=np.int32), "INT32"),
                                  ("max_tokens", np.asarray([[gen_len]], dtype=np.int32), "INT32"),
                                  ("stream", np.asarray([[True]], dtype=bool), "BOOL")):
                t = grpcclient.InferInput(name, list(arr.shape), dt)
                t.set_data_from_numpy(arr)
                inputs.append(t)
            sent = time.perf_counter()
            client.async_stream_infer(MODEL + "_engine", inputs, enable_empty_final_response=True)
            stamps, error = [], None
            while True:
                at, result, err = events.get(timeout=600)
                if err is not None:
                    error = str(err)
                    break
                resp = result.get_response()
                if result.as_numpy("output_ids") is not None:
                    stamps.append(at)
                if resp.parameters["triton_final_response"].bool_param:
                    break
            records.append({"sent": sent, "stamps": stamps, "error": error})
    finally:
        client.stop_stream()
        client.close()
    out.put(records)


def run_served(*, shape: str, clients: int, requests_per_client: int, prompt_len: int, gen_len: int,
               max_batch_size: int, work: Path, out_json: Path | None = None, compile_decode: bool = True,
               load_timeout_s: float = 420.0) -> dict[str, Any]:
    import os

    import torch

    from serving.triton import init_repository, stage_engine_version
    from serving.triton.process import start_triton

    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LC_ALL", "C.UTF-8")  # inductor inside the stub reads its sources as UTF-8
    compile_decode = compile_decode and torch.cuda.is_available()
    t0 = time.perf_counter()
    max_seq = -(-(prompt_len + gen_len) // 256) * 256
    engine_dir = build_random_engine(shape, work, max_batch_size=max_batch_size, max_seq_len=max_seq)
    build_s = time.perf_counter() - t0
    root = init_repository(work / "repo")
    stage_engine_version(root, MODEL, engine_dir, device_kind="auto", max_queue_size=max(1024, 4 * clients),
                         max_queue_delay_us=100, parameters={"decoupled": "true",
                                                             "compile_decode": "true" if compile_decode else "false"})
    proc = start_triton(root, log_path=work / "triton.log", ready_timeout_s=120)
    report: dict[str, Any] = {"shape": shape, "clients": clients, "requests_per_client": requests_per_client,
                              "prompt_len": prompt_len, "gen_len": gen_len, "max_batch_size": max_batch_size,
                              "build_s": build_s}
    try:
        t1 = time.perf_counter()
        proc.control().load_model(MODEL + "_engine", timeout_s=load_timeout_s)
        report["load_s"] = time.perf_counter() - t1
        rng = random.Random(0)
        vocab = 128256 if shape.startswith("llama") else 512
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = []
        started = time.perf_counter()
        for _ in range(clients):
            prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(requests_per_client)]
            p = ctx.Process(target=_client, args=(proc.grpc_url, prompts, gen_len, out))
            p.start()
            procs.append(p)
        records = []
        for _ in procs:
            records += out.get(timeout=900)
        for p in procs:
            p.join(30)
        ok = [r for r in records if r["error"] is None and r["stamps"]]
        first_send = min(r["sent"] for r in records)
        last = max(r["stamps"][-1] for r in ok) if ok else time.perf_counter()
        tokens = sum(len(r["stamps"]) for r in ok)
        ttft = [(r["stamps"][0] - r["sent"]) * 1e3 for r in ok]
        tpot = [(b - a) * 1e3 for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
        report.update({
            "requests": len(records), "errors": [r["error"] for r in records if r["error"]][:5],
            "n_errors": sum(r["error"] is not None for r in records), "output_tokens": tokens,
            "wall_s": last - first_send, "output_tok_s": tokens / (last - first_send),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
            "clients_spawned_s": time.perf_counter() - started,
            "samples": {"ttft_ms": [round(x, 3) for x in ttft], "tpot_ms": [round(x, 3) for x in tpot[::7]]},
        })
    finally:
        proc.stop(timeout_s=20)
        if out_json is not None:
            out_json.write_text(json.dumps(report, indent=1))
    return report
