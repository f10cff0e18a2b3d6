"""The perf gate through ``trtllm-bench``: dataset JSONL, the throughput command line, and its report.

Dataset (docs/source/developer-guide/perf-benchmarking.md, "Preparing a Dataset"): one JSON object per
line with ``task_id``, ``input_ids`` (or ``prompt``, never both) and ``output_tokens``.
The report is the text ``trtllm-bench throughput`` prints: sections headed ``= NAME`` between rules of
``=``, lines ``Key (unit): value``, and percentile blocks ``[Latency] P50 : value``.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from serving.trtllm.errors import TrtllmBenchError
from serving.trtllm.flags import TRTLLM_BENCH, check_command
from serving.trtllm.steps import run_step

_SECTION = re.compile(r"^=\s+(?P<name>[A-Z][A-Z0-9 +/()_-]*?)\s*$")
_KEY_VALUE = re.compile(r"^(?P<key>[A-Za-z][^:]*?)\s*:\s+(?P<value>\S.*?)\s*$")
_PERCENTILE = re.compile(r"^\[(?P<metric>[A-Za-z ]+)\]\s+(?P<stat>[A-Z0-9]+)\s*:\s*(?P<value>[-+0-9.eE]+)\s*$")
# report keys -> our metric names (what the perf gate compares)
METRIC_KEYS = {
    "Request Throughput (req/sec)": "requests_per_s",
    "Total Output Throughput (tokens/sec)": "output_tokens_per_s",
    "Token Throughput (tokens/sec)": "output_tokens_per_s",          # older report wording
    "Total Token Throughput (tokens/sec)": "total_tokens_per_s",
    "Per User Output Throughput (tokens/sec/user)": "output_tokens_per_s_per_user",
    "Per GPU Output Throughput (tokens/sec/gpu)": "output_tokens_per_s_per_gpu",
    "Total Latency (ms)": "total_latency_ms",
    "Average request latency (ms)": "request_latency_avg_ms",
    "Average time-to-first-token [TTFT] (ms)": "ttft_avg_ms",
    "Average time-per-output-token [TPOT] (ms)": "tpot_avg_ms",
    "Number of requests": "num_requests",
    "Average Input Length (tokens)": "input_len_avg",
    "Average Output Length (tokens)": "output_len_avg",
}
PERCENTILE_PREFIX = {"Latency": "request_latency", "TTFT": "ttft", "TPOT": "tpot", "GEN": "generation_latency",
                     "ITL": "itl"}


def write_bench_dataset(path: Path, prompts: list[list[int]], output_tokens: int | list[int]) -> Path:
    """Write ``prompts`` (token ids) as trtllm-bench JSONL; ``output_tokens`` per request or for all."""
    outs = output_tokens if isinstance(output_tokens, list) else [output_tokens] * len(prompts)
    if len(outs) != len(prompts) or not prompts:
        raise TrtllmBenchError(f"dataset needs one output_tokens per prompt and at least one prompt "
                               f"({len(prompts)} prompts, {len(outs)} output_tokens)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, (ids, n) in enumerate(zip(prompts, outs)):
            if not ids or int(n) < 1:
                raise TrtllmBenchError(f"request {i}: empty prompt or output_tokens={n} < 1")
            f.write(json.dumps({"task_id": i, "input_ids": [int(t) for t in ids], "output_tokens": int(n)},
                               separators=(",", ":")) + "\n")
    return path


def synthetic_prompts(*, count: int, input_len: int, vocab_size: int, seed: int = 0,
                      reserved: int = 3) -> list[list[int]]:
    """Seeded random prompts of ``input_len`` ids in ``[reserved, vocab_size)`` (skips special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(reserved, vocab_size) for _ in range(input_len)] for _ in range(count)]


def read_bench_dataset(path: Path) -> list[dict[str, Any]]:
    """Read and check a dataset file (the documented schema); return its entries."""
    entries = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        e = json.loads(line)
        if "task_id" not in e or "output_tokens" not in e or (("input_ids" in e) == ("prompt" in e)):
            raise TrtllmBenchError(f"{path}:{n}: needs task_id, output_tokens and exactly one of input_ids/prompt")
        entries.append(e)
    return entries


