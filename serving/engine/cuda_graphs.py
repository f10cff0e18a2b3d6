"""Decode-only steps: inputs kept on the device, the layers' decode GEMMs, CUDA graphs over block tables.

Once every live request has its prompt in the cache, a paged step is B requests of one token each. Such a
step runs here instead of through `step.paged_forward` (which stays the path of every step with a
prefill chunk in it):

- **Block tables on the device, updated incrementally.** `tables` is one row per possible first block
  (a sequence's first block is its own while it lives, so it names the sequence; with prefix caching, the
  first block it took itself, `prefix_cache.BlockTable.row_key`): `[num_blocks + 1, W]`,
  W the blocks of one `max_seq_len` sequence. A step sends only each row's key (its first block), token
  and position, plus the table entries that changed since the sequence's last decode step (a block
  opened every `block_size` tokens; a whole row when a new sequence took that first block). The step
  derives each token's slot and visible length on the device. So the host's per-step work is three small
  integer arrays, not a padded `[B, W]` table, and one pinned copy.
- **The layers' own multiplications.** The projections and the MLP call their layers, which picked their
  GEMMs at load from the engine's options (`linears.apply_options`: with "triton" decode GEMMs the tuned
  skinny kernels where they were tuned, which are the decode shapes of up to 64 rows; cuBLAS beyond),
  attention through `paged_attention.paged_decode_attention` (the Triton kernel reading the pools through the
  tables, launched as `options.attention` says).
- **CUDA graphs per batch bucket** (`BUCKETS`, capped at the live limit): rows past B are padding that
  writes its K/V into a trash block (block `num_blocks`, never handed out) and reads only it. The
  logits land in one shared `[max_live, V]` float32 buffer (a view of it is returned; consume it before
  the next step). `warm_up()` captures every bucket before serving; a bucket not captured yet is captured
  the first time it is needed (capture runs the step on padding only: nothing live is written).

On the CPU (or `graphs=False`) the same code runs eagerly on the same buffers: the tests check it against
`paged_forward`.

On CUDA the rotary embedding and the K/V write are one kernel (`paged_rope`). A step may take its input
tokens from the device (`device_tokens`): the previous step's samples, which the scheduler has not read
yet when it runs one step ahead (`scheduler`).

Imports: stdlib and torch only (Triton through the kernels, lazily).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from serving.engine import paged_rope
from serving.engine.kv_cache import PagedKVCache, blocks_for
from serving.engine.linear_quantized import prescale_rows_for
from serving.engine.model import ModelArgs, RMSNorm, StepContext, layer_rope
from serving.engine.models.llama import Transformer
from serving.engine.options import AttentionKernelOptions
from serving.engine.paged_attention import paged_decode_attention
from serving.engine.parallel import SINGLE, ParallelConfig
from serving.engine.pdl import supported as pdl_supported

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def decode_buckets(max_live: int) -> list[int]:
    """The batch buckets graphs are captured at: BUCKETS up to `max_live`, and `max_live` itself."""
    return sorted({b for b in BUCKETS if b < max_live} | {max_live})


def is_decode_only(chunks: Sequence[tuple[list[int], int, list[int]]], sample: Sequence[int]) -> bool:
    """Whether a step is single tokens only, each sampled in order (what `DecodeGraphs.step` takes)."""
    in_order = all(i == s for i, s in enumerate(sample))
    return len(sample) == len(chunks) and in_order and all(len(toks) == 1 for toks, _, _ in chunks)


@dataclass
class DecodeStep(StepContext):
    """The attention of a decode-only step: one token a row, its K/V written by the rotation kernel
    (`paged_rope.rotate_and_write`), attention over the row's blocks (`paged_attention.paged_decode_attention`).
    No host sync and shapes fixed by the batch: capturable."""

    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B] block * block_size + offset of each row's new K/V
    tables: torch.Tensor  # [B, W] block tables
    lengths: torch.Tensor  # [B] visible positions (position + 1)
    cache: PagedKVCache
    rope_cos: torch.Tensor  # [max_seq_len, hd] tables
    rope_sin: torch.Tensor
    args: ModelArgs
    kernel: AttentionKernelOptions  # the paged attention kernel's launch settings
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the windowed layers' own tables (Gemma 3)

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        a, bsz = self.args, qkv.shape[0]
        cos, sin = layer_rope(a, layer, (self.rope_cos, self.rope_sin), self.local_rope)
        q, _ = paged_rope.rotate_and_write(qkv, self.positions, self.slots, cos, sin, self.cache,
                                           layer, a.n_heads, a.n_kv_heads, keys=False, pdl=self.pdl)
        y = paged_decode_attention(q.view(bsz, a.n_kv_heads, a.n_heads // a.n_kv_heads, a.head_dim),
                                   self.cache.k[layer], self.cache.v[layer], self.tables, self.lengths,
                                   a.softmax_scale, pdl=self.pdl, kernel=self.kernel, window=a.window(layer))
        return y.reshape(bsz, a.q_size)

    def last_hidden(self, norm: RMSNorm, x: torch.Tensor, ff: torch.Tensor) -> torch.Tensor:
        return norm.add(x, ff, pdl=self.pdl)[1]


def paged_decode_logits(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        tables: torch.Tensor, lengths: torch.Tensor, cache: PagedKVCache, rope_cos: torch.Tensor,
                        rope_sin: torch.Tensor, pdl: bool = False, reference: bool = False,
                        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One token per row (tokens, positions, slots, lengths [B]; tables [B, W]) through `Transformer.step` with a
    `DecodeStep` -> logits [B, V] in the model's dtype (the caller's copy into its float32 buffer converts them:
    one pass over [B, V] instead of two). The layers multiply through the GEMMs they picked at load (`reference`:
    through their dequantizing references, what the checks compare against); `pdl`: the engine's own kernels
    launched with programmatic dependent launch (each may start while the one before it drains;
    `serving.engine.pdl`); `local_rope`: the windowed layers' own rope tables (`ModelArgs.local_rope_theta`)."""
    layer, bsz = model.layers[0], tokens.shape[0]
    ctx = DecodeStep(reference=reference, pdl=pdl,
                     qkv_e4m3=prescale_rows_for(layer.attention.wqkv, bsz, tokens.device),
                     w13_e4m3=prescale_rows_for(layer.feed_forward.w13, bsz, tokens.device),
                     positions=positions, slots=slots, tables=tables, lengths=lengths, cache=cache,
                     rope_cos=rope_cos, rope_sin=rope_sin, args=model.args, kernel=model.options.attention,
                     local_rope=local_rope)
    return ctx.linear(model.head(), model.step(tokens, ctx))


