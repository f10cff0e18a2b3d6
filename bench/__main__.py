"""`python3 -m bench ...` (from the repository root): the benchmark command line."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for item in text.split(","):
        p, _, g = item.partition("/")
        out.append((int(p), int(g)))
    return tuple(out)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


QUANTIZATION_CHOICES = ("none", "fp8", "int8-weight-only")  # engine.quantization (serving.engine.quantize)


def _kv_cache(args: argparse.Namespace) -> Any:
    """`bench served`'s KV cache settings (a KVCacheConfig), or None (the engine's default: room for its limits)
    without --num-blocks, --free-mem-fraction or --max-num-tokens."""
    if args.num_blocks is None and args.free_mem_fraction is None and args.max_num_tokens is None:
        return None
    from serving.engine.kv_cache import KVCacheConfig

    sizes = {} if args.max_num_tokens is None else {"max_num_tokens": args.max_num_tokens}
    return KVCacheConfig(num_blocks=args.num_blocks, free_mem_fraction=args.free_mem_fraction, **sizes)


def _slos(text: str) -> dict[str, float]:
    from bench.throughput import parse_slos

    try:
        return parse_slos(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_mode", required=True)
    off = sub.add_parser("offline", help="engine vs HF transformers (eager, static+compile), random weights")
    off.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b", help="comma list (llama-3.2-1b, llama-3.1-8b, tiny)")
    off.add_argument("--workloads", default="128/128,512/128,2048/128", help="prompt/generated, comma list")
    off.add_argument("--batch-sizes", default="1,64", help="comma list")
    off.add_argument("--peers", default="hf-eager,hf-static-compile", help="HF peers ('' for none)")
    off.add_argument("--peer-workloads", default="128/128", help="workloads the HF peers run on")
    off.add_argument("--no-check", action="store_true", help="skip the logits/greedy check against HF")
    off.add_argument("--repeats", type=int, default=3)
    off.add_argument("--deadline-s", type=float, default=1e9, help="skip cells starting after this many seconds")
    off.add_argument("--out", type=Path, default=Path("bench-offline.json"), help="JSON written after each cell")
    srv = sub.add_parser("served", help="concurrent streaming gRPC clients against Triton (in-flight batching)")
    srv.add_argument("--shape", default="llama-3.2-1b")
    srv.add_argument("--clients", type=int, default=64)
    srv.add_argument("--requests-per-client", type=int, default=4)
    srv.add_argument("--prompt-len", type=int, default=128)
    srv.add_argument("--gen-len", type=int, default=128)
    srv.add_argument("--max-batch-size", type=int, default=64)
    srv.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="none",
                     help="engine.quantization of the served engine (built beside the bf16 one in --work)")
    srv.add_argument("--work", type=Path, default=Path("build/bench-served"))
    srv.add_argument("--out", type=Path, default=Path("bench-served.json"))
    srv.add_argument("--wait-for", type=Path, action="append", default=[],
                     help="file that must exist before the clients start (repeatable)")
    srv.add_argument("--offline-json", type=Path, help="an engine-offline report to compare with")
    srv.add_argument("--lanes-per-client", type=int, default=1,
                     help="requests each client keeps in flight on its one stream (clients x lanes in flight)")
    srv.add_argument("--warmup-lanes", type=int, default=1,
                     help="requests each client sends at once in the warm-up round (0: as many as its lanes, the "
                     "timed round's width, so the timed round meets no batch size or pool size for the first time)")
    srv.add_argument("--num-blocks", type=int, help="the engine's KV pool in blocks (default: room for its limits)")
    srv.add_argument("--free-mem-fraction", type=float, help="the KV pool as this share of the free memory instead")
    srv.add_argument("--max-num-tokens", type=int, help="the engine's tokens per step (default: the engine's, 8192)")
    srv.add_argument("--shared-prefix", type=int, default=0,
                     help="leading prompt tokens every request shares (a system prompt); a variant with "
                          "prefix_caching=true serves them from the engine's prefix cache")
    srv.add_argument("--via-stream-router", action="store_true",
                     help="after each variant, the same clients through the release's streaming router")
    srv.add_argument("--variant", action="append", default=[], metavar="LABEL[:k=v,...]",
                     help="llm model parameters of one measured variant (repeatable; each runs in turn on one "
                          "Triton), e.g. paced:stream_interval_ms=20,gil_switch_interval_ms=0.1")
    plot = sub.add_parser("plot", help="latency distributions of a served report (PNG)")
    plot.add_argument("--served", type=Path, required=True, help="a `served` report (JSON)")
    plot.add_argument("--out", type=Path, default=Path("bench-served.png"))
    plot.add_argument("--variant", help="which variant of the report (default: the first)")
    snd = sub.add_parser("sends", help="the python backend's response sends: one thread vs several at once")
    snd.add_argument("--burst", type=int, default=64, help="final responses per burst")
    snd.add_argument("--threads", default="1,2,4,8", help="comma list of sender thread counts")
    snd.add_argument("--rounds", type=int, default=5)
    snd.add_argument("--work", type=Path, default=Path("build/bench-sends"))
    snd.add_argument("--out", type=Path, default=Path("bench-sends.json"))
    res = sub.add_parser("kernel-resources", help="registers, spills and shared memory of the decode kernels, "
                         "compiled for sm_90 (no GPU needed: Triton and its bundled cuobjdump)")
    res.add_argument("--out", type=Path, default=Path("kernel-resources.json"))
    gem = sub.add_parser("gemms", help="the decode step's GEMMs: cuBLAS vs the skinny Triton kernels (CUDA)")
    gem.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b", help="comma list")
    gem.add_argument("--rows", default="1,64", help="comma list of row counts (decode batch sizes)")
    gem.add_argument("--workers", type=int, default=12, help="processes compiling the Triton configs")
    gem.add_argument("--deadline-s", type=float, default=1e9, help="skip shapes starting after this many seconds")
    gem.add_argument("--gate-up", action="store_true",
                     help="time the MLP's fused silu(gate) * up kernel against w13 + SiLU * up instead")
    gem.add_argument("--quantization", choices=("fp8", "int8-weight-only"), default=None,
                     help="time the kernels on weights quantized this way (prints TUNED_QUANTIZED)")
    gem.add_argument("--gemms", default="wqkv,wo,w13,w2,lm_head", help="comma list of the projections to time")
    gem.add_argument("--tuned-only", action="store_true",
                     help="time only the config the engine runs at each shape (no sweep, no compile pool)")
    gem.add_argument("--out", type=Path, default=Path("bench-gemms.json"))
    f8 = sub.add_parser("fp8-gemms", help="the split-K FP8 tensor-core kernel vs the engine's other fp8 decode "
                        "paths, GEMM by GEMM (prints TUNED_FP8; CUDA)")
    f8.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b", help="comma list")
    f8.add_argument("--rows", default="1,64", help="comma list of row counts (decode batch sizes)")
    f8.add_argument("--workers", type=int, default=12, help="processes compiling the Triton configs")
    f8.add_argument("--gemms", default="wqkv,wo,w13,w2", help="comma list of the projections to time")
    f8.add_argument("--out", type=Path, default=Path("bench-fp8-gemms.json"))
    pat = sub.add_parser("paged-attention", help="the paged decode attention kernel alone at a step's shape, "
                         "variant by variant, against the copy bandwidth (CUDA)")
    pat.add_argument("--rows", type=int, default=400)
    pat.add_argument("--context", type=int, default=3072, help="positions each row attends over")
    pat.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="fp8")
    pat.add_argument("--variants", default="prefetch,prefetch+dotf16,prefetch+dotf16+warps2,prefetch+dotf16+warps4,"
                     "dotf16+tile128", help="comma list of plain, prefetch, dotf16, tile<N>, split<N>, "
                     "warps<N>, stages<N>, joined by '+'")
    pat.add_argument("--out", type=Path, default=Path("bench-paged-attention.json"))
    f8p = sub.add_parser("fp8-prefill", help="the fp8 prefill GEMMs (device, eager and host time) and whole "
                         "eager prefills beside bf16 (CUDA)")
    f8p.add_argument("--shape", default="llama-3.1-8b")
    f8p.add_argument("--rows", type=int, default=128, help="tokens of the GEMMs timed alone")
    f8p.add_argument("--batch-sizes", default="1,64", help="comma list: prompts of the whole prefills")
    f8p.add_argument("--prompt-len", type=int, default=128)
    f8p.add_argument("--out", type=Path, default=Path("bench-fp8-prefill.json"))
    qua = sub.add_parser("quantized", help="decode and end-to-end generate of bf16 beside fp8 / int8 weight-only "
                         "engines, side by side in one run, %% of the roofline of the bytes each step reads (CUDA)")
    qua.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b", help="comma list")
    qua.add_argument("--methods", default="none,fp8,int8-weight-only", help="comma list of engine.quantization")
    qua.add_argument("--batch-sizes", default="1,64", help="comma list")
    qua.add_argument("--workload", default="128/128", help="prompt/generated tokens")
    qua.add_argument("--repeats", type=int, default=3)
    qua.add_argument("--no-check", action="store_true", help="skip the kernels-vs-reference logits check")
    qua.add_argument("--deadline-s", type=float, default=1e9, help="skip cells starting after this many seconds")
    qua.add_argument("--out", type=Path, default=Path("bench-quantized.json"))
    thr = sub.add_parser("throughput", help="N requests at once, offline: the engine and its variants (sides) "
                         "(output tok/s, TTFT / TPOT / ITL percentiles)")
    thr.add_argument("--shape", default="llama-3.1-8b", help="llama-3.2-1b, llama-3.1-8b or tiny (random weights)")
    thr.add_argument("--requests", type=int, default=1024)
    thr.add_argument("--workload", default="128/128", help="input/output tokens per request")
    thr.add_argument("--spread", type=float, default=0.0, help="lengths uniform in len x [1 - spread, 1 + spread]")
    thr.add_argument("--sides", default="engine", help="comma list of engine, engine-sync (the engine "
                     "without running a step ahead), engine-prefix-cache (with prefix caching), engine-torch-ops (its "
                     "norms, rotations, K/V writes and SiLU * up as torch ops), engine-repeat-kv (its prompt attention "
                     "copying K/V to every query head), engine-pdl (its decode graphs with programmatic dependent "
                     "launch), engine-sum-adds (its split-K partial products summed by a kernel an add, not one "
                     "kernel), engine-unscaled (its FP8 GEMMs scaling their own rows), engine-no-prefetch (its decode "
                     "attention loading table entry, K and V one after the other), engine-kv-dot-bf16 (its decode "
                     "attention over an e4m3 pool with bf16 dots), engine-fp8-warps4 (its decode attention over an "
                     "e4m3 pool with 4 warps a program), engine-precise-accum (its fp8 prompt GEMMs without fast "
                     "accumulation), engine-tile<N> (its decode attention over N positions an iteration); option "
                     "sides join with '+', e.g. engine-pdl+no-prefetch")
    thr.add_argument("--max-live", type=int, default=1024, help="the engine's live requests at most (max_batch_size)")
    thr.add_argument("--block-size", type=int, default=32)
    thr.add_argument("--max-num-tokens", type=int, default=8192, help="the engine's tokens per step")
    thr.add_argument("--num-blocks", type=int, help="KV pool size (default: a share of the free GPU memory)")
    thr.add_argument("--free-mem-fraction", type=float, default=0.9)
    thr.add_argument("--warmup-requests", type=int, default=64)
    thr.add_argument("--runs", type=int, default=1, help="measured runs of each side, back to back (the report keeps "
                     "the last one's figures and lists each run's output tok/s)")
    thr.add_argument("--request-rate", type=float, default=0.0,
                     help="requests a second, arriving in a seeded Poisson process (default 0: all at once)")
    thr.add_argument("--goodput", type=_slos, default={}, help="SLOs for goodput, e.g. ttft:500,tpot:50 (milliseconds): the "
                     "requests a second that met every one")
    thr.add_argument("--profile-prefill", action="store_true", help="after each side, the wall time and kernels "
                     "of one step of prompts only (CUDA)")
    thr.add_argument("--profile-run", action="store_true", help="after each side, its run once more under the "
                     "profiler: the GPU's busy share of the wall time and the run's kernels (CUDA)")
    thr.add_argument("--profile-decode", default="", help="comma list of rows: after each side, the kernels "
                     "of one decode-only step at each (CUDA)")
    thr.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="none",
                     help="engine.quantization of the random weights every side shares")
    thr.add_argument("--fp8-direct", action="store_true", help="with --quantization fp8: the random weights made "
                     "in FP8 on the device tensor by tensor, never the whole model in bf16 (a 70B shape on one H200)")
    thr.add_argument("--max-seq-len", type=int, help="the engine's limits.max_seq_len, as a user would set it "
                     "(default: the longest request)")
    thr.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                     help="the pool's kv_cache.kv_cache_dtype (fp8: e4m3 K/V, half the bytes)")
    thr.add_argument("--shared-prefix", type=int, default=0,
                     help="leading prompt tokens every request shares (a system prompt); side engine-prefix-cache "
                          "serves them from the prefix cache")
    thr.add_argument("--admit-every-steps", type=int, default=8, help="while requests are live, waiting ones join at "
                     "most every this many steps unless they fill a step (the served llm model's admit_every_steps)")
    thr.add_argument("--device", default="auto")
    thr.add_argument("--out", type=Path, default=Path("bench-throughput.json"))
    eng = sub.add_parser("engine-offline", help="build the served engine (if missing) and time it offline")
    eng.add_argument("--shape", default="llama-3.2-1b")
    eng.add_argument("--batch", type=int, default=64)
    eng.add_argument("--prompt-len", type=int, default=128)
    eng.add_argument("--gen-len", type=int, default=128)
    eng.add_argument("--max-batch-size", type=int, default=64)
    eng.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="none",
                     help="engine.quantization of the engine (the same folder `served --quantization` serves)")
    eng.add_argument("--repeats", type=int, default=3)
    eng.add_argument("--scheduler-requests-per-client", type=int, default=4,
                     help="then BATCH closed-loop clients through the in-flight scheduler (0: skip)")
    eng.add_argument("--built-marker", type=Path, help="file touched once the engine is built")
    eng.add_argument("--work", type=Path, default=Path("build/bench-served"))
    eng.add_argument("--out", type=Path, default=Path("bench-engine-offline.json"))
    lod = sub.add_parser("engine-load", help="one load of an engine folder as the decoupled llm model loads it "
                         "(prompt steps, a mixed step and the decode graphs warmed up), timed to ready")
    lod.add_argument("--engine", type=Path, required=True)
    lod.add_argument("--out", type=Path, default=Path("bench-engine-load.json"))
    lod.add_argument("--profile", type=Path, default=None, help="warm up on this thread under cProfile; its top "
                     "calls written here")
    pair = sub.add_parser("load-pair", help="first load against second load of an engine, each in a fresh process "
                          "sharing one Triton cache folder that starts empty: the second finds the first's kernels")
    pair.add_argument("--engine", type=Path, required=True)
    pair.add_argument("--work", type=Path, default=Path("build/bench-load"))
    pair.add_argument("--out", type=Path, default=Path("bench-load.json"))
    pair.add_argument("--profile", action="store_true", help="a third load, as the second under cProfile")
    bls = sub.add_parser("bls-stress", help="the routers under concurrent BLS calls on real Triton (any machine): "
                         "answered, failed, crashed stubs")
    bls.add_argument("--router", choices=("router", "stream"), default="router",
                     help="HTTP clients through the router, or gRPC streams through the streaming router")
    bls.add_argument("--clients", type=int, default=32)
    bls.add_argument("--seconds", type=float, default=60.0)
    bls.add_argument("--responses", type=int, default=25, help="responses of the target per call (1: not streaming)")
    bls.add_argument("--model-file", type=Path, help="another model file for the router under test (an older one)")
    bls.add_argument("--work", type=Path, default=Path("build/bench-bls-stress"))
    bls.add_argument("--out", type=Path, default=Path("bench-bls-stress.json"))
    rol = sub.add_parser("rollout", help="a gray release's Triton steps (load beside, 10/50/100, unload; a second "
                         "candidate rolled back) under steady load through the router: p50/p99 per phase")
    rol.add_argument("--engine", type=Path, help="engine folder (default: a random-weight --shape built in --work)")
    rol.add_argument("--shape", default="llama-3.2-1b")
    rol.add_argument("--max-batch-size", type=int, default=64)
    rol.add_argument("--clients", type=int, default=16)
    rol.add_argument("--prompt-len", type=int, default=128)
    rol.add_argument("--gen-len", type=int, default=32)
    rol.add_argument("--steady-s", type=float, default=10.0, help="length of each steady phase")
    rol.add_argument("--hold-s", type=float, default=3.0, help="time at each weight (stands in for an analysis)")
    rol.add_argument("--param", action="append", default=[], metavar="K=V",
                     help="llm model parameter (repeatable); default decoupled=true")
    rol.add_argument("--work", type=Path, default=Path("build/bench-rollout"))
    rol.add_argument("--out", type=Path, default=Path("bench-rollout.json"))
    from bench.speculative import add_arguments as speculative_arguments

    speculative_arguments(sub)


def run(args: argparse.Namespace) -> int:
    if args.bench_mode == "offline":
        from bench.offline import OfflineConfig, render_table, run_offline

        cfg = OfflineConfig(
            shapes=tuple(args.shapes.split(",")), workloads=_pairs(args.workloads), batch_sizes=_ints(args.batch_sizes),
            peers=tuple(p for p in args.peers.split(",") if p), peer_workloads=_pairs(args.peer_workloads),
            repeats=args.repeats, deadline_s=args.deadline_s, check=not args.no_check,
        )
        report = run_offline(cfg, out_json=args.out)
        print(render_table(report))
        for err in report["errors"]:
            print("ERROR", err)
        return 0
    if args.bench_mode == "plot":
        from bench.plots import plot_served

        print(plot_served(args.served, args.out, variant=args.variant))
        return 0
    if args.bench_mode == "sends":
        from bench.send_bench import run_send_bench

        args.work.mkdir(parents=True, exist_ok=True)
        report = run_send_bench(args.work, burst=args.burst, threads=_ints(args.threads), rounds=args.rounds,
                                out_json=args.out)
        for k, fig in report["threads"].items():
            print(f"{report['burst']} final responses on {k} thread(s): {fig['median_ms']:.2f} ms "
                  f"({fig['per_response_ms'] * 1e3:.0f} us per response), samples {fig['samples_ms']}")
        return 0
    if args.bench_mode == "kernel-resources":
        from bench.kernel_resources import run_resources

        args.out.write_text(json.dumps(run_resources(), indent=1))
        return 0
    if args.bench_mode == "gemms":
        from bench.gemm_sweep import run_gate_up_sweep, run_sweep

        if args.gate_up:
            run_gate_up_sweep(args.shapes.split(","), list(_ints(args.rows)), out=args.out, method=args.quantization)
            return 0
        run_sweep(args.shapes.split(","), list(_ints(args.rows)), out=args.out, workers=args.workers,
                  deadline_s=args.deadline_s, method=args.quantization, tuned_only=args.tuned_only,
                  gemms=tuple(args.gemms.split(",")))
        return 0
    if args.bench_mode == "fp8-gemms":
        from bench.fp8_sweep import run_fp8_sweep

        run_fp8_sweep(args.shapes.split(","), list(_ints(args.rows)), out=args.out, workers=args.workers,
                      gemms=tuple(args.gemms.split(",")))
        return 0
    if args.bench_mode == "paged-attention":
        from bench.paged_attention_bench import AttentionBenchConfig, bench_paged_attention

        report = bench_paged_attention(AttentionBenchConfig(rows=args.rows, context=args.context,
                                                            kv_dtype=args.kv_dtype,
                                                            variants=tuple(args.variants.split(","))))
        args.out.write_text(json.dumps(asdict(report), indent=2) + "\n")
        return 0
    if args.bench_mode == "fp8-prefill":
        from bench.fp8_prefill import run_fp8_prefill

        run_fp8_prefill(args.shape, args.rows, batches=_ints(args.batch_sizes), prompt_len=args.prompt_len,
                        out=args.out)
        return 0
    if args.bench_mode == "quantized":
        from bench.quantized import QuantBenchConfig, render_quant_table, run_quantized

        (prompt_len, gen_len), = _pairs(args.workload)
        report = run_quantized(QuantBenchConfig(
            shapes=tuple(args.shapes.split(",")), methods=tuple(args.methods.split(",")),
            batch_sizes=_ints(args.batch_sizes), prompt_len=prompt_len, gen_len=gen_len, repeats=args.repeats,
            check=not args.no_check, deadline_s=args.deadline_s), out_json=args.out)
        print(render_quant_table(report))
        return 0
    if args.bench_mode == "throughput":
        from bench.throughput import ThroughputConfig, bench_throughput

        (input_len, output_len), = _pairs(args.workload)
        slos = args.goodput
        bench_throughput(ThroughputConfig(
            shape=args.shape, requests=args.requests, input_len=input_len, output_len=output_len, spread=args.spread,
            max_live=args.max_live, block_size=args.block_size,
            max_num_tokens=args.max_num_tokens, num_blocks=args.num_blocks, free_mem_fraction=args.free_mem_fraction,
            sides=tuple(args.sides.split(",")), warmup_requests=args.warmup_requests, runs=args.runs,
            profile_decode=tuple(_ints(args.profile_decode)) if args.profile_decode else (),
            profile_prefill=args.profile_prefill, profile_run=args.profile_run, request_rate=args.request_rate, slo_ttft_ms=slos.get("ttft"),
            slo_tpot_ms=slos.get("tpot"), quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
            shared_prefix=args.shared_prefix, fp8_direct=args.fp8_direct,
            max_seq_len=args.max_seq_len, admit_every_steps=args.admit_every_steps),
            device=args.device,
            out_json=args.out)
        return 0
    if args.bench_mode == "engine-offline":
        from bench.served import bench_offline_engine, build_random_engine

        args.work.mkdir(parents=True, exist_ok=True)
        max_seq = -(-(args.prompt_len + args.gen_len) // 256) * 256
        engine_dir = build_random_engine(args.shape, args.work, max_batch_size=args.max_batch_size,
                                         max_seq_len=max_seq, quantization=args.quantization)
        if args.built_marker is not None:
            args.built_marker.write_text(str(engine_dir))
        report = bench_offline_engine(engine_dir, batch=args.batch, prompt_len=args.prompt_len, gen_len=args.gen_len,
                                      repeats=args.repeats,
                                      scheduler_requests_per_client=args.scheduler_requests_per_client,
                                      out_json=args.out)
        print(json.dumps(report, indent=1))
        return 0
    if args.bench_mode == "engine-load":
        from bench.load_time import measure_load

        report = measure_load(args.engine, profile=args.profile)
        args.out.write_text(json.dumps(report, indent=1))
        return 0
    if args.bench_mode == "load-pair":
        from bench.load_time import run_load_pair

        args.work.mkdir(parents=True, exist_ok=True)
        report = run_load_pair(args.engine, args.work, profile=args.profile)
        args.out.write_text(json.dumps(report, indent=1))
        return 0
    if args.bench_mode == "bls-stress":
        from bench.bls_stress import run_bls_stress

        report = run_bls_stress(args.work, router=args.router, clients=args.clients, seconds=args.seconds,
                                responses=args.responses, model_file=args.model_file)
        args.out.write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
        return 0
    if args.bench_mode == "speculative":
        from bench.speculative import render, run_speculative

        print(render(run_speculative(args)))
        return 0
    if args.bench_mode == "rollout":
        from bench.rollout import render_phases, run_rollout_bench
        from bench.served import build_random_engine

        args.work.mkdir(parents=True, exist_ok=True)
        engine = args.engine or build_random_engine(args.shape, args.work, max_batch_size=args.max_batch_size,
                                                    max_seq_len=-(-(args.prompt_len + args.gen_len) // 256) * 256)
        params = {"decoupled": "true", **dict(p.split("=", 1) for p in args.param)}
        report = run_rollout_bench(engine, args.work, clients=args.clients, prompt_len=args.prompt_len,
                                   gen_len=args.gen_len, steady_s=args.steady_s, hold_s=args.hold_s,
                                   parameters=params, out_json=args.out)
        print(render_phases(report))
        return 0
    from bench.served import parse_variant, run_served

    variants = tuple(parse_variant(v) for v in args.variant) or (("default", {}),)
    report = run_served(variants=variants, shape=args.shape, clients=args.clients, requests_per_client=args.requests_per_client,
                        prompt_len=args.prompt_len, gen_len=args.gen_len,
                        max_batch_size=args.max_batch_size, work=args.work, out_json=args.out,
                        wait_for=tuple(args.wait_for), offline_json=args.offline_json,
                        via_stream_router=args.via_stream_router, quantization=args.quantization,
                        lanes=args.lanes_per_client, warmup_lanes=args.warmup_lanes or args.lanes_per_client,
                        kv_cache=_kv_cache(args), shared_prefix=args.shared_prefix)
    print(json.dumps({k: v for k, v in report.items() if k not in ("samples", "variants")}, indent=1))
    for label, figures in report["variants"].items():
        print(label, json.dumps({k: v for k, v in figures.items() if k != "samples"}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
