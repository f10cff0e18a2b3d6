"""Served benchmark: N concurrent streaming gRPC clients against Triton's decoupled llm (in-flight batching).

Builds a random-weight engine of a real shape (HF checkpoint -> `convert_checkpoint` -> `build_engine`),
stages it as a decoupled model (`compile_decode` on), starts the bundled tritonserver, then runs
`clients` client processes (one gRPC stream each, `requests_per_client` requests one after the other,
`stream=True`). Figures: output tok/s over the whole run, TTFT (send -> first token), TPOT per request
((last token - first token) / (tokens - 1), vLLM's benchmark definition, since one response may carry
several tokens) and ITL (gaps between a request's responses) p50/p99, plus raw samples for plots.
Needs `tritonclient[grpc]`.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import random
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.stream_client import MODEL, stream_client
from serving.engine.timing import percentile

if TYPE_CHECKING:
    from serving.engine.kv_cache import KVCacheConfig


def build_random_engine(shape: str, work: Path, *, max_batch_size: int, max_seq_len: int,
                        quantization: str = "none", paged: KVCacheConfig | None = None) -> Path:
    """Random bf16 weights of `shape` saved as an HF checkpoint, converted (quantized per
    `engine.quantization` = `quantization`) and built (with the paged KV cache `paged`, when given); skipped
    if that engine is there already."""
    import torch

    from bench.models import random_hf_model
    from serving.engine import EngineLimits, build_engine, convert_checkpoint
    from serving.engine.quantize import NONE, QuantInfo

    quant = QuantInfo(method=quantization)
    suffix = "" if quant.method == NONE else f"-{quant.method}"
    engine_dir = work / f"engine{suffix}{'-paged' if paged is not None else ''}"
    if (engine_dir / "engine.json").is_file():
        return engine_dir
    if not (work / "hf" / "config.json").is_file():
        hf = random_hf_model(shape, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
        hf.save_pretrained(work / "hf", safe_serialization=True, max_shard_size="1GB")
        del hf
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    ckpt = convert_checkpoint(work / "hf", work / f"ckpt{suffix}", dtype="bfloat16", quantization=quant)
    limits = EngineLimits("bfloat16", max_batch_size=max_batch_size, max_input_len=max_seq_len - 1,
                          max_seq_len=max_seq_len)
    return build_engine(ckpt, engine_dir, limits=limits, quantization=quant, kv_cache=paged).path


def bench_offline_engine(engine_dir: Path, *, batch: int, prompt_len: int, gen_len: int, repeats: int = 3,
                         compile_decode: bool = True, scheduler_requests_per_client: int = 4,
                         out_json: Path | None = None) -> dict[str, Any]:
    """The offline figure the served one is compared with: the SAME engine folder, loaded like the `llm`
    model loads it (compiled decode in CUDA graphs on a GPU), timed by `time_generate` at `batch`; then
    (unless `scheduler_requests_per_client` is 0) `batch` closed-loop clients through the in-flight
    scheduler in this process (`bench_scheduler`: the served workload without Triton)."""
    from dataclasses import asdict

    import torch

    from serving.engine import load_engine
    from serving.engine.timing import time_generate

    t0 = time.perf_counter()
    runner = load_engine(engine_dir, device="auto")
    compiled = compile_decode and runner.device.type == "cuda"
    if compiled:
        runner.compile_decode()
    cell = time_generate(runner, batch=batch, prompt_len=prompt_len, gen_len=gen_len, repeats=repeats,
                         shape=str(engine_dir), impl="engine-compiled" if compiled else "engine-graphs")
    report = {k: v for k, v in asdict(cell).items() if k not in ("tpot_samples_ms", "ttft_samples_ms")}
    if scheduler_requests_per_client > 0:
        from bench.scheduler_bench import bench_scheduler

        sizes = {"clients": batch, "prompt_len": prompt_len, "gen_len": gen_len}
        bench_scheduler(runner, requests_per_client=1, **sizes)  # warm-up: graphs of every bucket it meets
        report["scheduler"] = bench_scheduler(runner, requests_per_client=scheduler_requests_per_client, **sizes)
        report["scheduler_over_e2e"] = report["scheduler"]["output_tok_s"] / report["e2e_tok_s"]
    report.update({"setup_total_s": time.perf_counter() - t0, "device": str(runner.device),
                   "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None})
    if out_json is not None:
        out_json.write_text(json.dumps(report, indent=1))
    return report


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``"label:k=v,k=v"`` (or just ``"label"``) -> (label, parameters of the llm model)."""
    label, _, rest = text.partition(":")
    if not label.isidentifier():
        raise ValueError(f"--variant {text!r}: the label {label!r} must be a plain name (letters, digits, _)")
    params = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--variant {text!r}: {item!r} is not key=value")
        params[key.strip()] = value.strip()
    return label, params


