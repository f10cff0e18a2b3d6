"""Quantized engines beside bf16, side by side in one run: decode and end-to-end `generate` (CUDA).

`python3 -m bench quantized --shapes llama-3.1-8b,llama-3.2-1b --methods none,fp8,int8-weight-only`
builds, per shape, one random bf16 model (the published Llama shapes of `models.py`), then an engine of
it per `engine.quantization` (quantized in memory by `serving.engine.quantize`, as conversion does),
warms each one up as the served model loads it (`EngineRunner.warm_up_prefill`: prompt steps, a mixed step, the
decode graphs) and times
`generate` at each batch size (`serving.engine.timing.time_generate`: best of the repeats after a warm-up). Per cell:

- `decode_tok_s` and `roofline_frac`: decode tokens/s against B / (step bytes / copy bandwidth), where
  the step bytes are what the step must read: every weight at its stored precision (quantized ones at one
  byte plus their float32 scales; the embedding table only when it is also the LM head, since a step reads
  B of its rows) plus the filled KV cache (context P + N/2 per sequence), the bandwidth measured in the
  same run (device-to-device copy, bytes read + written);
- `e2e_tok_s`: B * N over the whole `generate` call, and its ratio to the bf16 engine's at that batch.

`--methods` also takes `fp8-decode-kernels`: the fp8 engine with every decode batch on the weight-only
decode kernels (neither the split-K FP8 kernel nor `_scaled_mm` at decode rows) and the FP8 tensor cores only
past `skinny_gemm.MAX_ROWS` rows (prefill), as fp8 engines first ran; one run times the fp8 decode paths side
by side. And `fp8-row-scaling-in-gemm`: the fp8 engine with one token's e4m3 scaling inside its GEMMs
(`EngineOptions.fp8_row_scaling_in_kernel`), checked at one row too.

Before timing, the check compares each quantized engine's decode-only step (`cuda_graphs.paged_decode_logits`
through the GEMMs its options picked at load; for fp8 the FP8 tensor cores where the device's tuned tables have
the shape) against its own dequantizing reference path
(`reference=True`: weight-only numerics) on the same inputs, at 8 rows and at the largest batch:
relative error of the logits and greedy agreement. Per-token e4m3 activations add about 2-3% relative error
per GEMM (e4m3 keeps 3 mantissa bits: a rounding error of at most 2^-4 relative per element); 8B fp8 with
every GEMM on them read 3.3e-2 at 8 and at 64 rows on the H200.

Imports: stdlib and torch at import time.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.models import engine_model
from bench.offline import copy_bandwidth_gb_s, roofline
from serving.engine.build import EngineInfo, EngineLimits
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.linears import apply_options, install_quantized_linears
from serving.engine.models.llama import Transformer
from serving.engine.options import resolve_options
from serving.engine.quantize import FP8, NONE, QuantInfo, quantize_state
from serving.engine.runner import EngineRunner
from serving.engine.timing import time_generate
from serving.engine.tuned_tables import tables_for

FP8_DECODE_KERNELS = "fp8-decode-kernels"  # a bench method: fp8, the decode batches on the weight-only kernels
FP8_ROW_SCALING_IN_GEMM = "fp8-row-scaling-in-gemm"  # a bench method: fp8, one token scaled inside its GEMMs


def engine_method(method: str) -> tuple[str, dict[str, Any]]:
    """A bench method -> (engine.quantization, the `EngineOptions` fields it changes)."""
    if method == FP8_DECODE_KERNELS:
        return FP8, {"fp8_decode_tensor_cores": False}
    if method == FP8_ROW_SCALING_IN_GEMM:
        return FP8, {"fp8_row_scaling_in_kernel": True}
    return method, {}


@dataclass(frozen=True)
class QuantBenchConfig:
    shapes: tuple[str, ...] = ("llama-3.1-8b", "llama-3.2-1b")
    methods: tuple[str, ...] = (NONE, "fp8", "int8-weight-only")
    batch_sizes: tuple[int, ...] = (1, 64)
    prompt_len: int = 128
    gen_len: int = 128
    repeats: int = 3
    check: bool = True
    deadline_s: float = 1e9


def random_model(shape: str, *, n_layers: int | None = None, seed: int = 0) -> Transformer:
    """A bf16 `Transformer` of `shape` on the GPU with random weights (torch's default init; norms 1)."""
    import dataclasses

    from bench.models import model_args

    args = model_args(shape)
    if n_layers is not None:
        args = dataclasses.replace(args, n_layers=n_layers)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = engine_model(args)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def quantized_model(base: Transformer, method: str, *, dtype: torch.dtype = torch.bfloat16) -> Transformer:
    """A `Transformer` over `base`'s weights quantized by the bench `method` in memory, as conversion quantizes
    them (the unquantized tensors shared with `base`)."""
    args = base.args
    method, _ = engine_method(method)
    quant = QuantInfo(method)
    state = quantize_state(base.state_dict(), quant, n_layers=args.n_layers,
                           tie_word_embeddings=args.tie_word_embeddings)
    with torch.device("meta"):
        model = engine_model(args)
    install_quantized_linears(model, quant, n_layers=args.n_layers, tie_word_embeddings=args.tie_word_embeddings,
                              dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def runner_for(base: Transformer, method: str, *, max_batch_size: int, max_seq_len: int) -> EngineRunner:
    """An EngineRunner over `base`'s weights, quantized by `method` (the unquantized tensors shared)."""
    args = base.args
    quantization, overrides = engine_method(method)
    quant = QuantInfo(quantization)
    model = quantized_model(base, method)
    device = torch.device("cuda")
    limits = EngineLimits("bfloat16", max_batch_size=max_batch_size, max_input_len=max_seq_len - 1,
                          max_seq_len=max_seq_len)
    config = KVCacheConfig()  # room for max_batch_size sequences of max_seq_len
    info = EngineInfo(fingerprint="random-weights", toolchain={}, limits=limits, model=args, path=Path("."),
                      quantization=quant, kv_cache=config)
    apply_options(model, resolve_options(device, info, overrides))
    return EngineRunner(info, model, device, config)


def random_runner(shape: str, method: str, *, max_batch_size: int, max_seq_len: int,
                  n_layers: int | None = None) -> EngineRunner:
    """`runner_for` a fresh `random_model` (the GPU tests' engine)."""
    return runner_for(random_model(shape, n_layers=n_layers), method, max_batch_size=max_batch_size,
                      max_seq_len=max_seq_len)


def decode_weight_bytes(model: Transformer) -> int:
    """Bytes of the weights one decode step reads, each at its stored precision: all of them but the
    embedding table of an untied model (a step reads B rows of it)."""
    skip = {"tok_embeddings.weight"} if model.output is not None else set()
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in skip)


@torch.no_grad()
def check_kernels(runner: EngineRunner, *, batches: tuple[int, ...] = (8, 64), context: int = 100
                  ) -> dict[str, float]:
    """`check_step` at each of `batches`, capped at the engine's max batch size: {"logits_rel_err@8": ...}
    (an engine built for batch 1 alone is checked at 1 row, not skipped)."""
    out: dict[str, float] = {}
    for b in sorted({min(b, runner.info.limits.max_batch_size) for b in batches}):
        out.update({f"{k}@{b}": v for k, v in check_step(runner, batch=b, context=context).items()})
    return out


@torch.no_grad()
def check_step(runner: EngineRunner, *, batch: int, context: int) -> dict[str, float]:
    """The decode-only step (the GEMMs the engine's options picked, FP8 tensor cores at 16+ rows) against the dequantizing reference
    path, same inputs: relative error of the logits, greedy agreement (eager steps, after one mixed step of
    random prompts of `context` tokens; blocks borrowed for the call)."""
    from serving.engine.cuda_graphs import paged_decode_logits
    from serving.engine.kv_cache import blocks_for

    vocab, bs, dev = runner.info.model.vocab_size, runner.config.block_size, runner.device
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (batch, context), generator=gen).tolist()
    per = blocks_for(context + 1, bs)
    blocks = runner.allocator.take(batch * per)
    if blocks is None:
        raise ValueError(f"check_step: {batch} rows of {context + 1} positions need {batch * per} KV blocks, "
                         f"the pool has {runner.allocator.free} free")
    try:
        tables = [blocks[i * per:(i + 1) * per] for i in range(batch)]
        runner.forward([(p, 0, t) for p, t in zip(prompts, tables)], list(range(batch)))
        tokens = torch.randint(1, vocab, (batch,), generator=gen).to(dev)
        pos = torch.full((batch,), context, device=dev)
        table = torch.tensor(tables, device=dev)
        slots = table[:, context // bs] * bs + context % bs
        inputs = (runner.model, tokens, pos, slots, table, pos + 1, runner.cache, runner.rope_cos, runner.rope_sin)
        fast = paged_decode_logits(*inputs).double()
        slow = paged_decode_logits(*inputs, reference=True).double()
    finally:
        runner.allocator.give_back(blocks)
    return {"logits_rel_err": float((fast - slow).norm() / slow.norm()),
            "greedy_agreement": float((fast.argmax(-1) == slow.argmax(-1)).double().mean())}


def run_quantized(cfg: QuantBenchConfig, *, out_json: Path | None = None, log=print) -> dict[str, Any]:
    """Every (shape, method, batch) cell of `cfg`; JSON rewritten after each cell."""
    from bench.models import kv_bytes_per_token

    started = time.perf_counter()
    report: dict[str, Any] = {"config": asdict(cfg), "device": torch.cuda.get_device_name(0),
                              "tuned_tables": tables_for(torch.device("cuda", 0)).source,
                              "torch": torch.__version__, "cells": [], "checks": {}, "errors": [], "skipped": []}
    bw = copy_bandwidth_gb_s()
    report["copy_bandwidth_gb_s"] = bw
    log(f"copy bandwidth {bw:.0f} GB/s (read + write)")
    max_seq = -(-(cfg.prompt_len + cfg.gen_len) // 256) * 256

    def save() -> None:
        if out_json is not None:
            out_json.write_text(json.dumps(report, indent=1))

    for shape in cfg.shapes:
        base = random_model(shape)
        kv_token = kv_bytes_per_token(base.args, torch.bfloat16)
        for method in cfg.methods:
            what = f"{shape} {method}"
            if time.perf_counter() - started > cfg.deadline_s:
                report["skipped"].append(what)
                continue
            try:
                runner = runner_for(base, method, max_batch_size=max(cfg.batch_sizes), max_seq_len=max_seq)
                wbytes = decode_weight_bytes(runner.model)
                if cfg.check and method != NONE:
                    rows = (1, 8, 64) if method == FP8_ROW_SCALING_IN_GEMM else (8, 64)
                    report["checks"][what] = check_kernels(runner, batches=rows)
                    log(f"{what} kernels vs reference path: {report['checks'][what]}")
                t0 = time.perf_counter()
                runner.warm_up_prefill(cfg.prompt_len)
                for b in cfg.batch_sizes:
                    cell = time_generate(runner, batch=b, prompt_len=cfg.prompt_len, gen_len=cfg.gen_len,
                                         repeats=cfg.repeats, shape=shape, impl=f"engine-{method}")
                    cell.bandwidth_gb_s = bw
                    cell.roofline_tok_s = roofline(weight_bytes=wbytes, kv_bytes_per_token=kv_token, batch=b,
                                                   prompt_len=cfg.prompt_len, gen_len=cfg.gen_len, bandwidth_gb_s=bw)
                    cell.roofline_frac = cell.decode_tok_s / cell.roofline_tok_s
                    cell.note = f"quantization={method} step_weight_bytes={wbytes} warm-up+bench {time.perf_counter() - t0:.0f} s"
                    row = asdict(cell)
                    row.update(quantization=method, step_weight_bytes=wbytes)
                    report["cells"].append(row)
                    log(cell.row())
                    save()
            except Exception as exc:  # noqa: BLE001 - one failed engine must not lose the others
                report["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
                log(f"FAILED {what}: {type(exc).__name__}: {exc}")
                save()
            runner = None
            gc.collect()
            torch.cuda.empty_cache()
        base = None
        gc.collect()
        torch.cuda.empty_cache()
    report["wall_s"] = time.perf_counter() - started
    save()
    return report


def render_quant_table(report: dict[str, Any]) -> str:
    """Markdown: one row per (shape, method, batch), the e2e ratio to bf16 at the same (shape, batch)."""
    cells = report["cells"]
    bf16 = {(c["shape"], c["batch"]): c["e2e_tok_s"] for c in cells if c["quantization"] == NONE}
    lines = [f"copy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s; {report['device']}",
             ("| shape | quantization | batch | step weight GB | decode tok/s | roofline tok/s | % roofline | "
             "e2e tok/s | e2e vs bf16 | TPOT p50 ms |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        ref = bf16.get((c["shape"], c["batch"]))
        ratio = f"{c['e2e_tok_s'] / ref:.2f}x" if ref else "-"
        lines.append(f"| {c['shape']} | {c['quantization']} | {c['batch']} | {c['step_weight_bytes'] / 1e9:.2f} | "
                     f"{c['decode_tok_s']:,.0f} | {c['roofline_tok_s']:,.0f} | {c['roofline_frac'] * 100:.1f}% | "
                     f"{c['e2e_tok_s']:,.0f} | {ratio} | {c['tpot_ms_p50']:.3f} |")
    for what, check in report["checks"].items():
        lines.append(f"check {what}: " + ", ".join(f"{k} {v:.2e}" for k, v in check.items()))
    lines += [f"ERROR {e}" for e in report["errors"]] + [f"skipped {s}" for s in report["skipped"]]
    return "\n".join(lines)
