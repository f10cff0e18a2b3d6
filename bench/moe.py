"""`python3 -m bench.moe`: how fast is a mixture-of-experts engine, Qwen3-30B-A3B's shape in FP8, on one GPU?

Two questions, one process (CUDA only):
1. batch-1 decode: decode tokens/s (`timing.time_generate`, prompt 128, 128 generated) against the roofline of the
   bytes one decode step must read: every weight but the experts and the (untied) embedding table at its stored
   precision (the LM head bf16), the `top_k` experts each token is routed to in every MoE layer (their e4m3 rows
   and float32 scales), and the filled KV cache (context P + N/2); the bandwidth measured in the same run
   (device-to-device copy, `bench.offline.copy_bandwidth_gb_s`). Issue 50 asks >= 60%.
2. `--requests` requests of `--input-len`/`--output-len` (default 1,000 of 1024/1024) all at once through the
   engine's scheduler (`bench.throughput.run_side`): output tok/s, TTFT/TPOT/ITL. Issue 50 asks >= 10,000 tok/s
   on one H200.

Weights are random and built directly in device memory in their stored precision (the experts and attention
projections as e4m3 with per-row scales, the rest bf16), never as a bf16 checkpoint on disk (the device has
64 GB of disk; the model is ~31 GB in FP8): the figures are of the engine's speed, not of a model's answers. The
KV pool takes `--free-mem-fraction` of what the weights leave; `--kv-cache-dtype fp8` halves a token's K/V.
The JSON (`--out`) is written after the decode cell and again at the end, so a run cut short keeps the first.

`--sweep FILE` instead times the grouped expert kernels (one layer of the shape, e4m3 experts) under every
candidate tiling at 1-4,096 tokens, beside `moe_gemm.config_for`'s default: data for a tuned table.

Device: `bash bench/device_moe.sh` (the grouped kernels' GPU tests, the sweep, then the engine).

Imports: stdlib and torch; the engine and bench modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch

from serving.engine.build import EngineInfo, EngineLimits
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.linears import apply_options, install_quantized_linears
from serving.engine.model import ModelArgs
from serving.engine.models.registry import registered
from serving.engine.options import resolve_options
from serving.engine.quantize import FP8, SCALE_SUFFIX, QuantInfo
from serving.engine.runner import EngineRunner
from serving.engine.tuned_tables import tables_for

QWEN3_30B_A3B = ModelArgs(
    architecture="Qwen3MoeForCausalLM", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
    head_dim=128, intermediate_size=6144, norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1e6,
    n_experts=128, n_experts_per_tok=8, moe_intermediate_size=768, moe_renormalize=True)
WEIGHT_STD = 0.02
ROWS_A_CHUNK = 8192  # rows of a random e4m3 weight drawn at once in bf16 (the only transient copy)


def random_tensor(name: str, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random tensor on the GPU for one state-dict entry, in its stored dtype: e4m3 weights from a normal
    distribution (their scales `WEIGHT_STD`, so each weight ~ N(0, WEIGHT_STD^2)), norms 1, the rest bf16."""
    dev = torch.device("cuda")
    if like.dtype == torch.float8_e4m3fn:
        out = torch.empty(like.shape, dtype=like.dtype, device=dev)
        for lo in range(0, like.shape[0], ROWS_A_CHUNK):
            rows = min(ROWS_A_CHUNK, like.shape[0] - lo)
            out[lo:lo + rows] = torch.randn((rows, *like.shape[1:]), generator=gen, device=dev,
                                            dtype=torch.bfloat16).to(like.dtype)
        return out
    if name.endswith(SCALE_SUFFIX):
        return torch.full(like.shape, WEIGHT_STD, dtype=like.dtype, device=dev)
    if "norm" in name:
        return torch.ones(like.shape, dtype=like.dtype, device=dev)
    return torch.randn(like.shape, generator=gen, device=dev, dtype=like.dtype) * WEIGHT_STD