def bench_command(*, model: str, dataset: Path, engine_dir: Path | None = None, model_path: Path | None = None,
                  backend: str = "tensorrt", max_batch_size: int | None = None, max_num_tokens: int | None = None,
                  kv_cache_free_gpu_mem_fraction: float | None = None, concurrency: int | None = None,
                  num_requests: int | None = None, warmup: int | None = None, streaming: bool = True,
                  extra_llm_api_options: Path | None = None, report_json: Path | None = None,
                  tp: int = 1, pp: int = 1, executable: str = "trtllm-bench") -> list[str]:
    """``trtllm-bench --model M [--model_path P] throughput --dataset D [--engine_dir E] ...`` (checked)."""
    argv = [executable, "--model", model]
    if model_path is not None:
        argv += ["--model_path", str(model_path)]
    argv += ["throughput", "--dataset", str(dataset), "--backend", backend]
    if engine_dir is not None:
        argv += ["--engine_dir", str(engine_dir)]
    for flag, value in (("--max_batch_size", max_batch_size), ("--max_num_tokens", max_num_tokens),
                        ("--kv_cache_free_gpu_mem_fraction", kv_cache_free_gpu_mem_fraction),
                        ("--concurrency", concurrency), ("--num_requests", num_requests), ("--warmup", warmup),
                        ("--extra_llm_api_options", extra_llm_api_options), ("--report_json", report_json)):
        if value is not None:
            argv += [flag, str(value)]
    if tp != 1:
        argv += ["--tp", str(tp)]
    if pp != 1:
        argv += ["--pp", str(pp)]
    if streaming:
        argv.append("--streaming")
    check_command(argv, TRTLLM_BENCH)
    return argv


def _number(text: str) -> float | str:
    token = text.split()[0].rstrip("%")
    try:
        return float(token)
    except ValueError:
        return text


def parse_bench_report(text: str) -> dict[str, Any]:
    """Parse the text report: ``{"sections": {name: {key: value}}, "metrics": {our_name: float}}``.

    Raises ``TrtllmBenchError`` when no PERFORMANCE OVERVIEW section or throughput is found.
    """
    sections: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    metrics: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or set(line) <= set("=-"):
            continue
        m = _SECTION.match(line)
        if m:
            current = sections.setdefault(m.group("name").strip(), {})
            continue
        m = _PERCENTILE.match(line)
        if m:
            prefix = PERCENTILE_PREFIX.get(m.group("metric").strip(), m.group("metric").strip().lower())
            stat = {"MINIMUM": "min", "MAXIMUM": "max", "AVERAGE": "avg"}.get(m.group("stat"), m.group("stat").lower())
            metrics[f"{prefix}_{stat}_ms"] = float(m.group("value"))
            continue
        m = _KEY_VALUE.match(line)
        if m and current is not None:
            key, value = m.group("key").strip(), _number(m.group("value"))
            current[key] = value
            if key in METRIC_KEYS and isinstance(value, float):
                metrics.setdefault(METRIC_KEYS[key], value)
    if "PERFORMANCE OVERVIEW" not in sections or "output_tokens_per_s" not in metrics:
        raise TrtllmBenchError("trtllm-bench output has no PERFORMANCE OVERVIEW section with an output "
                               "throughput; was the run cut short? (see its log)")
    return {"sections": sections, "metrics": metrics}


def run_trtllm_bench(argv: list[str], *, log_path: Path, timeout_s: float,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run a ``bench_command`` and parse its report from the captured log."""
    run_step(argv, what="trtllm-bench", log_path=log_path, timeout_s=timeout_s, progress=progress,
             setting="perf.timeout_s")
    return parse_bench_report(Path(log_path).read_text(errors="replace"))


if __name__ == "__main__":  # python -m serving.trtllm.bench REPORT.txt -> metrics as JSON
    print(json.dumps(parse_bench_report(Path(sys.argv[1]).read_text())["metrics"], indent=2))
