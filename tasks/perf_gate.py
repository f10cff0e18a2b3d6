"""Gate 2, first version: throughput, TTFT and TPOT of the engine on a fixed workload, against SLOs.

TTFT is timed as a batched prefill that yields the first token; TPOT as the extra time of a full
generation over that prefill, per further token. Iterations alternate the two calls so drift hits both.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prefect import task
from pydantic import BaseModel, ConfigDict, Field

from tasks.errors import GateFailed


class PerfSlo(BaseModel):
    """Absolute service-level objectives; a bound left unset is not checked."""

    model_config = ConfigDict(extra="forbid")

    min_output_tokens_per_s: float | None = Field(None, gt=0, description="Least output tokens per second.")
    max_ttft_p50_ms: float | None = Field(None, gt=0, description="Largest median time to first token, ms.")
    max_ttft_p99_ms: float | None = Field(None, gt=0, description="Largest p99 time to first token, ms.")
    max_tpot_p50_ms: float | None = Field(None, gt=0, description="Largest median time per output token, ms.")


class PerfSpec(BaseModel):
    """The fixed workload of the performance gate and the SLOs it must meet."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(4, ge=1, description="Concurrent sequences per generate call.")
    input_len: int = Field(32, ge=1, description="Prompt length in tokens (random token ids, seeded).")
    output_len: int = Field(32, ge=2, description="Generated tokens per sequence.")
    warmup: int = Field(1, ge=0, description="Untimed iterations before measuring.")
    iterations: int = Field(5, ge=1, description="Timed iterations.")
    seed: int = Field(0, description="Seed of the random prompts.")
    slo: PerfSlo = Field(default_factory=PerfSlo, description="Absolute objectives the engine must meet.")


@dataclass
class PerfResult:
    passed: bool
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    workload: dict
    failures: list[str]
    ttft_samples_ms: list[float] = field(default_factory=list)
    tpot_samples_ms: list[float] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        return {
            "perf_output_tokens_per_s": self.output_tokens_per_s,
            "perf_ttft_p50_ms": self.ttft_p50_ms,
            "perf_ttft_p99_ms": self.ttft_p99_ms,
            "perf_tpot_p50_ms": self.tpot_p50_ms,
            "perf_tpot_p99_ms": self.tpot_p99_ms,
        }

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "metrics": self.metrics}, indent=2)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def measure_engine(engine_dir: Path, spec: PerfSpec) -> PerfResult:
    """Time the workload on the engine with the benchmark harness (`serving.bench.offline.bench_engine`,
    the same code as `enginewright bench`: CUDA events per step on a GPU, wall clock on the CPU) and
    judge the figures against the SLOs. Throughput is end-to-end output tokens/s (prefill included)."""
    from serving.bench.offline import bench_engine
    from serving.engine import load_engine

    runner = load_engine(engine_dir)
    cell = bench_engine(runner, batch=spec.batch_size, prompt_len=spec.input_len, gen_len=spec.output_len,
                        repeats=spec.iterations, warmup=spec.warmup, seed=spec.seed, impl="perf-gate")
    result = PerfResult(
        passed=True,
        output_tokens_per_s=cell.e2e_tok_s,
        ttft_p50_ms=cell.ttft_ms_p50,
        ttft_p99_ms=cell.ttft_ms_p99,
        tpot_p50_ms=cell.tpot_ms_p50,
        tpot_p99_ms=cell.tpot_ms_p99,
        workload=spec.model_dump(exclude={"slo"}),
        failures=[],
        ttft_samples_ms=list(cell.ttft_samples_ms),
        tpot_samples_ms=list(cell.tpot_samples_ms),
    )
    result.failures = check_slos(result, spec.slo)
    result.passed = not result.failures
    return result


def check_slos(result: PerfResult, slo: PerfSlo) -> list[str]:
    """One line per SLO the figures miss, naming the figure and the setting."""
    checks = [
        ("output tokens/s", result.output_tokens_per_s, slo.min_output_tokens_per_s, "min_output_tokens_per_s", True),
        ("TTFT p50 ms", result.ttft_p50_ms, slo.max_ttft_p50_ms, "max_ttft_p50_ms", False),
        ("TTFT p99 ms", result.ttft_p99_ms, slo.max_ttft_p99_ms, "max_ttft_p99_ms", False),
        ("TPOT p50 ms", result.tpot_p50_ms, slo.max_tpot_p50_ms, "max_tpot_p50_ms", False),
    ]
    failures = []
    for label, value, bound, setting, is_floor in checks:
        if bound is None:
            continue
        if (value < bound) if is_floor else (value > bound):
            relation = "<" if is_floor else ">"
            failures.append(f"{label} {value:.2f} {relation} perf.slo.{setting} {bound}")
    return failures


def render_report(result: PerfResult) -> str:
    """Markdown table of the figures."""
    return (
        f"# Performance gate: {'PASSED' if result.passed else 'FAILED'}\n\n"
        + "".join(f"- {f}\n" for f in result.failures)
        + "\n| figure | value |\n| --- | --- |\n"
        + f"| output tokens/s | {result.output_tokens_per_s:.1f} |\n"
        + f"| TTFT p50 / p99 ms | {result.ttft_p50_ms:.2f} / {result.ttft_p99_ms:.2f} |\n"
        + f"| TPOT p50 / p99 ms | {result.tpot_p50_ms:.2f} / {result.tpot_p99_ms:.2f} |\n"
        + f"\nWorkload: `{json.dumps(result.workload)}`\n"
    )


def require_passed(result: PerfResult) -> None:
    """Raise GateFailed with the report when an SLO is missed."""
    if not result.passed:
        raise GateFailed("performance", "; ".join(result.failures), render_report(result))


@task(name="perf-gate", retries=0)
def perf_gate_task(engine_dir: Path, spec: PerfSpec) -> PerfResult:
    """Measure the engine on the fixed workload and check the SLOs."""
    return measure_engine(engine_dir, spec)