def random_fp8_model(args: ModelArgs, *, seed: int = 0) -> torch.nn.Module:
    """The model of `args` (its registered family) with random FP8 weights made on the GPU (module doc)."""
    quant = QuantInfo(FP8)
    with torch.device("meta"):
        model = registered(args.architecture).model_class(args)
    model = model.to(torch.bfloat16)
    install_quantized_linears(model, quant, n_layers=args.n_layers, tie_word_embeddings=args.tie_word_embeddings,
                              dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    state = {name: random_tensor(name, t, gen) for name, t in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def runner_for(model: torch.nn.Module, *, max_live: int, max_seq_len: int, kv_cache_dtype: str,
               free_mem_fraction: float) -> EngineRunner:
    """An EngineRunner over `model` with a pool sized from the free memory."""
    device = torch.device("cuda")
    limits = EngineLimits("bfloat16", max_batch_size=max_live, max_input_len=max_seq_len - 1, max_seq_len=max_seq_len)
    config = KVCacheConfig(block_size=32, free_mem_fraction=free_mem_fraction, kv_cache_dtype=kv_cache_dtype)
    info = EngineInfo(fingerprint="random-weights", toolchain={}, limits=limits, model=model.args, path=Path("."),
                      quantization=QuantInfo(FP8), kv_cache=config)
    apply_options(model, resolve_options(device, info))
    return EngineRunner(info, model, device, config)


def batch1_step_bytes(model: torch.nn.Module, *, context: float, kv_element_bytes: int) -> dict[str, float]:
    """What one batch-1 decode step at `context` positions must read, in bytes (module doc), by part."""
    a: ModelArgs = model.args
    experts = weights = 0
    for name, p in model.named_parameters():
        if name == "tok_embeddings.weight" and model.output is not None:
            continue  # a step reads one row of it
        if ".feed_forward.w13." in name or ".feed_forward.w2." in name:
            layer = int(name.split(".")[1])
            if a.is_moe_layer(layer):
                experts += p.numel() * p.element_size() * a.n_experts_per_tok // a.n_experts
                continue
        weights += p.numel() * p.element_size()
    kv = 2 * a.n_layers * a.n_kv_heads * a.head_dim * kv_element_bytes * context
    return {"weights": weights, "active_experts": experts, "kv": kv, "total": weights + experts + kv}


def bench_moe(ns: argparse.Namespace, out: Path, log=print) -> dict[str, Any]:
    from bench.offline import copy_bandwidth_gb_s
    from bench.throughput import ThroughputConfig, run_side, workload
    from serving.engine.heap import frozen_heap
    from serving.engine.scheduler import Scheduler
    from serving.engine.timing import time_generate

    args = dataclasses.replace(QWEN3_30B_A3B, n_layers=ns.layers or QWEN3_30B_A3B.n_layers)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "args": args.to_dict(),
                              "tuned_tables": tables_for(torch.device("cuda", 0)).source,
                              "config": {**vars(ns), "out": str(out), "sweep": None}}
    t0 = time.perf_counter()
    model = random_fp8_model(args)
    torch.cuda.synchronize()
    report["weights_gb"] = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e9
    log(f"random FP8 model in {time.perf_counter() - t0:.0f} s: {report['weights_gb']:.1f} GB of weights")
    bandwidth = copy_bandwidth_gb_s()
    report["copy_bandwidth_gb_s"] = bandwidth
    seq = ns.input_len + ns.output_len + 1
    runner = runner_for(model, max_live=ns.max_live, max_seq_len=max(seq, ns.decode_prompt + ns.decode_gen + 1),
                        kv_cache_dtype=ns.kv_cache_dtype, free_mem_fraction=ns.free_mem_fraction)
    log(f"KV pool: {runner.num_blocks} blocks of 32; copy bandwidth {bandwidth:.0f} GB/s")

    runner.warm_up_prefill(ns.decode_prompt)
    if ns.routing_ab:  # the torch ops' routing first, then the one launch, the same runner (graphs recaptured)
        options = resolve_options(torch.device("cuda"), runner.info)
        apply_options(model, dataclasses.replace(options, moe_fused_routing=False))
        runner.decode.drop_graphs()
        torch_ops = time_generate(runner, batch=1, prompt_len=ns.decode_prompt, gen_len=ns.decode_gen,
                                  shape="qwen3-30b-a3b", impl="engine-fp8-torch-routing")
        report["decode_batch1_torch_routing"] = dataclasses.asdict(torch_ops)
        log(f"batch-1 decode with the torch ops' routing: {torch_ops.decode_tok_s:.0f} tok/s")
        apply_options(model, dataclasses.replace(options, moe_fused_routing=True))
        runner.decode.drop_graphs()  # the cell below and the requests run the one-launch routing
    cell = time_generate(runner, batch=1, prompt_len=ns.decode_prompt, gen_len=ns.decode_gen, shape="qwen3-30b-a3b",
                         impl="engine-fp8")
    kv_element = 1 if ns.kv_cache_dtype == "fp8" else 2
    step = batch1_step_bytes(model, context=ns.decode_prompt + ns.decode_gen / 2, kv_element_bytes=kv_element)
    roofline_tok_s = bandwidth * 1e9 / step["total"]
    report["decode_batch1"] = {**dataclasses.asdict(cell), "step_bytes": step, "roofline_tok_s": roofline_tok_s,
                               "roofline_frac": cell.decode_tok_s / roofline_tok_s}
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"batch-1 decode {cell.decode_tok_s:.0f} tok/s = {cell.decode_tok_s / roofline_tok_s:.1%} of the roofline "
        f"{roofline_tok_s:.0f} tok/s (a step reads {step['total'] / 1e9:.2f} GB: weights {step['weights'] / 1e9:.2f}, "
        f"active experts {step['active_experts'] / 1e9:.2f}, KV {step['kv'] / 1e9:.3f})")

    if ns.requests:
        cfg = ThroughputConfig(shape="qwen3-30b-a3b", requests=ns.requests, input_len=ns.input_len,
                               output_len=ns.output_len, max_live=ns.max_live, seed=0)
        vocab = args.vocab_size
        runner.warm_up_prefill(ns.input_len)
        def scheduler() -> Scheduler:  # as the served llm model runs it (bench throughput's too)
            return Scheduler(runner, step_ahead=True, admit_every_steps=cfg.admit_every_steps)

        run_side(scheduler(), workload(cfg, vocab, requests=64, output_len=8), "engine")
        with frozen_heap():
            result = run_side(scheduler(), workload(cfg, vocab), "engine")
        report["throughput"] = dataclasses.asdict(result)
        log(f"{ns.requests} requests of {ns.input_len}/{ns.output_len}: {result.row()}")
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