# Triton's own per-model counters around each run: how many execute calls the requests came in, and how
# long they waited in Triton's queue before one (the scheduler's `queued_s` starts only after that)
TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_exec_count", "nv_inference_queue_duration_us")


def triton_counters(metrics_url: str, model: str) -> dict[str, float]:
    """Triton's counters of `model` (all versions), from its metrics endpoint."""
    from serving.triton.metrics import model_counter, scrape

    samples = scrape(metrics_url)
    return {name: model_counter(samples, name, model) for name in TRITON_COUNTERS}


def model_counters(triton_log: Path, model: str) -> dict[str, dict[str, float]]:
    """The scheduler's and the outbox's counters that model `model` logged when it was unloaded."""
    counters: dict[str, dict[str, float]] = {}
    text = triton_log.read_text(errors="replace") if triton_log.is_file() else ""
    for kind, pattern in (("scheduler", r"scheduler (?:Scheduler|Paged)Stats\((.*?)\)"),
                          ("outbox", r"responses sent: OutboxStats\((.*?)\)"),
                          ("intake", r"intake: IntakeStats\((.*?)\)"),
                          ("allocator", r"allocator: ([^\n]*)"),
                          ("first_tokens", r"first tokens: FirstTokenStats\((.*?)\)")):
        found = re.findall(rf"\[{re.escape(model)} v\d+\][^\n]*?{pattern}", text)
        if found:
            counters[kind] = {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.e+]+)", found[-1])}
    return counters


def run_clients(grpc_url: str, model: str, figures: dict[str, Any], *, clients: int, requests_per_client: int,
                prompt_len: int, gen_len: int, vocab: int, get_timeout_s: float, lanes: int = 1,
                warmup_lanes: int = 1, shared_prefix: int = 0) -> None:
    """`clients` streaming client processes started together, each with `lanes` requests in flight on its
    stream (`requests_per_client` one after the other per lane); fills `figures` with the served figures
    and raw samples of the timed requests, after a warm-up round of `warmup_lanes` requests at once per
    client (the offline figures leave their warm-up out too), whose figures go under ``warmup``.
    Interrupted (SIGTERM from a time limit), it fills them from the requests done so far, marked
    ``partial``, stops the clients and re-raises. `shared_prefix`: every prompt starts with the same that many
    tokens (a system prompt; its own tokens after them, at least one)."""
    rng = random.Random(0)
    prefix = [rng.randrange(1, vocab) for _ in range(min(shared_prefix, prompt_len - 1))]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(clients)
    procs = []
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    try:
        for _ in range(clients):
            every = [prefix + [rng.randrange(1, vocab) for _ in range(prompt_len - len(prefix))]
                     for _ in range(requests_per_client * lanes + warmup_lanes)]
            warmup, prompts = every[:warmup_lanes], every[warmup_lanes:]
            p = ctx.Process(target=stream_client, args=(grpc_url, prompts, gen_len, out, barrier, model, warmup, lanes))
            p.start()
            procs.append(p)
        finished = 0
        while finished < clients:
            item = out.get(timeout=get_timeout_s)
            if item is None:
                finished += 1
            else:
                records += item
        for p in procs:
            p.join(30)
    except BaseException as exc:
        _fill(figures, records)
        figures.update(partial=True, interrupted=f"{type(exc).__name__}: {exc}")
        for p in procs:
            p.terminate()
        raise
    _fill(figures, records)
    figures["clients_spawned_s"] = time.perf_counter() - started