class DecodeGraphs:
    """The decode-only steps of one `EngineRunner` (see the module doc). Not thread-safe: the scheduler's."""

    def __init__(self, model: Transformer, cache: PagedKVCache, rope_cos: torch.Tensor, rope_sin: torch.Tensor, *,
                 max_live: int, max_seq_len: int, graphs: bool,
                 log: Callable[[str], None] = lambda line: None, parallel: ParallelConfig = SINGLE,
                 local_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """`parallel`: this rank's group when the model is sharded (its LM head's logits gathered here)."""
        self.model, self.cache, self.rope_cos, self.rope_sin = model, cache, rope_cos, rope_sin
        self.parallel = parallel
        self.local_rope = local_rope  # the windowed layers' own rope tables (Gemma 3)
        self.use_graphs, self.log = graphs, log
        self.pdl = model.options.decode_pdl and pdl_supported(rope_cos.device)
        self.block_size = cache.block_size
        self.trash = cache.num_blocks - 1  # the pool's last block: padding rows write and read only it
        self.width = blocks_for(max_seq_len, self.block_size)
        self.buckets = decode_buckets(max_live)
        dev = rope_cos.device
        self.device = dev
        self.tables = torch.full((cache.num_blocks, self.width), self.trash, dtype=torch.long, device=dev)
        self.inputs = torch.zeros(3, max_live, dtype=torch.long, device=dev)  # keys, tokens, positions
        self.inputs[0].fill_(self.trash)
        self.logits = torch.empty(max_live, model.args.vocab_size, dtype=torch.float32, device=dev)
        self.written: dict[int, tuple[list[int], int]] = {}  # first block -> (its table list, entries on the device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.capture_s = 0.0
        self.steps = 0

    def bucket(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, chunks: Sequence[tuple[list[int], int, list[int]]],
             device_tokens: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """A decode-only step (`is_decode_only`) -> float32 logits [B, V], a view of the shared buffer.
        `device_tokens` (tokens [M] on the device, a row of it for each chunk): the input tokens come from
        there (a previous step's samples the host has not read), not from the chunks."""
        n = len(chunks)
        bsz = self.bucket(n)
        if self.use_graphs and bsz not in self.graphs:
            self._capture(bsz)
        keys, toks, poss, updates = self._host_inputs(chunks)
        pad = bsz - n
        rows = device_tokens[1] if device_tokens is not None else []
        host = torch.tensor(keys + [self.trash] * pad + toks + [0] * pad + poss + [0] * pad + rows + updates,
                            dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        flat = host.to(self.device, non_blocking=True)
        self.inputs[:, :bsz].copy_(flat[:3 * bsz].view(3, bsz))
        if device_tokens is not None:
            self.inputs[1, :n] = device_tokens[0][flat[3 * bsz:3 * bsz + n]]
        if updates:
            upd = flat[3 * bsz + len(rows):].view(3, -1)
            self.tables[upd[0], upd[1]] = upd[2]
        if self.use_graphs:
            self.graphs[bsz].replay()
        else:  # eagerly, reading only as many table columns as the longest row needs
            self._forward(bsz, blocks_for(max(poss) + 1, self.block_size))
        self.steps += 1
        return self.logits[:n]

    def _host_inputs(self, chunks: Sequence[tuple[list[int], int, list[int]]]
                     ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Each row's key (first block), token and position, and the table entries (rows, columns, blocks,
        flattened) the device does not have yet."""
        bs, written = self.block_size, self.written
        keys, toks, poss = [], [], []
        up_rows: list[int] = []
        up_cols: list[int] = []
        up_blocks: list[int] = []
        for tokens, start, table in chunks:
            key = getattr(table, "row_key", None)  # a table of shared leading blocks (prefix_cache.BlockTable)
            key = table[0] if key is None else key
            seen = written.get(key)
            done = seen[1] if seen is not None and seen[0] is table else 0
            used = start // bs + 1
            if used > done:
                up_rows += [key] * (used - done)
                up_cols += range(done, used)
                up_blocks += table[done:used]
                written[key] = (table, used)
            keys.append(key)
            toks.append(tokens[0])
            poss.append(start)
        return keys, toks, poss, up_rows + up_cols + up_blocks

    def _forward(self, bsz: int, width: int | None = None) -> None:
        keys, tokens, positions = self.inputs[0, :bsz], self.inputs[1, :bsz], self.inputs[2, :bsz]
        tables = self.tables[keys] if width is None else self.tables[keys, :width]  # [B, W]
        bs = self.block_size
        slots = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs + positions % bs
        logits = paged_decode_logits(self.model, tokens, positions, slots, tables, positions + 1, self.cache,
                                     self.rope_cos, self.rope_sin, pdl=self.pdl, local_rope=self.local_rope)
        self.logits[:bsz].copy_(self.parallel.gather_vocab(logits, self.logits.shape[1]))

    # -- graphs -----------------------------------------------------------------------------------
    def _capture(self, bsz: int) -> None:
        """Capture bucket `bsz` on padding rows (keys: the trash block): no live K/V is touched."""
        started = time.perf_counter()
        self.inputs[0, :bsz].fill_(self.trash)
        self.inputs[1:, :bsz].zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles the Triton kernels, sets up cuBLAS, outside the capture
            for _ in range(2):
                self._forward(bsz)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(bsz)
        torch.cuda.synchronize()
        self.graphs[bsz] = graph
        took = time.perf_counter() - started
        self.capture_s += took
        self.log(f"captured paged decode graph batch={bsz} in {took:.2f} s")

    def drop_graphs(self) -> None:
        """Forget every captured graph and their memory pool: the next steps capture afresh (a new pool: one
        whose graphs are all gone cannot be captured into again), with the model's options as they are then
        (`decode_pdl`)."""
        self.graphs.clear()
        self.pdl = self.model.options.decode_pdl and pdl_supported(self.device)
        if self.use_graphs:
            torch.cuda.synchronize()
            self.pool = torch.cuda.graph_pool_handle()

    @torch.no_grad()
    def warm_up(self) -> None:
        """Capture every bucket's graph (before serving: a capture mid-run stalls every stream)."""
        if self.use_graphs:
            for bsz in self.buckets:
                if bsz not in self.graphs:
                    self._capture(bsz)
