"""Where a decode step's time goes: the step of a random-weight engine of a real shape, in its CUDA
graph, timed by CUDA events and profiled kernel by kernel (torch.profiler over graph replays).

`python3 -m bench profile --shape llama-3.2-1b --batch 1,64 --compile dynamic,static`
(`--quantization fp8`: the weights quantized in memory as conversion does) prints, per variant, the step
time against the step's byte floor (weights at their stored precision + filled KV at the copy bandwidth
measured in the same run), the GPU time summed over kernels (the rest is launch gaps), and the kernels by
total time grouped as GEMM / attention / fused (inductor) / other.
A variant is `<compile>[+<attention>][+skinny][+extra][+unfused][+pdl]`: compile in {eager, dynamic, static},
attention in {matmul, triton} (`serving.engine.decode_attention`), `skinny` for the tuned Triton GEMMs
(`serving.engine.skinny_gemm`; cuBLAS without it), `extra` for those kernels also at the shapes of
`EXTRA_CONFIGS` (candidates for the table, where cuBLAS runs otherwise), `unfused` for the rotary embedding and K/V write in
their own kernels rather than in the Triton attention kernel, `nogateup` for the w13 product and SiLU * up
rather than the gate/up kernel (`serving.engine.gate_up`, with `skinny`), `nogreedy` for the argmax over
float32 logits rather than from the LM head's kernel (`serving.engine.lm_head`), `pdl` for programmatic dependent launch
(`DecodeGraphs(pdl=True)`: inductor's kernels and the step's own Triton kernels, Hopper and later; each
kernel may start while its predecessor finishes, and waits for it before reading its output),
`loopnorm` for inductor's own looped row reductions rather than one pass over each row for the residual
add + RMSNorm (`serving.engine.whole_row_norms`), `rowscale` for an fp8 engine's one token scaled to e4m3 inside
its GEMMs (`EngineOptions.fp8_row_scaling_in_kernel`) rather than in kernels before them,
`kvb<n>`, `kvw<n>`, `kvst<n>`, `kvt<n>` for the Triton attention's block (positions), warps, stages
and target programs (`decode_attention.STEP_KNOBS`), and `g<N>x<K>=<config>` / `u<I>x<D>=<config>` for a
skinny GEMM's / the gate/up kernel's config at the batch's rows bucket (an in-step sweep; configs as
`skinny_gemm.GemmConfig.key()`). Each variant compiles afresh. Needs CUDA.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

KINDS = (("gemm", ("gemm", "gemv", "_dot_kernel", "_fp8_one_row", "_gate_up_kernel", "cutlass", "nvjet", "sm90", "cublas", "splitk")),
         ("attention", ("decode_attention", "_split_kernel", "_combine_kernel", "flash", "attn", "bmm")),
         ("fused", ("triton_",)),
         ("copy", ("copy", "memcpy", "memset", "index", "scatter")))


VARIANT_PARTS = ("triton", "matmul", "skinny", "extra", "unfused", "nogateup", "nogreedy", "loopnorm", "pdl",
                 "rowscale")
# candidates for the tuned skinny table, where cuBLAS runs now (none at present)
ATTENTION_KNOBS = {"kvb": "block", "kvw": "num_warps", "kvst": "num_stages", "kvt": "target_programs"}
EXTRA_CONFIGS: dict[tuple[int, int, int], str] = {}


KNOB_PART = re.compile(r"(kvb|kvw|kvst|kvt)(\d+)")
# g<N>x<K>=<config>: the skinny GEMM of an [N, K] weight at this batch's rows bucket runs <config>;
# u<I>x<D>=<config>: the gate/up kernel of I columns and width D does
CONFIG_PART = re.compile(r"([gu])(\d+)x(\d+)=(.+)")


def config_overrides(parts: list[str], batch: int) -> tuple[dict[tuple[int, int, int], str], dict[tuple[int, int, int], str]]:
    """The (skinny GEMM, gate/up) table entries of a variant's `g...=` and `u...=` parts."""
    from serving.engine.skinny_gemm import GemmConfig, rows_bucket

    tables: dict[str, dict[tuple[int, int, int], str]] = {"g": {}, "u": {}}
    for match in filter(None, (CONFIG_PART.fullmatch(part) for part in parts)):
        kind, n, k, text = match.groups()
        tables[kind][(rows_bucket(batch), int(n), int(k))] = GemmConfig.parse(text).key()
    return tables["g"], tables["u"]


