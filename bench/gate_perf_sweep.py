"""The perf A/B's refusal rates, measured: the same engine on both sides (A vs A, and a rebuild with another
max_batch_size) many times on whatever load the machine has, a truly slower engine (every call done twice:
tests/gate_faults.py's SlowedRunner) and an engine that raises. For each A vs A run the rule the gate used
before (a Student-t interval of single AB rounds, looked at after every round from `iterations` on) is
replayed on the same timings, so the two rules are compared on identical data.

    .venv/bin/python bench/gate_perf_sweep.py --repeats 40
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # gate_faults, a test helper

from gate_faults import SlowedRunner

from serving.engine import build_engine, convert_checkpoint, load_engine
from serving.engine.build import EngineLimits
from tasks.fault_injection import FaultyRunner
from tasks.perf_gate import PerfSpec, _Timer, compare_runners
from tasks.tiny_model import make_tiny_model

CI_SPEC = PerfSpec(batch_size=2, input_len=8, output_len=8, warmup=1, iterations=4, max_iterations=12)


def old_rule_refuses(log_ratios: list[float], spec: PerfSpec) -> bool:
    """The rule before: t-interval of the log ratios after every round from `iterations` on; refused when the
    interval lies below the budget, or undecided at the end with the interval below 1 and the mean below it."""
    from scipy.stats import t

    budget = 1.0 - spec.max_slowdown
    mean = low = high = 0.0
    for n in range(2, len(log_ratios) + 1):
        xs = log_ratios[:n]
        mean = statistics.fmean(xs)
        half = t.ppf(0.5 + spec.confidence / 2, n - 1) * statistics.stdev(xs) / math.sqrt(n)
        low, high = math.exp(mean - half), math.exp(mean + half)
        if n >= spec.iterations and (low > budget or high < budget):
            return high < budget
    return low <= budget <= high and math.exp(mean) < budget and high < 1.0


class RecordingTimer(_Timer):
    """The gate's own timer, keeping each iteration's throughput in order (for the old rule's replay)."""

    log: ClassVar[list[tuple[int, float | None]]] = []

    def once(self, *, record: bool = True) -> float | None:
        got = super().once(record=record)
        if record:
            RecordingTimer.log.append((id(self), got))
        return got


def old_rule_on(log: list[tuple[int, float | None]], cand_id: int, spec: PerfSpec) -> bool:
    """Replays single AB rounds from the recorded ABBA sequence: consecutive (candidate, production) pairs."""
    ratios = []
    for (a, x), (b, y) in zip(log[0::2], log[1::2]):
        if x and y:
            c, p = (x, y) if a == cand_id else (y, x)
            ratios.append(math.log(c / p))
    return old_rule_refuses(ratios[:spec.max_iterations], spec)


def run_ab(candidate, production, spec: PerfSpec) -> tuple[object, bool]:
    import tasks.perf_gate as gate

    RecordingTimer.log = []
    gate._Timer, original = RecordingTimer, gate._Timer
    try:
        result = compare_runners(candidate, production, spec, production_version="p")
    finally:
        gate._Timer = original
    cand_id = RecordingTimer.log[0][0] if RecordingTimer.log else 0
    return result, old_rule_on(RecordingTimer.log, cand_id, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40, help="A vs A runs per pairing.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="perf-sweep-"))
    hf = make_tiny_model(root / "hf", seed=3)
    ckpt = convert_checkpoint(hf, root / "ckpt", dtype="float32")
    engines = {b: Path(build_engine(ckpt, root / f"engine-b{b}", limits=EngineLimits(
        dtype="float32", max_batch_size=b, max_input_len=64, max_seq_len=128)).path) for b in (4, 8)}
    out: dict[str, dict] = {}
    pairings = {"A vs A": (engines[4], engines[4]), "b8 vs b4 (a rebuild)": (engines[8], engines[4])}
    for label, (cand_dir, prod_dir) in pairings.items():
        cand, prod = load_engine(cand_dir), load_engine(prod_dir)
        new = old = inconclusive = 0
        ratios, rounds = [], []
        t0 = time.monotonic()
        for i in range(args.repeats):
            result, old_refused = run_ab(cand, prod, CI_SPEC)
            new += not result.passed
            old += old_refused
            inconclusive += result.inconclusive
            ratios.append(result.throughput_ratio)
            rounds.append(len(result.production.round_tokens_per_s) // 2)
            print(f"{label} #{i}: ratio {result.throughput_ratio:.3f} interval {result.ratio_interval} "
                  f"{'REFUSED' if not result.passed else 'pass'}{' (inconclusive)' if result.inconclusive else ''}; "
                  f"old rule {'REFUSED' if old_refused else 'pass'}; load {os.getloadavg()[0]:.1f}", flush=True)
        out[label] = {"runs": args.repeats, "refused": new, "refused_by_the_old_rule": old,
                      "inconclusive": inconclusive, "median_ratio": statistics.median(ratios),
                      "ratio_range": [min(ratios), max(ratios)], "rounds_median": statistics.median(rounds),
                      "seconds": round(time.monotonic() - t0, 1)}
    production = load_engine(engines[4])
    for label, candidate in (("2x slower (every call twice)", SlowedRunner(load_engine(engines[4]), factor=2)),):
        refused = 0
        for _ in range(max(5, args.repeats // 4)):
            result, _ = run_ab(candidate, production, CI_SPEC)
            refused += not result.passed
            print(f"{label}: ratio {result.throughput_ratio:.3f} {'REFUSED' if not result.passed else 'pass'}: "
                  f"{result.stopped}", flush=True)
        out[label] = {"runs": max(5, args.repeats // 4), "refused": refused}
    failing = FaultyRunner(load_engine(engines[4]), {"error_rate": 0.25})
    result, _ = run_ab(failing, production, CI_SPEC)
    print(f"error rate 0.25: {'REFUSED' if not result.passed else 'pass'}: {result.failures}", flush=True)
    out["errors 25%"] = {"refused": not result.passed, "failures": result.failures}
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
