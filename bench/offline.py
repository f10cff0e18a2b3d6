"""Offline benchmark: the engine against HF transformers (eager; static cache + torch.compile) in one run.

Figures per cell (shape, workload prompt/generated, batch, implementation):
- `decode_tok_s`: B * (N - 1) generated tokens over the decode time (first token to last; prefill out).
- `e2e_tok_s`: B * N over the whole `generate` call (prefill, sampling, host sync included).
- `ttft_ms` p50/p99: start of the call to the first token of the batch; `tpot_ms` p50/p99: time of
  each decode step (engine: CUDA events, no host syncs added; HF: its per-step streamer callback,
  which comes after HF's own per-step sync).
- `roofline_tok_s`: B / ((weight bytes + KV bytes read per step) / copy bandwidth), the bandwidth
  measured in the same run (device-to-device copy, bytes read + written), KV bytes averaged over the
  decode steps (context P + N/2 per sequence); `roofline_frac` = decode_tok_s / roofline_tok_s.

The engine's cells come from `serving.engine.timing.time_generate`, the timer the perf gate runs: it times
any `EngineRunner` on one (batch, prompt, generated) workload and returns the same figures.

Imports: stdlib and torch at import time; transformers lazily (the HF peers only).
"""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from serving.engine.timing import CellResult, percentile, random_prompts, time_generate

DEFAULT_WORKLOADS = ((128, 128), (512, 128), (2048, 128))