def attention_knobs(parts: list[str]) -> dict[str, int]:
    """The `kv<knob><n>` parts of a variant as `decode_attention._launch` keywords."""
    found = (KNOB_PART.fullmatch(part) for part in parts)
    return {ATTENTION_KNOBS[m[1]]: int(m[2]) for m in found if m}


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def random_model(shape: str, *, batch: int, max_seq: int, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The engine's Transformer of `shape` on CUDA with N(0, 0.02) weights and caches for `batch` rows."""
    from bench.models import model_args
    from serving.engine.model import Transformer

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(model_args(shape)).to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    model = model.eval().requires_grad_(False)
    model.setup_caches(batch, max_seq)
    return model


def profile_variant(model: Any, *, variant: str, batch: int, context: int, kv_block: int, replays: int = 300
                    ) -> dict[str, Any]:
    from serving.engine.cuda_graphs import DecodeGraphs

    compile_mode, *parts = variant.split("+")
    knobs = attention_knobs(parts)
    unknown = {p for p in parts if p not in VARIANT_PARTS and not KNOB_PART.fullmatch(p) and not CONFIG_PART.fullmatch(p)}
    if unknown:
        raise ValueError(f"variant {variant!r}: unknown parts {sorted(unknown)} ({', '.join(VARIANT_PARTS)})")
    from serving.engine import decode_attention
    from serving.engine.gemm_config import parse_table
    from serving.engine.linears import apply_options
    from serving.engine.options import EngineOptions, with_tuned
    from serving.engine.tuned_tables import tables_for

    tuned = tables_for(torch.device("cuda"))
    skinny_over, gate_up_over = config_overrides(parts, batch)
    options = EngineOptions(decode_attention="triton" if "triton" in parts else "matmul",
                            decode_rope_fused="unfused" not in parts,
                            decode_gemm="triton" if "skinny" in parts else "torch",
                            decode_gate_up="nogateup" not in parts, decode_lm_greedy="nogreedy" not in parts,
                            fp8_row_scaling_in_kernel="rowscale" in parts, tuned=tuned)
    apply_options(model, with_tuned(
        options, skinny={**tuned.skinny, **parse_table({**(EXTRA_CONFIGS if "extra" in parts else {}), **skinny_over})},
        gate_up={**tuned.gate_up, **parse_table(gate_up_over)}))
    t0 = time.perf_counter()
    tokens = torch.randint(0, model.args.vocab_size, (batch,), device="cuda")
    pos = torch.full((batch,), context, dtype=torch.long, device="cuda")
    decode_attention.STEP_KNOBS = knobs  # (the static engine's attention, which goes away with it)
    torch._dynamo.reset()
    graphs = DecodeGraphs(model, kv_block=kv_block, compile=False if compile_mode == "eager" else compile_mode,
                          pdl="pdl" in parts, whole_row_norms="loopnorm" not in parts)
    graphs.step(tokens, pos, context + 1)  # compiles and captures
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graphs.step(tokens, pos, context + 1)
    start.record()
    for _ in range(replays):
        graphs.step(tokens, pos, context + 1)
    end.record()
    end.synchronize()
    step_ms = start.elapsed_time(end) / replays
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graphs.step(tokens, pos, context + 1)
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    for ev in kernels:
        entry = per_kernel[ev.name]
        entry[0] += ev.device_time_total / 10
        entry[1] += 1 / 10
    kinds: dict[str, float] = defaultdict(float)
    for name, (us, _) in per_kernel.items():
        kinds[kernel_kind(name)] += us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:14]
    per_step = round(sum(n for _, n in per_kernel.values()))
    return {"variant": variant, "batch": batch, "context": context, "setup_s": round(setup_s, 1),
            "step_ms": step_ms, "replays": replays, "kernel_ms": sum(kinds.values()) / 1e3,
            "kernels_per_step": per_step,
            "by_kind_ms": {k: round(v / 1e3, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [(name[:90], round(us, 1), round(n, 1)) for name, (us, n) in top],
            "first_step": first_step_kernels(kernels, per_step)}


def first_step_kernels(kernels: list[Any], per_step: int) -> list[tuple[str, float]]:
    """The kernels of one replay in launch order, (name, us): which small kernels sit between the GEMMs."""
    ordered = sorted(kernels, key=lambda ev: ev.time_range.start)[:per_step]
    return [(ev.name[:60], round(ev.device_time_total, 1)) for ev in ordered]


def quantized(model: Any, method: str, *, batch: int, max_seq: int) -> tuple[Any, int]:
    """`model` with its weights quantized by `method` as conversion does, with caches, and the bytes of the
    weights its decode step reads at their stored precision (the untied embedding table left out)."""
    from bench.quantized import decode_weight_bytes, quantized_model

    model = quantized_model(model, method)
    model.setup_caches(batch, max_seq)
    return model, decode_weight_bytes(model)


def run_profile(shape: str, batches: list[int], variants: list[str], *, context: int = 192, kv_block: int = 256,
                replays: int = 300, quantization: str = "none", out_json: Path | None = None) -> list[dict[str, Any]]:
    from bench.models import kv_bytes_per_token, model_args, weight_bytes
    from bench.offline import copy_bandwidth_gb_s

    bw = copy_bandwidth_gb_s()
    args = model_args(shape)
    max_seq = max(kv_block, context + 64)
    model = random_model(shape, batch=max(batches), max_seq=max_seq)
    step_weights = weight_bytes(args, torch.bfloat16)
    if quantization != "none":
        model, step_weights = quantized(model, quantization, batch=max(batches), max_seq=max_seq)
    results = []
    for batch in batches:
        floor_ms = (step_weights + kv_bytes_per_token(args, torch.bfloat16) * batch * context) / (bw * 1e9) * 1e3
        for variant in variants:
            try:
                r = profile_variant(model, variant=variant, batch=batch, context=context, kv_block=kv_block,
                                    replays=replays)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
                r = {"variant": variant, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:400]}
            r.update({"shape": shape, "quantization": quantization, "floor_ms": floor_ms, "bandwidth_gb_s": bw})
            if "step_ms" in r:
                r["roofline_frac"] = floor_ms / r["step_ms"]
                print(f"{shape} b={batch} {variant:<16} step {r['step_ms']:.3f} ms (floor {floor_ms:.3f}, "
                      f"{r['roofline_frac'] * 100:.1f}%), kernels {r['kernel_ms']:.3f} ms in "
                      f"{r['kernels_per_step']}, {r['by_kind_ms']}, setup {r['setup_s']} s", flush=True)
                for name, us, n in r["top"]:
                    print(f"    {us:8.1f} us  x{n:<5} {name}")
            else:
                print(f"{shape} b={batch} {variant}: {r['error']}", flush=True)
            results.append(r)
            if out_json is not None:
                out_json.write_text(json.dumps(results, indent=1))
    return results
