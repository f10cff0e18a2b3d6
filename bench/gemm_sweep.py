"""The decode step's GEMMs: cuBLAS (F.linear) against the skinny Triton kernels, shape by shape (CUDA).

`python3 -m bench gemms --shapes llama-3.2-1b,llama-3.1-8b --rows 1,64` times every weight
matrix of the shapes (wqkv, wo, w13, w2, lm_head) at each row count, the way a decode step meets
them: cold in L2 (each timed call reads another copy of the weight, 256 MB of copies in all) and
launched from a CUDA graph. It prints, per shape, cuBLAS's time and bandwidth, the best Triton
configs' (kernel alone, and with the split-K sum as a separate kernel, an upper bound on what
the fused sum costs), and writes the configs that beat cuBLAS into the GPU's tuned kernel file
(`serving/engine/tuned/<device>.json`, section `skinny`: `tuned_tables.write_table`), which engines read at load.

The Triton configs compile first in a pool of processes (they fill Triton's on-disk cache).

`--gate-up` times instead the MLP's silu(gate) * up: the step's unfused path (w13, then SiLU * up)
against the fused `serving.engine.gate_up` kernel's configs (compiled in process), and writes the `gate_up`
section.

`--quantization fp8|int8-weight-only` times the kernels on quantized weights (one byte per weight, per-row
scales; `serving.engine.quantize`) against cuBLAS on the bf16 weights of the same shape, and writes the
`skinny_fp8` (int8: `skinny_int8`) / `gate_up_quantized` sections (every shape's best config, faster than cuBLAS
or not: a quantized weight has no cuBLAS path in the decode step). With fp8, each cell also times the FP8
tensor-core path (`quantize.fp8_scaled_linear`: the tokens to e4m3, then `torch._scaled_mm`), with and
without `use_fast_accum` and the GEMM alone on pre-scaled tokens, and checks it against the dequantized
reference (`tc_rel_err`). `--tuned-only` times only the config the engine would run (`quantized_config_for`)
instead of sweeping every config (no compile pool: seconds instead of minutes); with int8, it also times that
config widening the weights by int-to-float conversions (`convert_us`) beside the float32-bits path the
kernels take (`skinny_gemm.widen`).
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from serving.engine.cuda_timing import graph_time_us
from serving.engine.skinny_gemm import GemmConfig

COLD_BYTES = 256 * 2**20  # weight copies per timed shape, so that L2 (50 MB) never holds the next one


def gemm_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of every weight matrix a decode step of `shape` multiplies by."""
    from bench.models import model_args

    a = model_args(shape)
    return {"wqkv": (a.qkv_size, a.dim), "wo": (a.dim, a.q_size), "w13": (2 * a.intermediate_size, a.dim),
            "w2": (a.dim, a.intermediate_size), "lm_head": (a.vocab_size, a.dim)}


def compiled_configs(rows: int, transposed: bool = False) -> list[GemmConfig]:
    """Every kernel variant tried at `rows` (splits excluded: the split count is a runtime argument);
    `transposed`: the "dott" kernel's too (the quantized sweeps)."""
    out = []
    if transposed:
        for (n, k), st in itertools.product([(64, 64), (64, 128), (64, 256), (128, 64), (128, 128)], (3, 4, 5)):
            out.append(GemmConfig("dott", n, k, 1, 4, st))
            if n == 128:
                out.append(GemmConfig("dott", n, k, 1, 8, st))
    if rows == 1:
        for n, k, w, st in itertools.product((8, 16, 32), (256, 512), (4, 8), (2, 4)):
            out.append(GemmConfig("gemv", n, k, 1, w, st))
    blocks = [(32, 64), (32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128)]
    for (n, k), st in itertools.product(blocks, (3, 4, 5)):
        out.append(GemmConfig("dot", n, k, 1, 4, st))
        if n == 128:
            out.append(GemmConfig("dot", n, k, 1, 8, st))
    return out


def with_split(config: GemmConfig, split: int) -> GemmConfig:
    return GemmConfig(config.kernel, config.block_n, config.block_k, split, config.warps, config.stages)