def _fill(figures: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """The timed requests' figures, and the warm-up round's (without samples) under ``warmup``."""
    warm = [r for r in records if r.get("warmup")]
    figures.update(summarize([r for r in records if not r.get("warmup")]))
    figures["warmup"] = {k: v for k, v in summarize(warm).items() if k != "samples"}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Served figures of the clients' request records (send time, (arrival, tokens) per response, error)."""
    if not records:
        return {"requests": 0, "output_tokens": 0}
    ok = [r for r in records if r["error"] is None and r["stamps"]]
    first_send = min(r["sent"] for r in records)
    last = max(r["stamps"][-1][0] for r in ok) if ok else time.perf_counter()
    counts = [sum(n for _, n in r["stamps"]) for r in ok]
    tokens = sum(counts)
    ttft = [(r["stamps"][0][0] - r["sent"]) * 1e3 for r in ok]
    tpot = [(r["stamps"][-1][0] - r["stamps"][0][0]) * 1e3 / (n - 1) for r, n in zip(ok, counts) if n > 1]
    itl = [(b[0] - a[0]) * 1e3 for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    responses = sum(len(r["stamps"]) for r in ok)
    return {
        "requests": len(records), "errors": [r["error"] for r in records if r["error"]][:5],
        "n_errors": sum(r["error"] is not None for r in records), "output_tokens": tokens,
        "wall_s": last - first_send, "output_tok_s": tokens / max(last - first_send, 1e-9),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
        "itl_ms_p50": percentile(itl, 50), "itl_ms_p99": percentile(itl, 99),
        "responses": responses, "tokens_per_response": tokens / max(responses, 1),
        "most_in_flight": most_in_flight([(r["sent"], r["stamps"][-1][0]) for r in ok]),
        "samples": {"tokens": counts, "ttft_ms": [round(x, 3) for x in ttft], "tpot_ms": [round(x, 3) for x in tpot],
                    "itl_ms": [round(x, 3) for x in itl[::7]]},
    }


def run_served(*, shape: str, clients: int, requests_per_client: int, prompt_len: int, gen_len: int,
               max_batch_size: int, work: Path, out_json: Path | None = None, compile_decode: bool = True,
               variants: tuple[tuple[str, dict[str, str]], ...] = (("default", {}),),
               load_timeout_s: float = 420.0, wait_for: tuple[Path, ...] = (), wait_timeout_s: float = 300.0,
               offline_json: Path | None = None, get_timeout_s: float = 300.0,
               via_stream_router: bool = False, quantization: str = "none", paged: KVCacheConfig | None = None,
               lanes: int = 1, warmup_lanes: int = 1, shared_prefix: int = 0) -> dict[str, Any]:
    """Each variant (label, extra parameters of the llm model) is staged as model ``bench_<label>`` and
    measured in turn on one Triton: load, the clients, unload (its counters are read from the log).
    The report holds every variant under ``variants``, and the first one's figures at the top level.
    `wait_for`: files that must exist before the first clients start (another job on the GPU finishing);
    `offline_json`: a `bench_offline_engine` report whose e2e/decode tok/s the served figures are set against,
    or a `bench throughput` report (its paged side's output tok/s); `paged`: serve an engine built with that
    paged KV cache; `lanes`: requests each client keeps in flight on its stream; `warmup_lanes`: requests
    each client sends at once in the warm-up round before the timed one (`lanes`: as wide as the timed round);
    `shared_prefix`: leading tokens every prompt shares (`run_clients`);
    `via_stream_router`: after each variant's clients, the same clients again through the release's
    streaming router (``bench_<label>_stream``, the gray release's name for streams), figures under
    ``via_stream_router``."""
    import os
    import signal

    import torch

    from serving.triton import init_repository, stage_engine_version
    from serving.triton.process import start_triton

    def _terminated(signum: int, frame: Any) -> None:  # `timeout` sends SIGTERM: stop Triton, write the JSON
        raise SystemExit(128 + signum)

    previous_handler = signal.signal(signal.SIGTERM, _terminated)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LC_ALL", "C.UTF-8")  # inductor inside the stub reads its sources as UTF-8
    compile_decode = compile_decode and torch.cuda.is_available()
    t0 = time.perf_counter()
    max_seq = -(-(prompt_len + gen_len) // 256) * 256
    engine_dir = build_random_engine(shape, work, max_batch_size=max_batch_size, max_seq_len=max_seq,
                                     quantization=quantization, paged=paged)
    build_s = time.perf_counter() - t0
    root = init_repository(work / "repo")
    base = {"decoupled": "true", "compile_decode": "true" if compile_decode else "false"}
    for label, params in variants:
        # a queue limit no round reaches: the engine queues what it has not admitted (in flight, no batcher)
        stage_engine_version(root, f"{MODEL}_{label}", engine_dir, device_kind="auto",
                             max_queue_size=max(4096, 4 * clients * max(lanes, warmup_lanes)), max_queue_delay_us=100,
                             parameters={**base, **params})
    log_path = work / "triton.log"
    proc = start_triton(root, log_path=log_path, ready_timeout_s=120)
    report: dict[str, Any] = {"shape": shape, "quantization": quantization, "clients": clients, "lanes": lanes,
                              "paged": paged.to_dict() if paged is not None else None,
                              "requests_per_client": requests_per_client, "prompt_len": prompt_len, "gen_len": gen_len, "max_batch_size": max_batch_size,
                              "shared_prefix": shared_prefix,
                              "build_s": build_s, "variants": {}}
    offline = offline_figures(json.loads(offline_json.read_text())) \
        if offline_json is not None and offline_json.is_file() else None
    if offline is not None:
        report["offline"] = offline
    vocab = 128256 if shape.startswith("llama") else 512
    try:
        for i, (label, params) in enumerate(variants):
            model = f"{MODEL}_{label}_v1"
            figures: dict[str, Any] = {"parameters": {**base, **params}}
            report["variants"][label] = figures
            t1 = time.perf_counter()
            proc.control().load_model(model, timeout_s=load_timeout_s)
            figures["load_s"] = time.perf_counter() - t1
            if i == 0:
                waited = time.perf_counter()
                while not all(p.exists() for p in wait_for) and time.perf_counter() - waited < wait_timeout_s:
                    time.sleep(0.5)
                report["waited_s"] = time.perf_counter() - waited
            before = triton_counters(proc.metrics_url, model)
            run_clients(proc.grpc_url, model, figures, clients=clients, requests_per_client=requests_per_client,
                        prompt_len=prompt_len, gen_len=gen_len, vocab=vocab, get_timeout_s=get_timeout_s, lanes=lanes,
                        warmup_lanes=warmup_lanes, shared_prefix=shared_prefix)
            after = triton_counters(proc.metrics_url, model)
            figures["triton"] = {name: after[name] - before[name] for name in TRITON_COUNTERS}  # warm-up included
            if offline is not None:
                figures["served_over_offline_e2e"] = figures["output_tok_s"] / offline["e2e_tok_s"]
                if offline.get("decode_tok_s"):
                    figures["served_over_offline_decode"] = figures["output_tok_s"] / offline["decode_tok_s"]
            if via_stream_router:
                routed = figures["via_stream_router"] = {}
                _run_via_stream_router(proc, root, f"{MODEL}_{label}", routed, clients=clients,
                                       requests_per_client=requests_per_client, prompt_len=prompt_len,
                                       gen_len=gen_len, vocab=vocab, get_timeout_s=get_timeout_s, lanes=lanes,
                                       warmup_lanes=warmup_lanes, shared_prefix=shared_prefix)
                routed["over_direct"] = routed["output_tok_s"] / figures["output_tok_s"]
                if offline is not None:
                    routed["served_over_offline_e2e"] = routed["output_tok_s"] / offline["e2e_tok_s"]
            proc.control().unload_model(model, timeout_s=120)
            figures["counters"] = model_counters(log_path, model)
            if i == 0:
                report.update({k: v for k, v in figures.items() if k != "parameters"})
            if out_json is not None:
                out_json.write_text(json.dumps(report, indent=1))
    finally:
        proc.stop(timeout_s=20)
        if out_json is not None:
            out_json.write_text(json.dumps(report, indent=1))
        signal.signal(signal.SIGTERM, previous_handler)
    return report


def most_in_flight(spans: list[tuple[float, float]]) -> int:
    """The most requests outstanding at once, of (sent, last response) spans."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    return max(itertools.accumulate(step for _, step in events), default=0)


def offline_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The offline report the served figures are set against: a `bench_offline_engine` report as it is, or a
    `bench throughput` report as its paged side's figure ({"e2e_tok_s": its output tok/s, "side": ...})."""
    if "sides" not in report:
        return report
    sides = {side["side"]: side for side in report["sides"]}
    side = next((sides[name] for name in ("paged", "paged-sync") if name in sides), None)
    if side is None:
        raise ValueError(f"the throughput report has no paged side to compare with (sides: {sorted(sides)})")
    return {"e2e_tok_s": side["output_tok_s"], "side": side["side"], "config": report["config"]}


def _run_via_stream_router(proc: Any, root: Path, release: str, figures: dict[str, Any], **clients: Any) -> None:
    """Route release `release` (its llm loaded) 100% to version 1, run the clients against its streaming
    router, then unload both routers."""
    from serving.triton.operations import apply_router_weights
    from serving.triton.repository import stream_model_name

    control = proc.control()
    apply_router_weights(control, root, release, {1: 100}, timeout_s=120)
    try:
        run_clients(proc.grpc_url, stream_model_name(release), figures, **clients)
    finally:
        control.unload_model(stream_model_name(release), timeout_s=120)
        control.unload_model(release, timeout_s=120)
