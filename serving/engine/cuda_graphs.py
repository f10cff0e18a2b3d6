"""CUDA graphs of the decode step, one per (batch bucket, KV-length bucket).

`DecodeGraphs.step(tokens [b], input_pos [b], kv_needed)` runs `model.decode_step` for cache rows
[0, b) by replaying the graph of the smallest batch bucket >= b and the smallest KV bucket >= kv_needed
(multiples of `kv_block`, capped at the cache length). Rows [b, bucket) of the bucket are fed token 0
at position 0: they must be free cache rows (the runner and the scheduler fill rows from 0 up), whose
position 0 is rewritten by the next prefill into them. Graphs are captured lazily, the first time a
bucket is needed (tens of ms each for the eager step; a compiled step compiles first).

With `compile=True` the step is put under `torch.compile(dynamic=True, fullgraph=True)` (inductor
fuses RMSNorm, rotary and the elementwise tails) and its kernels are then captured like the eager
ones, so one compile (plus one for batch 1, which dynamo specialises) serves every bucket.

The replay writes into static buffers: the logits returned are a view that the next replay
overwrites. Consume them (sample) before the next `step`.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from serving.engine.model import Transformer, decode_step

DEFAULT_KV_BLOCK = 256


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_batch_size (which is always a bucket)."""
    out = [b for b in (1, 2, 4) if b < max_batch_size]
    out += list(range(8, max_batch_size, 8))
    out.append(max_batch_size)
    return sorted(set(out))


class DecodeGraphs:
    """Lazily captured CUDA graphs of the decode step over the static KV cache of `model`."""

    def __init__(self, model: Transformer, *, kv_block: int = DEFAULT_KV_BLOCK, compile: bool = False,
                 log: Callable[[str], None] | None = None) -> None:
        self.model = model
        self.kv_block = kv_block
        self.max_batch = model.max_batch_size
        self.max_seq = model.max_seq_len
        self.buckets = batch_buckets(self.max_batch)
        self.log = log or (lambda msg: None)
        dev = model.tok_embeddings.weight.device
        self.tokens = torch.zeros(self.max_batch, dtype=torch.long, device=dev)  # [maxB]
        self.input_pos = torch.zeros(self.max_batch, dtype=torch.long, device=dev)  # [maxB]
        self.fn: Callable[..., torch.Tensor] = decode_step
        self.compiled = compile
        if compile:
            self.fn = torch.compile(decode_step, dynamic=True, fullgraph=True)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_s = 0.0

    def batch_bucket(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    def kv_bucket(self, kv_needed: int) -> int:
        return min(self.max_seq, -(-kv_needed // self.kv_block) * self.kv_block)

    @torch.no_grad()
    def _capture(self, bsz: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        started = time.perf_counter()
        tokens, pos = self.tokens[:bsz], self.input_pos[:bsz]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compiles when compiled) outside the capture
            for _ in range(2):
                self.fn(self.model, tokens, pos, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.fn(self.model, tokens, pos, kv_len)  # [bsz, V] float32, a static buffer
        torch.cuda.synchronize()
        took = time.perf_counter() - started
        self.capture_s += took
        self.log(f"captured decode graph batch={bsz} kv_len={kv_len} in {took:.2f} s")
        return graph, logits

    def prepare(self, bsz: int, kv_needed: int) -> None:
        """Capture the graph that a step of `bsz` rows needing `kv_needed` positions will replay."""
        key = (self.batch_bucket(bsz), self.kv_bucket(kv_needed))
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_needed: int) -> torch.Tensor:
        """tokens, input_pos: [b] (device) -> float32 logits [b, V] (a view into a static buffer)."""
        b = tokens.shape[0]
        bsz, kv_len = self.batch_bucket(b), self.kv_bucket(kv_needed)
        if kv_needed > kv_len:
            raise ValueError(f"decode needs {kv_needed} cache positions > max_seq_len={self.max_seq}")
        key = (bsz, kv_len)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bsz, kv_len)
        graph, logits = self.graphs[key]
        self.tokens[:b].copy_(tokens, non_blocking=True)
        self.input_pos[:b].copy_(input_pos, non_blocking=True)
        if b < bsz:
            self.tokens[b:bsz].zero_()
            self.input_pos[b:bsz].zero_()
        graph.replay()
        return logits[:b]
