"""The split-K FP8 tensor-core kernel (`serving.engine.fp8_gemm`) against the engine's other fp8 decode paths (CUDA).

`python3 -m bench fp8-gemms --shapes llama-3.1-8b,llama-3.2-1b --rows 1,64` times, per decode GEMM
(wqkv, wo, w13, w2) and row count, cold in L2 and launched from a CUDA graph (as `bench gemms` does):

- `cublas_us`: bf16 F.linear on the bf16 weight (for scale);
- `weight_only_us`: the weight-only decode kernel the engine runs without an `fp8` tuned config
  (`skinny_gemm.quantized_config_for`, e4m3 converted to bf16 in registers);
- `scaled_mm_us`: `torch._scaled_mm` row-wise on pre-scaled tokens (16+ rows; the GEMM alone);
- `prefill_us` (more rows than a decode batch, `--rows 128`): the engine's prefill GEMM, `fp8_scaled_linear`,
  the tokens' scaling kernel included (the fp8 kernel takes decode rows only, so no config is tried);
- every fitting config of the fp8 kernel, on pre-scaled tokens (the tokens' scaling is fused into the
  step's RMSNorm or SiLU * up when compiled), checked against `quantize.fp8_emulated_linear` on the same
  e4m3 inputs (`rel_err`).

It ends by writing the `fp8` section of the GPU's tuned kernel file (`serving/engine/tuned/<device>.json`):
each shape where the best fp8 config beats the engine's other path at those rows (`baseline_us`: the
weight-only kernel, or `_scaled_mm` where the engine takes it) by more than `MIN_GAIN`. `python3 -m
bench.quant_tables --fp8 fp8-sweep.json -- <bench arguments>` writes a saved report's table the same
way and runs the bench on it (one device call sweeps, then times the engines on what it found).
The configs compile first in a pool of processes (they fill Triton's on-disk cache).

Imports: stdlib and torch at import time.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import time
from pathlib import Path
from typing import Any

import torch

from serving.engine.skinny_gemm import GemmConfig

COLD_BYTES = 256 * 2**20  # weight copies per timed shape, so that L2 (50 MB) never holds the next one
MIN_GAIN = 0.02
SPLITS = (1, 2, 4, 8, 16)
GEMMS = ("wqkv", "wo", "w13", "w2")


def candidate_configs() -> list[GemmConfig]:
    """Every compiled variant of the fp8 kernel (the split is a runtime argument)."""
    out = []
    for (n, k), stages in itertools.product([(64, 128), (64, 256), (128, 128), (128, 256)], (3, 4, 5)):
        out.append(GemmConfig("dott", n, k, 1, 4, stages))
        if n == 128:
            out.append(GemmConfig("dott", n, k, 1, 8, stages))
    # wide weight tiles with few stages: fewer bytes of the tokens' tile per weight byte, two programs per SM
    # (kernel-resources showed the tuned 64-wide configs at one program per SM)
    for (n, k), warps in itertools.product([(128, 128), (128, 256), (256, 128)], (4, 8)):
        out.append(GemmConfig("dott", n, k, 1, warps, 2))
    # short K steps, wide tiles: more K slices of the same bytes in flight, smaller stages
    for (n, k), stages in itertools.product([(128, 64), (256, 64)], (3, 4, 6)):
        out.append(GemmConfig("dott", n, k, 1, 8, stages))
    return out


def with_split(config: GemmConfig, split: int) -> GemmConfig:
    return GemmConfig(config.kernel, config.block_n, config.block_k, split, config.warps, config.stages)


def _warm(job: tuple[int, list[str]]) -> int:
    """Compile each config once on small tensors (a pool worker); returns how many compiled."""
    from serving.engine.fp8_gemm import launch_fp8
    from serving.engine.quantize import quantize_tokens_fp8, quantize_weight

    rows, keys = job
    done = 0
    for key in keys:
        config = GemmConfig.parse(key)
        k = config.block_k * 2
        xq, xs = quantize_tokens_fp8(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
        w, s = quantize_weight(torch.randn(256, k, device="cuda", dtype=torch.bfloat16), "fp8")
        try:
            for split in (1, 2):
                launch_fp8(xq, xs, w, s, with_split(config, split))
            done += 1
        except Exception:  # noqa: BLE001, S110 - out of shared memory or registers: the sweep skips it too
            pass
    torch.cuda.synchronize()
    return done


def warm_all(rows_list: list[int], workers: int) -> float:
    started = time.perf_counter()
    keys = [c.key() for c in candidate_configs()]
    jobs = [(rows, keys[i::workers]) for rows in sorted({1 if r == 1 else 64 for r in rows_list}) for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_warm, [j for j in jobs if j[1]])
    return time.perf_counter() - started


def time_cold_us(fn, weights: list[torch.Tensor]) -> float:
    from serving.engine.cuda_timing import graph_time_us

    copies = itertools.cycle(weights)
    return graph_time_us(lambda: fn(next(copies)), calls=24, replays=3, warmup=2)


def cold_bf16_weights(n: int, k: int, *, least: int = 1) -> tuple[list[torch.Tensor], int]:
    """Random bf16 weights [N, K] (at most 8) and how many one-byte copies keep L2 cold (`COLD_BYTES`)."""
    copies = max(least, min(16, math.ceil(COLD_BYTES / (n * k))))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, 8))], copies


def fp8_copies(bf16: list[torch.Tensor], copies: int) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """`copies` e4m3 weights of `bf16` in turn (each pass 1% larger) and their scales by the weight's id."""
    from serving.engine.quantize import quantize_weight

    quantized = [quantize_weight(bf16[i % len(bf16)] * (1 + 0.01 * (i // len(bf16))), "fp8") for i in range(copies)]
    return [q for q, _ in quantized], {id(q): s for q, s in quantized}


def sweep_cell(rows: int, n: int, k: int) -> dict[str, Any]:
    """The engine's paths and every fitting fp8 config at one (rows, N, K)."""
    from serving.engine.fp8_gemm import fits, launch_fp8
    from serving.engine.quantize import (
        FP8_TENSOR_CORE_MIN_N,
        FP8_TENSOR_CORE_MIN_ROWS,
        fp8_emulated_linear,
        fp8_scaled_linear,
        quantize_tokens_fp8,
    )
    from serving.engine.skinny_gemm import MAX_ROWS, launch, quantized_config_for
    from serving.engine.tuned_tables import tables_for

    bf16, copies = cold_bf16_weights(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    cublas = time_cold_us(lambda w: torch.nn.functional.linear(x, w), bf16)
    weights, scales = fp8_copies(bf16, copies)
    del bf16
    xq, xs = quantize_tokens_fp8(x)
    ref = fp8_emulated_linear(x, weights[0], scales[id(weights[0])], None).float()

    wo_config = quantized_config_for(rows, n, k, tables_for(torch.device("cuda")))
    cell: dict[str, Any] = {"rows": rows, "n": n, "k": k, "bytes": n * k, "cublas_us": cublas,
                            "weight_only_config": wo_config.key() if wo_config else None}
    if wo_config is not None:
        cell["weight_only_us"] = time_cold_us(lambda w: launch(x, w, wo_config, scale=scales[id(w)]), weights)
    if rows >= FP8_TENSOR_CORE_MIN_ROWS:
        cell["scaled_mm_us"] = time_cold_us(
            lambda w: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scales[id(w)].view(1, -1),
                                       out_dtype=torch.bfloat16), weights)
    if rows > MAX_ROWS:  # a prefill: the engine's whole GEMM, the tokens' scaling kernel included
        cell["prefill_us"] = time_cold_us(lambda w: fp8_scaled_linear(x, w, scales[id(w)], None), weights)
    engine_takes_scaled_mm = rows > MAX_ROWS or (rows >= FP8_TENSOR_CORE_MIN_ROWS and n >= FP8_TENSOR_CORE_MIN_N)
    cell["baseline_us"] = cell["scaled_mm_us"] if engine_takes_scaled_mm else cell.get("weight_only_us", cublas)
    results = []
    for base, split in itertools.product(candidate_configs(), SPLITS):
        config = with_split(base, split)
        if not fits(config, rows, n, k) or (n // config.block_n) * split > 64 * 132:
            continue
        try:
            parts = launch_fp8(xq, xs, weights[0], scales[id(weights[0])], config)
        except Exception as exc:  # noqa: BLE001 - a config too large for the device
            results.append({"config": config.key(), "error": type(exc).__name__})
            continue
        err = float((parts.float().sum(0) - ref).norm() / ref.norm())
        if not err < 1e-2:
            results.append({"config": config.key(), "error": err})
            continue
        us = time_cold_us(lambda w, c=config: launch_fp8(xq, xs, w, scales[id(w)], c), weights)
        results.append({"config": config.key(), "us": us, "rel_err": err})
    timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    cell.update(best=timed[:3], tried=len(results), failed=[r for r in results if "us" not in r][:5])
    del weights
    scales.clear()
    torch.cuda.empty_cache()
    return cell


def describe(name: str, cell: dict[str, Any]) -> str:
    def tbs(us: float | None, nbytes: int = cell["bytes"]) -> str:
        return f"{us:6.1f} us {nbytes / us / 1e6:4.2f} TB/s" if us else "     -"

    best = cell["best"][0] if cell["best"] else None
    return (f"{name:5s} rows {cell['rows']:3d} {cell['n']:6d}x{cell['k']:<6d} bf16 {tbs(cell['cublas_us'], 2 * cell['bytes'])}"
            f" | weight-only {tbs(cell.get('weight_only_us'))} | _scaled_mm {tbs(cell.get('scaled_mm_us'))}"
            f" | fp8 kernel {tbs(best['us'] if best else None)} {best['config'] if best else ''}"
            + (f" | prefill GEMM {tbs(cell['prefill_us'])}" if "prefill_us" in cell else ""))


def bucket_key(cell: dict[str, Any]) -> tuple[int, int, int] | None:
    """The `fp8` table key of a decode cell (rows bucket 1 or 64, N, K); None for a prefill cell."""
    if cell["rows"] > 64:
        return None
    return (1 if cell["rows"] == 1 else 64, cell["n"], cell["k"])


def table_of(report: dict[str, Any], *, min_gain: float = MIN_GAIN) -> dict[tuple[int, int, int], str]:
    """(rows bucket, N, K) -> the best fp8 config, where it beats the engine's other path by `min_gain`."""
    out = {}
    for cell in report["cells"]:
        best = cell["best"][0] if cell["best"] else None
        if best is not None and bucket_key(cell) and best["us"] < (1 - min_gain) * cell["baseline_us"]:
            out[bucket_key(cell)] = best["config"]
    return out


def run_fp8_sweep(shapes: list[str], rows_list: list[int], *, out: Path, workers: int = 12,
                  gemms: tuple[str, ...] = GEMMS) -> dict[str, Any]:
    from bench.gemm_sweep import gemm_shapes
    from bench.offline import copy_bandwidth_gb_s

    print(f"compiling {len(candidate_configs())} fp8 configs in {workers} processes ...", flush=True)
    print(f"compiled in {warm_all(rows_list, workers):.0f} s", flush=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_gb_s": copy_bandwidth_gb_s(), "cells": []}
    for shape in shapes:
        for name, (n, k) in gemm_shapes(shape).items():
            if name not in gemms:
                continue
            for rows in rows_list:
                cell = {"shape": shape, "name": name, **sweep_cell(rows, n, k)}
                report["cells"].append(cell)
                print(f"{shape:13s} {describe(name, cell)}", flush=True)
                out.write_text(json.dumps(report, indent=1))
    from bench.gemm_sweep import write_tuned

    write_tuned("fp8", table_of(report))
    return report
