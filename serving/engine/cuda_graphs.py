"""CUDA graphs of the decode step, one per (batch bucket, KV-length bucket).

`DecodeGraphs.step(tokens [b], input_pos [b], kv_needed)` runs `model.decode_step` for cache rows
[0, b) by replaying the graph of the smallest batch bucket >= b and the smallest KV bucket >= kv_needed
(multiples of `kv_block`, capped at the cache length). Rows [b, bucket) of the bucket are fed token 0
at position 0: they must be free cache rows (the runner and the scheduler fill rows from 0 up), whose
position 0 is rewritten by the next prefill into them. Graphs are captured lazily, the first time a
bucket is needed (tens of ms each for the eager step; a compiled step compiles first).

With `compile=True` (or "dynamic") the step's start, one decode layer and the LM head are each put under
`torch.compile(dynamic=True, fullgraph=True)` (`compiled_parts`; inductor fuses RMSNorm, rotary and the
elementwise tails) and their kernels are then captured like the eager ones, so one compile of each (plus
one for batch 1, which dynamo specialises) serves every bucket and every layer. Dynamo traces one layer
instead of all of them. On the H200, Llama-1B, against `compile="whole"` (the whole step under one compile)
in the same run: compile and capture of batch 1 5.4 against 19.3 s, of batch 64 4.7 against 15.4 s; the
step 0.852 against 0.866 ms at batch 1 and 1.041 against 1.038 ms at batch 64 (same kernels, fewer at
batch 1).
`compile="static"` compiles each (batch bucket, KV bucket) for its exact shapes, with inductor's
coordinate-descent tuning of the generated kernels: faster kernels, one compile per captured graph.
`compile="auto"` (the runner's default) does that for batch 1 at the first KV bucket of models under
4 GB of weights, where inductor then fuses each matrix-vector product with its RMSNorm/SiLU neighbours
into one tuned reduction kernel (Llama-1B shape on the H200: 1.00 vs 1.12 ms per step; at the 8B shape
the same fusion was slower than cuBLAS, 5.06 vs 4.89 ms), and compiles every other graph with dynamic
shapes, where cuBLAS runs the GEMMs either way (1B batch 64: 1.32 vs 1.33 ms). A model whose batch-1
products all have tuned Triton kernels (`tuned_single_row`) skips the static compile: its speed
changes from compile to compile (Llama-1B, the same code compiled eight times in one process: 0.90 to
1.09 ms per step; what the tuning picks is the likely cause, not established), while the dynamic step
on the tuned kernels ran 0.878-0.880 ms. Batch 1 at longer contexts takes the dynamic compile too: a
static compile per KV bucket, captured lazily while serving, would stall every stream for a whole
compile. `warm_up` captures every graph whose capture compiles.
`pdl=True` launches the step's kernels with programmatic dependent launch (Hopper and later; ignored
elsewhere): inductor generates it for its kernels, and the step's own Triton kernels (skinny GEMMs,
attention) take their PDL variants (`serving.engine.pdl`). Each kernel may then start while its
predecessor finishes, and waits for it before reading what it wrote: it takes off part of the
per-kernel ramp and tail that dominate a small model's step.
`whole_row_norms` (default) compiles the step's row reductions (residual add + RMSNorm) in one pass over
each row where that measured faster (`serving.engine.whole_row_norms`; Llama-1B batch 64: 1.037 against
1.076 ms per step on an H200).

The replay writes into static buffers: the logits returned are a view that the next replay
overwrites. Consume them (sample) before the next `step`.

The inputs are the buffers of a `DecodeState` (the runner's), and each graph ends with its `advance`
(to the greedy tokens the step computed): `step` copies the caller's tokens and positions in first
(`EngineRunner.generate`), `replay` uses the buffers as they stand (the in-flight scheduler, which keeps
its rows' state there between steps).
Capturing a graph runs the step twice outside the capture; those runs would write K/V at the
buffers' positions and advance the buffers, so the touched cache entries and the buffers are saved
before and put back after each run: a lazy capture in the middle of serving changes nothing.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from serving.engine.compile_cache import pin_ptxas
from serving.engine.decode_state import DecodeState
from serving.engine.linear_quantized import model_quantization
from serving.engine.model import (
    StepParts,
    Transformer,
    decode_head,
    decode_layer,
    decode_start,
    decode_step_greedy,
    gemm_impl_of,
)
from serving.engine.pdl import supported as pdl_supported
from serving.engine.whole_row_norms import compile_options as whole_row_options
from serving.engine.whole_row_norms import whole_row_reductions

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (model, tokens, positions, kv_len) -> (logits, greedy)
DEFAULT_KV_BLOCK = 256
SINGLE_ROW_FUSION_MAX_BYTES = 4 * 10**9  # "auto": batch 1 compiled static only below this (see above)


def _decode_step_single(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor, kv_len: int,
                        pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # F.linear, so that inductor fuses each matrix-vector product with its neighbours (the point of the
    # static batch-1 compile); an opaque Triton GEMM would stop that fusion
    return decode_step_greedy(model, tokens, input_pos, kv_len, gemm="torch", pdl=pdl)


@dataclass
class _Saved:
    """What a capture's warm-up runs overwrite: rows [0, bsz) of the state and their K/V entries."""

    rows: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer


