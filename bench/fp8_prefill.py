"""The fp8 engine's prefill GEMMs alone, and whole eager prefills, beside bf16 (CUDA).

`python3 -m bench fp8-prefill --shape llama-3.1-8b --rows 128` asks where an fp8 prefill of a few
tokens loses to bf16 (8B, one 128-token prompt: TTFT 48.9 ms against 26.0 on an H200). Per projection
(wqkv, wo, w13, w2) at `rows` rows, each variant of the GEMM three ways:

- `gpu_us`: launched from a CUDA graph with the weights cold in L2 (the device's time alone);
- `eager_us`: called eagerly back to back, per call, until the device is done (what an eager prefill pays);
- `host_us`: the same calls' host time alone, before the device is waited for.

Variants: bf16 F.linear on the bf16 weight; the engine's `quantize.fp8_scaled_linear`; its pieces (the
tokens' scaling kernel alone, launched directly and through its registered op; `_scaled_mm` row-wise on
pre-scaled tokens, with `use_fast_accum`, and tensor-wise with unit scales, the GEMM cuBLAS runs); and
`PREFILL_CANDIDATES` (each an `fp8_scaled_linear` replacement, its error against the engine's beside it).

Then whole prefills of a random `shape` engine (all its layers) at batch 1 and 64: bf16, the fp8 engine,
each also with its norms and SiLU * up as torch ops rather than the row kernels (`row_norm`, `silu_mul`), and the fp8 engine with each
candidate patched in (`mock.patch` of `quantize.fp8_scaled_linear`), timed as the device sees them (events,
median of `repeats`) and as the host does. Last, torch.profiler tables: the fp8 prefill at batch 1 (host
time by op), and each engine's prefill at the largest batch (kernels by device time).

Imports: stdlib and torch at import time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from serving.engine.quantize import fp8_scaled_linear as ENGINE_LINEAR  # bound before any patch

EAGER_CALLS = 40
GEMMS = ("wqkv", "wo", "w13", "w2")


def _scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               fast: bool = False) -> torch.Tensor:
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16,
                            use_fast_accum=fast)


def _with_tokens(tokens: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], *, fast: bool = False
                 ) -> Callable[..., torch.Tensor]:
    """An `fp8_scaled_linear` whose tokens are scaled by `tokens`, `_scaled_mm` row-wise (`fast`: fast accum)."""

    def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        xq, x_scale = tokens(x.reshape(-1, shape[-1]))
        y = _scaled_mm(xq, x_scale, weight, scale, fast)
        return (y if bias is None else y + bias).view(*shape[:-1], weight.shape[0])

    return linear


def _op_tokens(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from serving.engine import fp8_tokens

    return fp8_tokens.tokens_e4m3_op(x2, 448.0)


def _kernel_tokens(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from serving.engine import fp8_tokens

    return fp8_tokens.tokens_e4m3(x2, 448.0)


def linear_split_k_chunks(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The split-K FP8 decode kernel on 64-row chunks (its 64-row config in the device's `fp8` table), up to 256
    rows; more rows, or a shape not in the table: the engine's `fp8_scaled_linear`."""
    from serving.engine.fp8_gemm import launch_fp8
    from serving.engine.partials import sum_partials
    from serving.engine.tuned_tables import tables_for

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    config = tables_for(x.device).fp8.get((64, weight.shape[0], weight.shape[1]))
    if config is None or x2.shape[0] > 256 or bias is not None:
        return ENGINE_LINEAR(x, weight, scale, bias)  # (not the patched name: that is this function)
    xq, x_scale = _kernel_tokens(x2)
    parts = [sum_partials(launch_fp8(xq[lo:lo + 64], x_scale[lo:lo + 64], weight, scale, config), x.dtype)
             for lo in range(0, x2.shape[0], 64)]
    return torch.cat(parts).view(*shape[:-1], weight.shape[0])


# `fp8_scaled_linear` replacements, each timed alone and patched into whole prefills
PREFILL_CANDIDATES: dict[str, Callable[..., torch.Tensor]] = {
    "tokens-op (before)": _with_tokens(_op_tokens),
    "fast-accum": _with_tokens(_kernel_tokens, fast=True),
    "split-k-64-chunks": linear_split_k_chunks,
}


def _cold(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> dict[str, float]:
    """gpu_us (graph, cold L2), eager_us and host_us per call of fn(weight) over `weights` in turn."""
    from serving.engine.cuda_timing import graph_time_us

    copies = itertools.cycle(weights)
    gpu = graph_time_us(lambda: fn(next(copies)), calls=24, replays=3, warmup=2)
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    eager, host = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(EAGER_CALLS):
            fn(next(copies))
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / EAGER_CALLS * 1e6)
        eager.append((t2 - t0) / EAGER_CALLS * 1e6)
    return {"gpu_us": gpu, "eager_us": statistics.median(eager), "host_us": statistics.median(host)}


