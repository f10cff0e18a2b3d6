"""Timing `generate` on random prompts: the figures of one workload (batch, prompt, generated tokens).

The release's perf gate (`tasks/perf_gate.py`) times every round with `time_generate`, and the offline
benchmarks (`bench/offline.py`) report the same figures: tokens/s end to end and in decode, TTFT and TPOT
percentiles (CUDA: event timing per step, no host syncs added; CPU: wall time).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (nan for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class CellResult:
    """One (shape, workload, batch, implementation) measurement."""

    shape: str
    impl: str
    batch: int
    prompt_len: int
    gen_len: int
    decode_tok_s: float
    e2e_tok_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    roofline_tok_s: float = float("nan")
    roofline_frac: float = float("nan")
    bandwidth_gb_s: float = float("nan")
    setup_s: float = 0.0  # warm-up, graph capture and compile
    repeats: int = 0
    note: str = ""
    tpot_samples_ms: list[float] = field(default_factory=list)
    ttft_samples_ms: list[float] = field(default_factory=list)

    def row(self) -> str:
        return (f"{self.shape:>13} {self.prompt_len:>4}/{self.gen_len:<4} b={self.batch:<3} {self.impl:<16} "
                f"decode {self.decode_tok_s:>9.0f} tok/s ({self.roofline_frac * 100:5.1f}% roofline "
                f"{self.roofline_tok_s:>8.0f})  e2e {self.e2e_tok_s:>9.0f}  TTFT p50/p99 {self.ttft_ms_p50:7.1f}/"
                f"{self.ttft_ms_p99:7.1f} ms  TPOT p50/p99 {self.tpot_ms_p50:6.2f}/{self.tpot_ms_p99:6.2f} ms  "
                f"setup {self.setup_s:.0f} s {self.note}")


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def random_prompts_of(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """One random prompt per entry of `lengths`, each that many tokens long."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def time_generate(runner: Any, *, batch: int, prompt_len: int, gen_len: int, repeats: int = 3, warmup: int = 1,
                  seed: int = 0, shape: str = "engine", impl: str = "engine",
                  prompts: Sequence[Sequence[int]] | None = None, outputs: list | None = None) -> CellResult:
    """Time `runner.generate` on random prompts (or `prompts`, `batch` and `prompt_len` then only naming the
    cell): the figures of one cell (CUDA: event timing per step). `outputs`, when given, receives the last
    timed repeat's generations (in prompt order: what the timing measured, for a caller to check).

    On the CPU (no events) TPOT is the per-token share of (full - first-token) wall time.
    """
    if prompts is None:
        prompts = random_prompts(batch, prompt_len, runner.info.model.vocab_size, seed)
    cuda = runner.device.type == "cuda"
    started = time.perf_counter()
    for _ in range(warmup):
        runner.generate(prompts, max_new_tokens=gen_len, logprobs=False)
    setup_s = time.perf_counter() - started
    ttfts, tpots, decode_s, e2e_s = [], [], [], []
    for _ in range(repeats):
        events: list = []
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        generated = runner.generate(prompts, max_new_tokens=gen_len, logprobs=False, events=events if cuda else None)
        e2e_s.append(time.perf_counter() - t0)
        if cuda:
            ms = [events[0].elapsed_time(ev) for ev in events[1:]]  # since the start: first token, steps...
            ttfts.append(ms[0])
            tpots += [b - a for a, b in itertools.pairwise(ms)]
            decode_s.append((ms[-1] - ms[0]) / 1e3)
        else:
            t1 = time.perf_counter()
            runner.generate(prompts, max_new_tokens=1, logprobs=False)
            first = time.perf_counter() - t1
            ttfts.append(first * 1e3)
            per = max(e2e_s[-1] - first, 1e-9) / max(gen_len - 1, 1)
            tpots += [per * 1e3] * (gen_len - 1)
            decode_s.append(per * (gen_len - 1))
        if outputs is not None:
            outputs[:] = generated
    return CellResult(
        shape=shape, impl=impl, batch=batch, prompt_len=prompt_len, gen_len=gen_len,
        decode_tok_s=batch * (gen_len - 1) / statistics.median(decode_s),
        e2e_tok_s=batch * gen_len / statistics.median(e2e_s),
        ttft_ms_p50=percentile(ttfts, 50), ttft_ms_p99=percentile(ttfts, 99),
        tpot_ms_p50=percentile(tpots, 50), tpot_ms_p99=percentile(tpots, 99),
        setup_s=setup_s, repeats=repeats, tpot_samples_ms=[round(t, 4) for t in tpots],
        ttft_samples_ms=[round(t, 4) for t in ttfts],
    )