def single_row_static(bsz: int, kv_len: int, first_kv_bucket: int) -> bool:
    """Whether the graph of (batch bucket, KV bucket) captures the static batch-1 compile ("auto").

    Only at the first KV bucket: dynamo compiles a static step once per shape, so a graph of batch 1 at
    another KV bucket, captured lazily while serving, would stall every stream for a whole inductor
    compile. Those graphs take the dynamic compile, whose batch-1 variant serves every KV bucket."""
    return bsz == 1 and kv_len == first_kv_bucket


def tuned_single_row(model: Transformer) -> bool:
    """Whether every weight product of the model's batch-1 step runs a tuned Triton kernel in the dynamic
    compile (the tuned skinny table; w13 through the gate/up table or the skinny one)."""
    if gemm_impl_of(model) != "triton":
        return False
    from serving.engine import gate_up, skinny_gemm

    a = model.args
    dim, inner = a.dim, a.intermediate_size
    tables = model.options.tuned
    fused_w13 = model.options.decode_gate_up and gate_up.config_for(1, inner, dim, tables) is not None
    w13 = fused_w13 or skinny_gemm.config_for(1, 2 * inner, dim, tables.skinny) is not None
    others = ((a.qkv_size, dim), (dim, a.q_size), (dim, inner), (a.vocab_size, dim))
    return w13 and all(skinny_gemm.config_for(1, n, k, tables.skinny) is not None for n, k in others)