def quantized_copy(w: torch.Tensor, method: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight as the kernels read it, its scales): the bf16 weight itself, or quantized by `method`."""
    if method is None:
        return w, None
    from serving.engine.quantize import quantize_weight

    return quantize_weight(w, method)


def _warm(job: tuple[int, list[str], str | None]) -> int:
    """Compile each config once on small tensors (a pool worker); returns how many compiled."""
    from serving.engine.skinny_gemm import launch

    rows, keys, method = job
    done = 0
    for key in keys:
        config = GemmConfig.parse(key)
        k = config.block_k * 2
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w, scale = quantized_copy(torch.randn(256, k, device="cuda", dtype=torch.bfloat16), method)
        try:
            for split in (1, 2):
                launch(x, w, with_split(config, split), scale=scale)
            done += 1
        except Exception:  # noqa: BLE001, S110 - out of shared memory or registers: the sweep skips it too
            pass
    torch.cuda.synchronize()
    return done


def warm_all(rows_list: list[int], workers: int, method: str | None = None) -> float:
    started = time.perf_counter()
    jobs = []
    for rows in rows_list:
        keys = [c.key() for c in compiled_configs(rows, transposed=method is not None)]
        jobs += [(rows, keys[i::workers], method) for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_warm, [j for j in jobs if j[1]])
    return time.perf_counter() - started


def time_cold_us(fn: Callable[[torch.Tensor], Any], weights: list[torch.Tensor]) -> float:
    """Microseconds per fn(weight), the calls cycling through the copies (so L2 holds none of them)."""
    copies = itertools.cycle(weights)
    return graph_time_us(lambda: fn(next(copies)), calls=24, replays=3, warmup=2)


def tensor_core_times(x: torch.Tensor, weights: list[torch.Tensor], scales: dict[int, torch.Tensor],
                      ref: torch.Tensor) -> dict[str, float]:
    """The FP8 tensor-core path on the e4m3 `weights` (cold, like the kernels): with the tokens' scaling,
    with `use_fast_accum`, the GEMM alone; and its relative error against the dequantized reference `ref`."""
    from serving.engine.quantize import fp8_scaled_linear, quantize_tokens_fp8

    def gemm(w: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, fast: bool) -> torch.Tensor:
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scales[id(w)].view(1, -1), out_dtype=x.dtype,
                                use_fast_accum=fast)

    xq, xs = quantize_tokens_fp8(x)
    out = fp8_scaled_linear(x, weights[0], scales[id(weights[0])], None).double()
    fast_out = gemm(weights[0], xq, xs, True).double()
    return {"tc_us": time_cold_us(lambda w: fp8_scaled_linear(x, w, scales[id(w)], None), weights),
            "tc_fast_us": time_cold_us(lambda w: gemm(w, *quantize_tokens_fp8(x), True), weights),
            "tc_gemm_us": time_cold_us(lambda w: gemm(w, xq, xs, False), weights),
            "tc_rel_err": float((out - ref.double()).norm() / ref.double().norm()),
            "tc_fast_rel_err": float((fast_out - ref.double()).norm() / ref.double().norm())}


def sweep_shape(rows: int, n: int, k: int, method: str | None = None, tuned_only: bool = False) -> dict[str, Any]:
    """cuBLAS and every fitting Triton config at one (rows, N, K) (`tuned_only`: the engine's own config);
    with `method`, the kernels on the weight quantized by it (and cuBLAS on the bf16 weight, for scale;
    fp8: the tensor-core path too, `tensor_core_times`)."""
    from serving.engine.quantize import INT8_WEIGHT_ONLY
    from serving.engine.skinny_gemm import config_for, launch, quantized_config_for
    from serving.engine.tuned_tables import tables_for

    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(max(1, min(16, math.ceil(COLD_BYTES / (n * k * 2)))))]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    cublas = time_cold_us(lambda w: torch.nn.functional.linear(x, w), bf16)
    quantized = [quantized_copy(w, method) for w in bf16]
    scales = {id(w): s for w, s in quantized}
    weights = [w for w, _ in quantized]
    del bf16
    nbytes = n * k * weights[0].element_size()
    ref = torch.nn.functional.linear(x, weights[0].float().mul(scales[id(weights[0])][:, None]).bfloat16()
                                     if method else weights[0]).float()

    def launch(x: torch.Tensor, w: torch.Tensor, config: GemmConfig, launch: Callable = launch, **options: Any
               ) -> torch.Tensor:
        return launch(x, w, config, scale=scales[id(w)], **options)
    results = []
    splits = (1, 2) if nbytes > 2**29 else (1, 2, 4, 8, 16)
    int8 = method == INT8_WEIGHT_ONLY
    if tuned_only:
        tables = tables_for(torch.device("cuda"))
        configs = [quantized_config_for(rows, n, k, tables, int8=int8) if method else config_for(rows, n, k, tables.skinny)]
    else:
        configs = [with_split(base, split) for base in compiled_configs(rows, transposed=method is not None)
                   for split in splits]
    for config in configs:
        if config is None or not config.fits(rows, n, k) or n // config.block_n * config.split > 64 * 132:
            continue
        try:
            parts = launch(x, weights[0], config)
        except Exception as exc:  # noqa: BLE001 - a config too large for the device
            results.append({"config": config.key(), "error": type(exc).__name__})
            continue
        err = (parts.float().sum(0) - ref).abs().max().item()
        if not err < 0.05:
            results.append({"config": config.key(), "error": err})
            continue
        us = time_cold_us(lambda w, c=config: launch(x, w, c), weights)
        results.append({"config": config.key(), "us": us, **(int8_convert_us(x, weights, launch, config)
                                                              if int8 and tuned_only else {})})
    timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    for r in timed[:3]:  # the best three again, with the split-K sum as its own kernel
        config = GemmConfig.parse(r["config"])
        r["us_with_sum"] = time_cold_us(
            lambda w, c=config: launch(x, w, c).sum(0) if c.split > 1 else launch(x, w, c), weights)
    tensor_cores = tensor_core_times(x, weights, scales, ref) if method == "fp8" and n % 16 == 0 and k % 16 == 0 else {}
    del weights
    torch.cuda.empty_cache()
    return {"rows": rows, "n": n, "k": k, "bytes": nbytes, "cublas_us": cublas, "best": timed[:3],
            "failed": [r for r in results if isinstance(r.get("error"), str)],
            "wrong": [r for r in results if isinstance(r.get("error"), float)], "tried": len(results),
            **tensor_cores}


def int8_convert_us(x: torch.Tensor, weights: list[torch.Tensor], launch: Callable, config: GemmConfig
                    ) -> dict[str, float]:
    """The config on int8 weights widened by int-to-float conversions (the launcher's `int8_float_bits` off)
    rather than through float32 bits, for a side-by-side figure (only the gemv kernel differs)."""
    return {"convert_us": time_cold_us(lambda w: launch(x, w, config, int8_float_bits=False), weights)}


def sweep_gate_up(rows: int, intermediate: int, k: int, method: str | None = None) -> dict[str, Any]:
    """The MLP's silu(gate) * up at one (rows, I, K): the step's unfused path (the w13 product, through
    the tuned skinny kernel where there is one, then SiLU * up) against every fitting `gate_up` config;
    with `method`, both on the w13 quantized by it."""
    from serving.engine.gate_up import fits
    from serving.engine.gate_up import launch as gate_up_launch
    from serving.engine.skinny_gemm import skinny_linear

    copies = max(1, min(16, math.ceil(COLD_BYTES / (2 * intermediate * k * 2))))
    quantized = [quantized_copy(torch.randn(2 * intermediate, k, device="cuda", dtype=torch.bfloat16) * 0.02, method)
                 for _ in range(copies)]
    scales = {id(w): s for w, s in quantized}
    weights = [w for w, _ in quantized]
    nbytes = 2 * intermediate * k * weights[0].element_size()
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

    def launch(x: torch.Tensor, w: torch.Tensor, config: GemmConfig) -> torch.Tensor:
        return gate_up_launch(x, w, config, scale=scales[id(w)])

    def unfused_path(w: torch.Tensor) -> torch.Tensor:
        gate, up = skinny_linear(x, w, scale=scales[id(w)]).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    ref = unfused_path(weights[0]).float()
    unfused = time_cold_us(unfused_path, weights)
    results = []
    for config in compiled_configs(rows, transposed=method is not None):
        if not fits(config, rows, k):
            continue
        try:
            err = (launch(x, weights[0], config).float() - ref).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a config too large for the device
            results.append({"config": config.key(), "error": type(exc).__name__})
            continue
        if not err < 0.05 * max(1.0, ref.abs().max().item()):
            results.append({"config": config.key(), "error": err})
            continue
        results.append({"config": config.key(), "us": time_cold_us(lambda w, c=config: launch(x, w, c), weights)})
    del weights
    torch.cuda.empty_cache()
    timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    return {"rows": rows, "n": intermediate, "k": k, "bytes": nbytes, "cublas_us": unfused, "best": timed[:3],
            "failed": [r for r in results if isinstance(r.get("error"), str)],
            "wrong": [r for r in results if isinstance(r.get("error"), float)], "tried": len(results)}


def run_gate_up_sweep(shapes: list[str], rows_list: list[int], *, out: Path, method: str | None = None
                      ) -> dict[str, Any]:
    """`sweep_gate_up` for every shape's MLP at every row count; writes the configs that beat the unfused path
    by more than 2% into the GPU's tuned kernel file (`gate_up`, quantized: `gate_up_quantized`)."""
    from bench.models import model_args

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "cells": []}
    for shape, rows in itertools.product(shapes, rows_list):
        a = model_args(shape)
        cell = {"shape": shape, "name": "gate_up", **sweep_gate_up(rows, a.intermediate_size, a.dim, method)}
        report["cells"].append(cell)
        out.write_text(json.dumps(report, indent=1))
        print(describe(cell).replace("cuBLAS", "unfused"), flush=True)
    table = {(cell["rows"], cell["n"], cell["k"]): cell["best"][0]["config"] for cell in report["cells"]
             if cell["best"] and cell["best"][0]["us"] < 0.98 * cell["cublas_us"]}
    write_tuned("gate_up_quantized" if method else "gate_up", table)
    return report


def run_sweep(shapes: list[str], rows_list: list[int], *, out: Path, workers: int = 12,
              deadline_s: float = 1e9, method: str | None = None, tuned_only: bool = False,
              gemms: tuple[str, ...] = ("wqkv", "wo", "w13", "w2", "lm_head")) -> dict[str, Any]:
    from bench.offline import copy_bandwidth_gb_s

    started = time.perf_counter()
    warm_s = 0.0 if tuned_only else warm_all(rows_list, workers, method)
    report: dict[str, Any] = {"warm_s": warm_s, "device": torch.cuda.get_device_name(),
                              "copy_gb_s": copy_bandwidth_gb_s(), "cells": [], "quantization": method}
    print(f"compiled in {report['warm_s']:.0f} s; copy bandwidth {report['copy_gb_s']:.0f} GB/s", flush=True)
    for shape, rows in itertools.product(shapes, rows_list):
        for name, (n, k) in gemm_shapes(shape).items():
            if name not in gemms:
                continue
            if time.perf_counter() - started > deadline_s:
                print(f"deadline: skipping {shape} {name} rows={rows}", flush=True)
                continue
            cell = {"shape": shape, "name": name, **sweep_shape(rows, n, k, method, tuned_only)}
            report["cells"].append(cell)
            out.write_text(json.dumps(report, indent=1))
            print(describe(cell), flush=True)
    table = {}
    for cell in report["cells"]:
        best = cell["best"][0] if cell["best"] else None
        if best and (method or best.get("us_with_sum", best["us"]) < cell["cublas_us"]):
            table[(cell["rows"], cell["n"], cell["k"])] = best["config"]
    if not tuned_only:
        from serving.engine.quantize import INT8_WEIGHT_ONLY

        write_tuned({None: "skinny", INT8_WEIGHT_ONLY: "skinny_int8"}.get(method, "skinny_fp8"), table)
    return report


def write_tuned(section: str, table: dict[tuple[int, int, int], str]) -> None:
    """A sweep's winning configs into the current GPU's tuned kernel file (serving/engine/tuned/), which the
    engine reads at load; the figures stay in the sweep's report."""
    from serving.engine.tuned_tables import write_table

    capability = "{}.{}".format(*torch.cuda.get_device_capability())
    path = write_table(torch.cuda.get_device_name(), capability, section, table)
    print(f"{len(table)} {section} configs written to {path}", flush=True)


def describe(cell: dict[str, Any]) -> str:
    def tbs(us: float) -> str:
        return f"{cell['bytes'] / us / 1e6:.2f} TB/s"

    line = (f"{cell['shape']:<13} {cell['name']:<8} M={cell['rows']:<3} N={cell['n']:<6} K={cell['k']:<6} "
            f"cuBLAS {cell['cublas_us']:7.1f} us ({tbs(cell['cublas_us'])})")
    for r in cell["best"][:2]:
        line += f" | {r['config']} {r['us']:7.1f} us ({tbs(r['us'])})"
        if "convert_us" in r:
            line += f", int8 by conversion {r['convert_us']:.1f} us ({tbs(r['convert_us'])})"
        if "us_with_sum" in r:
            line += f", with sum {r['us_with_sum']:.1f}"
    if "tc_us" in cell:
        line += (f" | FP8 tensor cores {cell['tc_us']:.1f} us ({tbs(cell['tc_us'])}), fast accum "
                 f"{cell['tc_fast_us']:.1f}, GEMM alone {cell['tc_gemm_us']:.1f}, rel err {cell['tc_rel_err']:.1e}")
    if cell["wrong"]:
        line += f" | {len(cell['wrong'])} configs FAILED the check"
    return line