def gemm_cell(rows: int, n: int, k: int) -> dict[str, Any]:
    """Every variant of one prefill GEMM [rows, k] x [n, k]^T."""
    from bench.fp8_sweep import cold_bf16_weights, fp8_copies
    from serving.engine.quantize import fp8_scaled_linear, quantize_tokens_fp8, tokens_to_e4m3

    bf16, copies = cold_bf16_weights(n, k, least=2)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    cell: dict[str, Any] = {"rows": rows, "n": n, "k": k, "variants": {}}
    v = cell["variants"]
    v["bf16 F.linear"] = _cold(lambda w: torch.nn.functional.linear(x, w), bf16)
    weights, scales = fp8_copies(bf16, copies)
    del bf16
    xq, xs = quantize_tokens_fp8(x)
    one = torch.ones((), device="cuda", dtype=torch.float32)
    ref = fp8_scaled_linear(x, weights[0], scales[id(weights[0])], None).float()
    v["fp8 engine (fp8_scaled_linear)"] = _cold(lambda w: fp8_scaled_linear(x, w, scales[id(w)], None), weights)
    v["tokens kernel alone"] = _cold(lambda w: tokens_to_e4m3(x), weights)
    v["tokens through the op alone"] = _cold(lambda w: _op_tokens(x), weights)
    v["_scaled_mm rowwise"] = _cold(lambda w: _scaled_mm(xq, xs, w, scales[id(w)]), weights)
    v["_scaled_mm rowwise fast"] = _cold(lambda w: _scaled_mm(xq, xs, w, scales[id(w)], fast=True), weights)
    v["_scaled_mm tensorwise"] = _cold(
        lambda w: torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), weights)
    for name, fn in PREFILL_CANDIDATES.items():
        out = fn(x, weights[0], scales[id(weights[0])], None).float()
        v[f"candidate {name}"] = {**_cold(lambda w, f=fn: f(x, w, scales[id(w)], None), weights),
                                  "rel_err": float((out - ref).norm() / ref.norm())}
    del weights
    scales.clear()
    torch.cuda.empty_cache()
    return cell


def time_prefill(runner: Any, batch: int, prompt_len: int, repeats: int) -> dict[str, float]:
    """Device and host milliseconds of `runner.prefill` of `batch` random prompts (median of `repeats`)."""
    from serving.engine.timing import random_prompts

    prompts = random_prompts(batch, prompt_len, runner.info.model.vocab_size)
    rows = list(range(batch))
    runner.prefill(prompts, rows)
    torch.cuda.synchronize()
    device, host = [], []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        runner.prefill(prompts, rows)
        stop.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        device.append(start.elapsed_time(stop))
    return {"ms": statistics.median(device), "host_ms": statistics.median(host)}


def profile_prefill(runner: Any, prompt_len: int, rows: int = 18) -> str:
    """A torch.profiler table of one eager prefill at batch 1 (host and device time by op)."""
    from serving.engine.timing import random_prompts

    prompts = random_prompts(1, prompt_len, runner.info.model.vocab_size)
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.prefill(prompts, [0])
            torch.cuda.synchronize()
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    except Exception as exc:  # noqa: BLE001 - the profiler is a help, not the measurement
        return f"profiler failed: {type(exc).__name__}: {exc}"


def device_kernels(runner: Any, batch: int, prompt_len: int) -> str:
    """The kernels of one eager prefill of `batch` prompts, by device time (after one unprofiled)."""
    from bench.kernel_table import kernel_table
    from serving.engine.timing import random_prompts

    prompts = random_prompts(batch, prompt_len, runner.info.model.vocab_size)
    runner.prefill(prompts, list(range(batch)))
    return kernel_table(lambda: runner.prefill(prompts, list(range(batch))),
                        f"one prefill, batch {batch} x {prompt_len}")


def run_fp8_prefill(shape: str, rows: int, *, batches: tuple[int, ...] = (1, 64), prompt_len: int = 128,
                    repeats: int = 5, out: Path, log=print) -> dict[str, Any]:
    from bench.gemm_sweep import gemm_shapes
    from bench.quantized import random_model, runner_for
    from bench.throughput import torch_row_ops
    from serving.engine import quantize

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shape": shape, "gemms": {}, "prefill": {}}

    def save() -> None:
        out.write_text(json.dumps(report, indent=1))

    for name, (n, k) in gemm_shapes(shape).items():
        if name not in GEMMS:
            continue
        cell = report["gemms"][name] = gemm_cell(rows, n, k)
        for variant, t in cell["variants"].items():
            err = f" rel_err {t['rel_err']:.1e}" if "rel_err" in t else ""
            log(f"{name:5s} {n:6d}x{k:<6d} rows {rows}: {variant:32s} gpu {t['gpu_us']:7.1f} us  eager "
                f"{t['eager_us']:7.1f} us  host {t['host_us']:6.1f} us{err}")
        save()
    base = random_model(shape)
    max_batch = max(batches)
    max_seq = -(-(prompt_len + 1) // 256) * 256
    for method in ("none", "fp8"):
        runner = runner_for(base, method, max_batch_size=max_batch, max_seq_len=max_seq)
        label = "bf16" if method == "none" else method
        variants = {label: contextlib.nullcontext(), f"{label}, torch row ops": torch_row_ops()}
        if method == "fp8":
            variants |= {name: mock.patch.object(quantize, "fp8_scaled_linear", fn)
                         for name, fn in PREFILL_CANDIDATES.items()}
        for label, patch in variants.items():
            with patch:
                for b in batches:
                    t = report["prefill"][f"{label} b{b}"] = time_prefill(runner, b, prompt_len, repeats)
                    log(f"prefill {shape} {label:16s} batch {b:3d} x {prompt_len}: {t['ms']:7.1f} ms on the device, "
                        f"host {t['host_ms']:7.1f} ms")
                    save()
        if method == "fp8":
            table = report["profile_fp8_b1"] = profile_prefill(runner, prompt_len)
            log(table)
        table = report[f"kernels_{method}_b{max_batch}"] = device_kernels(runner, max_batch, prompt_len)
        log(table)
        save()
        runner = None
        torch.cuda.empty_cache()
    return report