def graphs_to_warm(buckets: list[int], kv_buckets: list[int], single_static: bool) -> list[tuple[int, int]]:
    """The (batch bucket, KV bucket) graphs to capture before serving, so that no capture while serving
    compiles: every batch bucket at the first KV bucket and, next to a static batch-1 step, batch 1 at
    the second KV bucket (the dynamic compile's batch-1 variant; dynamo specialises batch 1). Graphs of
    further KV buckets replay compiled code: capturing one lazily takes tens of ms."""
    first = kv_buckets[0]
    out = [(bsz, first) for bsz in buckets]
    if single_static and len(kv_buckets) > 1:
        out.append((1, kv_buckets[1]))
    return out


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_batch_size (which is always a bucket)."""
    out = [b for b in (1, 2, 4) if b < max_batch_size]
    out += list(range(8, max_batch_size, 8))
    out.append(max_batch_size)
    return sorted(set(out))


def compiled_parts(options: dict[str, bool] | None, backend: str = "inductor") -> StepParts:
    """The step's start, one decode layer and the LM head, each under torch.compile(dynamic=True, fullgraph=True)
    (`model.StepParts`): dynamo traces one layer where a compile of the whole step traces every layer, and all
    layers run the same compiled code. The kernels are the whole step's (`decode_layer` keeps each residual add
    with the next RMSNorm)."""
    def compiled(fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=True, fullgraph=True, backend=backend, options=options)

    return StepParts(compiled(decode_start), compiled(decode_layer), compiled(decode_head))


def compile_options(pdl: bool) -> dict[str, bool]:
    """Inductor settings of the compiled step beyond its tuning: programmatic dependent launch or none."""
    return {"triton.enable_pdl": True} if pdl else {}


class DecodeGraphs:
    """Lazily captured CUDA graphs of the decode step over the static KV cache of `model`."""

    def __init__(self, model: Transformer, *, kv_block: int = DEFAULT_KV_BLOCK, compile: bool | str = False,
                 state: DecodeState | None = None, log: Callable[[str], None] | None = None,
                 pdl: bool = False, whole_row_norms: bool = True) -> None:
        self.model = model
        self.kv_block = kv_block
        self.max_batch = model.max_batch_size
        self.max_seq = model.max_seq_len
        self.buckets = batch_buckets(self.max_batch)
        self.log = log or (lambda msg: None)
        dev = model.tok_embeddings.weight.device
        self.state = state or DecodeState.zeros(self.max_batch, dev)
        self.tokens, self.input_pos = self.state.tokens, self.state.positions  # [maxB] each
        self.compiled = bool(compile)
        if compile not in (False, True, "dynamic", "whole", "static", "auto"):
            raise ValueError(f"compile={compile!r}: expected False, True, 'dynamic', 'whole', 'static' or 'auto'")
        if self.compiled:
            pin_ptxas()  # before any kernel of the step is assembled: one ptxas, one Triton cache key, every load
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        quantized = model_quantization(model) != "none"  # the static step's F.linear would dequantize each weight
        if compile == "auto" and (weight_bytes >= SINGLE_ROW_FUSION_MAX_BYTES or tuned_single_row(model) or quantized):
            compile = "dynamic"
        static = dynamic = None
        self.pdl = pdl and pdl_supported(dev)
        self.whole_row_norms = whole_row_norms
        inductor = {**compile_options(self.pdl), **whole_row_options(whole_row_norms)}
        step, step_single = decode_step_greedy, _decode_step_single
        if self.pdl:
            step, step_single = partial(decode_step_greedy, pdl=True), partial(_decode_step_single, pdl=True)
        if compile in ("static", "auto"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
            # a code object of its own: dynamo caches per code object, so the two compiles do not mix
            static = torch.compile(step_single, dynamic=False, fullgraph=True,
                                   options={"coordinate_descent_tuning": True, **inductor})
        if compile == "whole":
            dynamic = torch.compile(step, dynamic=True, fullgraph=True, options=inductor or None)
        elif compile in (True, "dynamic", "auto"):
            dynamic = partial(step, parts=compiled_parts(inductor or None))
        self.fn: StepFn = dynamic or static or step
        self.fn_single: StepFn = static or self.fn  # the step of batch bucket 1
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_s = 0.0
        self.capture_times: dict[tuple[int, int], float] = {}  # seconds per captured graph, compile included

    def batch_bucket(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    def kv_bucket(self, kv_needed: int) -> int:
        return min(self.max_seq, -(-kv_needed // self.kv_block) * self.kv_block)

    @torch.no_grad()
    def _capture(self, bsz: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        started = time.perf_counter()
        tokens, pos = self.tokens[:bsz], self.input_pos[:bsz]
        fn = self.fn_single if single_row_static(bsz, kv_len, self.kv_bucket(1)) else self.fn
        kept = self._save(bsz)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # warm up outside the capture; a compiled step compiles here, under the norms' choice
        with torch.cuda.stream(stream), whole_row_reductions(self.whole_row_norms):
            for _ in range(2):
                self.state.advance(fn(self.model, tokens, pos, kv_len)[1])
                self._restore(bsz, kept)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, next_tokens = fn(self.model, tokens, pos, kv_len)  # [bsz, V] float32, a static buffer
            self.state.advance(next_tokens)
        torch.cuda.synchronize()
        took = time.perf_counter() - started
        self.capture_s += took
        self.capture_times[(bsz, kv_len)] = took
        self.log(f"captured decode graph batch={bsz} kv_len={kv_len} in {took:.2f} s")
        return graph, logits

    def _save(self, bsz: int) -> _Saved:
        """Copies of the buffers' rows [0, bsz) and of the K/V entries a step of them writes."""
        rows = torch.arange(bsz, device=self.tokens.device)
        pos = self.input_pos[:bsz].clone()
        caches = [layer.attention.kv_cache for layer in self.model.layers]
        kv = [(c.k_cache[rows, :, pos], c.v_cache[rows, :, pos]) for c in caches]  # advanced indexing: copies
        return _Saved(rows, self.tokens[:bsz].clone(), pos, kv)

    def _restore(self, bsz: int, kept: _Saved) -> None:
        self.tokens[:bsz].copy_(kept.tokens)
        self.input_pos[:bsz].copy_(kept.positions)
        for layer, (k, v) in zip(self.model.layers, kept.kv):
            cache = layer.attention.kv_cache
            cache.k_cache[kept.rows, :, kept.positions] = k
            cache.v_cache[kept.rows, :, kept.positions] = v

    def kv_buckets(self) -> list[int]:
        """Every KV bucket a graph can be captured at, ascending."""
        return [self.kv_bucket(kv) for kv in range(1, self.max_seq + 1, self.kv_block)]  # the last is max_seq

    def warm_up(self) -> None:
        """Capture every graph whose capture compiles (`graphs_to_warm`): after this, serving compiles
        nothing."""
        for bsz, kv_len in graphs_to_warm(self.buckets, self.kv_buckets(), self.fn_single is not self.fn):
            self.prepare(bsz, kv_len)

    def prepare(self, bsz: int, kv_needed: int) -> None:
        """Capture the graph that a step of `bsz` rows needing `kv_needed` positions will replay."""
        key = (self.batch_bucket(bsz), self.kv_bucket(kv_needed))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)

    def _graph(self, b: int, kv_needed: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, int]:
        bsz, kv_len = self.batch_bucket(b), self.kv_bucket(kv_needed)
        if kv_needed > kv_len:
            raise ValueError(f"decode needs {kv_needed} cache positions > max_seq_len={self.max_seq}")
        key = (bsz, kv_len)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bsz, kv_len)
        graph, logits = self.graphs[key]
        return graph, logits, bsz

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_needed: int) -> torch.Tensor:
        """tokens, input_pos: [b] (device) -> logits [b, V] (a view into a static buffer): float32, or bf16
        where the LM head's kernel wrote them (`model.decode_step_greedy`)."""
        b = tokens.shape[0]
        graph, logits, bsz = self._graph(b, kv_needed)
        self.tokens[:b].copy_(tokens, non_blocking=True)
        self.input_pos[:b].copy_(input_pos, non_blocking=True)
        if b < bsz:
            self.tokens[b:bsz].zero_()
            self.input_pos[b:bsz].zero_()
        graph.replay()
        return logits[:b]

    @torch.no_grad()
    def replay(self, b: int, kv_needed: int) -> torch.Tensor:
        """The step of rows [0, b) on the state's buffers as they stand -> logits [b, V] (as `step`'s); rows
        [b, bucket) of the bucket must be parked (position 0, not active)."""
        graph, logits, _ = self._graph(b, kv_needed)
        graph.replay()
        return logits[:b]