SWEEP_TOKENS = (1, 8, 64, 512, 4096)


def sweep_grouped(args: ModelArgs, *, tokens: tuple[int, ...] = SWEEP_TOKENS, iters: int = 20,
                  log=print) -> list[dict[str, Any]]:
    """The grouped expert kernels (`moe_gemm.fused_experts`, e4m3 experts of `args`' shape, one layer) at each
    token count under every candidate tiling: device time a call, the expert bytes it reads per second, and the
    best tiling per count beside `moe_gemm.config_for`'s default (data for a tuned table)."""
    from serving.engine import moe_gemm
    from serving.engine.models.moe import ExpertWeights, route
    from serving.engine.quantize import quantize_weight

    e, k, d, inter = args.n_experts, args.n_experts_per_tok, args.dim, args.moe_intermediate_size
    pair = []
    for out_f, in_f in ((2 * inter, d), (d, inter)):
        layer = ExpertWeights(e, in_f, out_f, method=FP8).cuda()
        layer.weight.data, layer.weight_scale.data = quantize_weight(
            torch.randn(e * out_f, in_f, device="cuda", dtype=torch.bfloat16), FP8)
        pair.append(layer)
    w13, w2 = pair
    rows = []
    for n in tokens:
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
        weights, ids = route(torch.randn(n, e, device="cuda"), k, renormalize=True)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * (3 * inter * d + (2 * inter + d) * 4)  # e4m3 rows and their float32 scales
        default = moe_gemm.config_for(n, e)
        candidates = [moe_gemm.GroupedConfig(*c) for c in itertools.product(
            (16,) if n <= e else (16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4))]
        cells = []
        for config in ([default] if default not in candidates else []) + candidates:
            try:
                ms = _time_ms(functools.partial(moe_gemm.fused_experts, x, weights, ids, w13, w2, config), iters)
            except Exception as exc:  # noqa: BLE001 - a tiling the device cannot run (shared memory)
                log(f"tokens {n} {config}: {type(exc).__name__}")
                continue
            cells.append({"config": dataclasses.asdict(config), "ms": ms, "gb_s": nbytes / ms / 1e6,
                          "default": config == default})
        best = min(cells, key=lambda c: c["ms"])
        base = next((c for c in cells if c["default"]), None)
        rows.append({"tokens": n, "experts_touched": touched, "bytes": nbytes, "best": best, "default": base})
        log(f"tokens {n:>5} ({touched} experts): best {best['config']} {best['ms'] * 1e3:.0f} us "
            f"({best['gb_s']:.0f} GB/s of expert bytes); default "
            + (f"{base['ms'] * 1e3:.0f} us ({base['gb_s']:.0f} GB/s)" if base else "failed"))
    return rows