def copy_bandwidth_gb_s(device: str = "cuda", nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read + written (GB/s)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * nbytes / seconds / 1e9


def roofline(*, weight_bytes: int, kv_bytes_per_token: int, batch: int, prompt_len: int, gen_len: int,
             bandwidth_gb_s: float) -> float:
    """Decode tokens/s if every decode step only read the weights and the filled KV cache at full bandwidth."""
    step_bytes = weight_bytes + kv_bytes_per_token * batch * (prompt_len + gen_len / 2)
    return batch / (step_bytes / (bandwidth_gb_s * 1e9))


# ---------------------------------------------------------------------------------------------
# the engine


# ---------------------------------------------------------------------------------------------
# Hugging Face peers


class _StepClock:
    """A generate streamer that stamps the host time of every put (HF puts after its per-step sync)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def bench_hf(model: Any, *, batch: int, prompt_len: int, gen_len: int, static: bool, repeats: int = 1,
             warmup: int = 1, seed: int = 0, shape: str = "hf") -> CellResult:
    """Time HF `generate` (greedy, exactly gen_len tokens); `static=True`: static cache (auto-compiled)."""
    prompts = random_prompts(batch, prompt_len, model.config.vocab_size, seed)
    ids = torch.tensor(prompts, device=model.device)
    kwargs: dict[str, Any] = {"max_new_tokens": gen_len, "min_new_tokens": gen_len, "do_sample": False,
                              "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
    if static:
        kwargs["cache_implementation"] = "static"
    started = time.perf_counter()
    with torch.no_grad():
        for _ in range(warmup):  # eager needs no full-length warm-up; static compiles for these shapes
            model.generate(ids, **(kwargs if static else {**kwargs, "max_new_tokens": 4, "min_new_tokens": 4}))
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - started
    ttfts, tpots, decode_s, e2e_s = [], [], [], []
    for _ in range(repeats):
        clock = _StepClock()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, streamer=clock, **kwargs)
        torch.cuda.synchronize()
        e2e_s.append(time.perf_counter() - t0)
        stamps = clock.stamps[1:]  # the first put is the prompt
        ttfts.append((stamps[0] - t0) * 1e3)
        tpots += [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]
        decode_s.append(stamps[-1] - stamps[0])
    return CellResult(
        shape=shape, impl="hf-static-compile" if static else "hf-eager", batch=batch, prompt_len=prompt_len,
        gen_len=gen_len, decode_tok_s=batch * (gen_len - 1) / statistics.median(decode_s),
        e2e_tok_s=batch * gen_len / statistics.median(e2e_s),
        ttft_ms_p50=percentile(ttfts, 50), ttft_ms_p99=percentile(ttfts, 99),
        tpot_ms_p50=percentile(tpots, 50), tpot_ms_p99=percentile(tpots, 99), setup_s=setup_s, repeats=repeats,
        tpot_samples_ms=[round(t, 4) for t in tpots],
    )


# ---------------------------------------------------------------------------------------------
# correctness beside the speed (same weights)


@torch.no_grad()
def check_against_hf(hf_model: Any, runner: Any, *, prompt_len: int = 64, gen_len: int = 32, seed: int = 1
                     ) -> dict[str, Any]:
    """Prefill logits vs HF (max abs error, top-1 agreement) and greedy generations (where they diverge,
    is each side's token in the other's top-5, like vLLM's check_logprobs_close)."""
    prompts = random_prompts(2, prompt_len, hf_model.config.vocab_size, seed)
    ref = hf_model(torch.tensor(prompts[:1], device=hf_model.device)).logits[0].float().cpu()
    got = runner.prefill_logits(prompts[0])
    out: dict[str, Any] = {
        "prefill_max_abs_err": float((ref - got).abs().max()),
        "prefill_ref_max_abs": float(ref.abs().max()),
        "prefill_top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
    }
    hf_ids = hf_model.generate(torch.tensor(prompts, device=hf_model.device), max_new_tokens=gen_len,
                               min_new_tokens=gen_len, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones(2, prompt_len, dtype=torch.long, device=hf_model.device),
                               output_scores=True, return_dict_in_generate=True)
    hf_tokens = hf_ids.sequences[:, prompt_len:].tolist()
    hf_top = torch.stack(hf_ids.scores, 1).topk(5, dim=-1).indices.tolist()  # [B, T, 5]
    gens = runner.generate(prompts, max_new_tokens=gen_len, top_logprobs=5)
    seqs = []
    for b, gen in enumerate(gens):
        first_diff = next((t for t, (x, y) in enumerate(zip(hf_tokens[b], gen.token_ids)) if x != y), None)
        ok = first_diff is None or (gen.token_ids[first_diff] in hf_top[b][first_diff]
                                    and hf_tokens[b][first_diff] in gen.top_logprobs[first_diff])
        seqs.append({"identical_prefix": gen_len if first_diff is None else first_diff, "close": ok})
    out["greedy"] = seqs
    out["greedy_pass"] = all(s["close"] for s in seqs)
    return out


# ---------------------------------------------------------------------------------------------
# the whole offline run


@dataclass
class OfflineConfig:
    shapes: tuple[str, ...] = ("llama-3.2-1b", "llama-3.1-8b")
    workloads: tuple[tuple[int, int], ...] = DEFAULT_WORKLOADS
    batch_sizes: tuple[int, ...] = (1, 64)
    peers: tuple[str, ...] = ("hf-eager", "hf-static-compile")  # run on `peer_workloads` only
    peer_workloads: tuple[tuple[int, int], ...] = ((128, 128),)
    repeats: int = 3
    dtype: str = "bfloat16"
    deadline_s: float = 1e9  # skip cells that would start after this many seconds
    check: bool = True  # logits / greedy against HF on the same weights


def run_offline(cfg: OfflineConfig, *, out_json: Path | None = None,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every cell of `cfg`, HF peers beside the engine on the same weights; JSON rewritten after each cell."""
    from bench.models import (
        kv_bytes_per_token,
        model_args,
        random_hf_model,
        runner_from_hf,
        weight_bytes,
    )
    from serving.engine.build import EngineLimits

    t_start = time.perf_counter()
    dtype = getattr(torch, cfg.dtype)
    report: dict[str, Any] = {"config": asdict(cfg), "device": torch.cuda.get_device_name(0),
                              "torch": torch.__version__, "cells": [], "checks": {}, "skipped": [], "errors": []}
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        report["transformers"] = None
    bw = copy_bandwidth_gb_s()
    report["copy_bandwidth_gb_s"] = bw
    log(f"copy bandwidth {bw:.0f} GB/s (read + write)")

    def save() -> None:
        if out_json is not None:
            out_json.write_text(json.dumps(report, indent=1))

    def late(what: str) -> bool:
        if time.perf_counter() - t_start > cfg.deadline_s:
            report["skipped"].append(what)
            log(f"skipped (deadline): {what}")
            save()
            return True
        return False

    for shape in cfg.shapes:
        if late(shape):
            continue
        args = model_args(shape)
        wbytes, kvbytes = weight_bytes(args, dtype), kv_bytes_per_token(args, dtype)
        max_seq = max(p + g for p, g in cfg.workloads)
        limits = EngineLimits(cfg.dtype, max_batch_size=max(cfg.batch_sizes), max_input_len=max_seq - 1,
                              max_seq_len=max_seq)
        hf = random_hf_model(shape, dtype=dtype, device="cuda")
        runner = runner_from_hf(hf, args, limits)

        def record(cell: CellResult, wbytes: int = wbytes, kvbytes: int = kvbytes) -> None:
            cell.bandwidth_gb_s = bw
            cell.roofline_tok_s = roofline(weight_bytes=wbytes, kv_bytes_per_token=kvbytes, batch=cell.batch,
                                           prompt_len=cell.prompt_len, gen_len=cell.gen_len, bandwidth_gb_s=bw)
            cell.roofline_frac = cell.decode_tok_s / cell.roofline_tok_s
            report["cells"].append(asdict(cell))
            log(cell.row())
            save()

        def attempt(what: str, fn: Callable[..., CellResult], *args: Any, **kwargs: Any) -> None:
            if late(what):
                return
            try:
                record(fn(*args, **kwargs))
            except Exception as exc:  # noqa: BLE001 - one failed cell must not lose the others
                report["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
                log(f"FAILED {what}: {type(exc).__name__}: {exc}")
                save()

        if cfg.check:
            try:
                report["checks"][shape] = check_against_hf(hf, runner)
                log(f"{shape} vs HF: {report['checks'][shape]}")
            except Exception as exc:  # noqa: BLE001
                report["errors"].append(f"{shape} check: {type(exc).__name__}: {exc}")
            save()
        for p, g in cfg.workloads:
            for b in cfg.batch_sizes:
                attempt(f"{shape} {p}/{g} b={b} engine-graphs", time_generate, runner, batch=b, prompt_len=p,
                        gen_len=g, repeats=cfg.repeats, shape=shape, impl="engine-graphs")
        for p, g in cfg.peer_workloads:
            for b in cfg.batch_sizes:
                for peer in cfg.peers:
                    attempt(f"{shape} {p}/{g} b={b} {peer}", bench_hf, hf, batch=b, prompt_len=p, gen_len=g,
                            static=peer == "hf-static-compile", repeats=1, shape=shape)
                    torch._dynamo.reset()

        runner = hf = None
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    report["wall_s"] = time.perf_counter() - t_start
    save()
    return report


def render_table(report: dict[str, Any]) -> str:
    """Markdown: one row per (shape, workload, batch) with every implementation side by side."""
    cells = report["cells"]
    keys = sorted({(c["shape"], c["prompt_len"], c["gen_len"], c["batch"]) for c in cells})
    impls = ["hf-eager", "hf-static-compile", "engine-graphs"]
    lines = [("| shape | P/N | batch | HF eager e2e | HF static+compile e2e | engine decode | engine e2e | "
              "roofline tok/s | engine % roofline | engine TTFT p50/p99 ms | engine TPOT p50/p99 ms |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape, p, g, b in keys:
        by = {c["impl"]: c for c in cells if (c["shape"], c["prompt_len"], c["gen_len"], c["batch"]) == (shape, p, g, b)}
        ours = [by[i] for i in impls[2:] if i in by]
        best = max(ours, key=lambda c: c["decode_tok_s"]) if ours else None

        def e2e(i: str, by: dict = by) -> str:
            return f"{by[i]['e2e_tok_s']:,.0f}" if i in by else "-"

        if best is None:
            lines.append(f"| {shape} | {p}/{g} | {b} | {e2e('hf-eager')} | {e2e('hf-static-compile')} | - | - | - | - | - | - |")
            continue
        lines.append(
            f"| {shape} | {p}/{g} | {b} | {e2e('hf-eager')} | {e2e('hf-static-compile')} | "
            f"{best['decode_tok_s']:,.0f} ({best['impl']}) | {best['e2e_tok_s']:,.0f} | {best['roofline_tok_s']:,.0f} | "
            f"{best['roofline_frac'] * 100:.1f}% | {best['ttft_ms_p50']:.1f}/{best['ttft_ms_p99']:.1f} | "
            f"{best['tpot_ms_p50']:.2f}/{best['tpot_ms_p99']:.2f} |")
    return "\n".join(lines)