def write_moe_table(args: ModelArgs, rows: list[dict[str, Any]]) -> Path:
    """The sweep's best tiling at each token count, where it beat the default, as the device's `moe` section."""
    from serving.engine.gemm_config import GroupedConfig
    from serving.engine.tuned_tables import write_table

    table = {(row["tokens"], args.moe_intermediate_size, args.dim): GroupedConfig(**row["best"]["config"]).key()
             for row in rows if row["default"] is None or row["best"]["ms"] < row["default"]["ms"]}
    capability = "{}.{}".format(*torch.cuda.get_device_capability(0))
    return write_table(torch.cuda.get_device_name(0), capability, "moe", table)


def _time_ms(run, iters: int) -> float:
    """Device time of one `run()` in ms: two warm-up calls, then `run` captured in a CUDA graph, as the decode
    steps run it, and the graph replayed `iters` times between CUDA events. Timed eagerly, the launches of
    routing's alignment and the two GEMMs set the time (the 2026-12-08 H100 sweep read 426-430 us a layer at 1, 8
    and 64 tokens alike, against 86 us a layer of the whole graphed step at batch 1)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench.moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's 48 (a quick check)")
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--decode-gen", type=int, default=128)
    parser.add_argument("--requests", type=int, default=1000, help="0: the batch-1 decode cell only")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--max-live", type=int, default=1024, help="the engine's max_batch_size")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--routing-ab", action="store_true",
                        help="batch-1 decode with moe_fused_routing off, then on for the rest of the run (the one-launch gain)")
    parser.add_argument("--free-mem-fraction", type=float, default=0.9)
    parser.add_argument("--sweep", type=Path, default=None,
                        help="instead: the grouped kernels' tilings at one layer of the shape, written to this JSON")
    parser.add_argument("--write-table", action="store_true",
                        help="with --sweep: record each token count's best tiling as this device's tuned `moe` "
                             "section (serving/engine/tuned/<device>.json), where it beat the default")
    parser.add_argument("--out", type=Path, default=Path("bench-moe.json"))
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if ns.sweep is not None:
        rows = sweep_grouped(QWEN3_30B_A3B)
        ns.sweep.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=2) + "\n")
        if ns.write_table:
            print(f"tuned table: {write_moe_table(QWEN3_30B_A3B, rows)}")
        return
    bench_moe(ns, ns.out)


if __name__ == "__main__":
    main()
