"""One forward of a mixed step over the paged KV cache: prefill chunks and decode tokens packed together.

A step computes T tokens of N sequences, back to back (no padding): each sequence contributes one chunk,
its tokens at positions `[start, start + n)` (n = 1 for a decode, up to a whole prompt for a prefill or a
chunk of one). Projections and the MLP run on the packed `[T]` tokens; each token's K/V go to its slot in
the pools (`PagedKVCache.write`); attention reads each sequence's positions `[0, start + n)` through its
block table, causal inside the chunk:

- the single-token chunks (decodes, and a prompt's last token alone) together: `paged_attention` (on CUDA a
  Triton kernel reading the pools through the tables in place; elsewhere the tables gathered and masked);
- the longer chunks that start at position 0 (whole prompts, or their first chunks), grouped by length: one
  causal SDPA per length over the step's own K/V (nothing read back from the cache);
  a group whose tokens lie in a row (the usual case: prompts are planned one after another) is read as views
  of q/k/v and written back as a slice, and a step that is one such group and nothing else hands its
  attention output straight to the output projection (the gathers and the index_put they replace took
  ~14 ms of a 16,384-token FP8 step's 222 ms of kernels on the H200);
- the other chunks (later chunks of prompts: a prompt split across steps, or one that starts after its
  cached prefix, `prefix_cache`), grouped by length: their contexts gathered through their tables in one
  batched read (padded to the group's longest), then one SDPA under each chunk's causal mask, in slices of
  at most `LATER_CHUNK_POSITIONS` gathered positions (a burst of prompts behind one cached system prompt is
  one group, not a gather and an SDPA per prompt and layer).

A layer with a sliding window (`ModelArgs.window`: Mistral's, Qwen2's, Gemma 3's local layers) masks the keys
older than its window in each of the three: the decode kernel starts at the window's first block (never reading
the blocks before it), the prompts' SDPA takes a banded causal mask (`causal_band`), the later chunks' mask is
banded too. A model of a local rope (Gemma 3) rotates its windowed layers by their own tables (`local_rope`).

With an fp8 KV cache the pools hold e4m3 and everything read back from them is dequantized (`gather_tables`, the
decode attention's conversion in registers), while a chunk from position 0 attends over its own fresh K/V
in the model's dtype, never rounded (as vLLM does): only positions of earlier steps carry e4m3's error.

Eager, on the CPU and on CUDA (no CUDA graphs yet). The result is the float32 logits of the tokens named by
`sample_index` (each sampling sequence's last computed token).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from serving.engine import paged_rope
from serving.engine.kv_cache import PagedKVCache
from serving.engine.linear_quantized import prescale_rows_for
from serving.engine.model import ModelArgs, RMSNorm, StepContext, layer_rope
from serving.engine.models.llama import Transformer
from serving.engine.options import AttentionKernelOptions
from serving.engine.paged_attention import paged_decode_attention
from serving.engine.prefill_attention import causal_band, sdpa

# The most context positions (chunks x gathered positions) one batched attention over later prompt chunks reads
# at once: bounds the copies of K and V it makes (Llama-8B, bf16: 4 KiB a position gathered, 16 KiB more with the
# K/V heads repeated for the query heads, about 1.3 GiB at this many); one chunk is never split
LATER_CHUNK_POSITIONS = 1 << 16

# One sequence's part of a step (host values): (the chunk's input tokens, the position of its first token,
# the sequence's block table covering positions [0, start + len(tokens))). A plain tuple: one is built per
# live request per step.
ChunkPlan = tuple[list[int], int, list[int]]


@dataclass(frozen=True)
class PagedStep:
    """A step's inputs on the device (`build_step`)."""

    tokens: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long: block * block_size + offset of each token's K/V
    single_rows: torch.Tensor  # [Bd] long: where the single-token chunks' tokens are in [T]
    single_tables: torch.Tensor  # [Bd, nmax] long, padded with block 0
    single_lengths: torch.Tensor  # [Bd] long: visible positions (start + 1)
    fresh_groups: tuple[torch.Tensor, ...]  # [m, n] long: the tokens of m chunks of n > 1 tokens from position 0
    # chunks of n > 1 tokens from a position > 0, grouped by n: (tokens [m, n], starts [m], tables [m, W] padded
    # with block 0, W the group's most blocks)
    later_groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]
    sample_index: torch.Tensor  # [N] long: the tokens whose logits the step returns
    fresh_firsts: tuple[int | None, ...]  # per fresh group: its first token when its m * n tokens lie in a row

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


def build_step(chunks: Sequence[ChunkPlan], sample: Sequence[int], block_size: int,
               device: torch.device) -> PagedStep:
    """The device inputs of a step of `chunks`; `sample` lists the chunks whose last token's logits are
    wanted (in that order). Built on the host in numpy from each chunk's length, start and table (a Python
    value a token made a 16,384-token step cost ~12 ms of host time, which the GPU waits out before a step
    with prompts), copied over in one piece."""
    n_chunks = len(chunks)
    lengths = np.fromiter((len(toks) for toks, _, _ in chunks), np.int64, n_chunks)
    starts = np.fromiter((start for _, start, _ in chunks), np.int64, n_chunks)
    ends = starts + lengths
    used = -(-ends // block_size)  # blocks each chunk's positions reach
    held = np.fromiter((len(table) for _, _, table in chunks), np.int64, n_chunks)
    short = np.flatnonzero(used > held)
    if short.size:
        i = int(short[0])
        raise ValueError(f"block table of {int(held[i])} blocks does not cover positions up to {int(ends[i])} "
                         f"(block_size {block_size})")
    offsets = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    tokens = np.fromiter(itertools.chain.from_iterable(toks for toks, _, _ in chunks), np.int64, total)
    positions = np.arange(total, dtype=np.int64) - np.repeat(offsets - starts, lengths)
    width = int(used.max()) if n_chunks else 0
    tables = _tables(chunks, held, width)
    chunk_of = np.repeat(np.arange(n_chunks), lengths)
    slots = tables[chunk_of, positions // block_size] * block_size + positions % block_size
    single = np.flatnonzero(lengths == 1)
    single_width = int(used[single].max()) if single.size else 0
    fresh: dict[int, list[int]] = {}  # chunk length -> the first token of each such chunk from position 0
    later: dict[int, list[int]] = {}  # chunk length -> the chunks of that length from a position > 0
    for i in np.flatnonzero(lengths > 1).tolist():
        n = int(lengths[i])
        if starts[i] == 0:
            fresh.setdefault(n, []).append(int(offsets[i]))
        else:
            later.setdefault(n, []).append(i)

    # every index in one host buffer, one copy to the device (pinned and non-blocking on CUDA: a pageable
    # copy waits for the stream), then views of it
    parts = [tokens, positions, slots, offsets[single], tables[single, :single_width], ends[single],
             (offsets + lengths - 1)[np.asarray(sample, dtype=np.int64)]]
    parts += [np.asarray(firsts, dtype=np.int64)[:, None] + np.arange(n) for n, firsts in fresh.items()]
    for n, members in later.items():
        idx = np.asarray(members)
        parts += [offsets[idx][:, None] + np.arange(n), starts[idx], tables[idx, :int(used[idx].max())]]
    flat = torch.from_numpy(np.concatenate([p.ravel() for p in parts]).astype(np.int64, copy=False))
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat
    views, at = [], 0
    for part in parts:
        views.append(flat[at:at + part.size].view(part.shape))
        at += part.size
    n_fresh = len(fresh)
    firsts = tuple(f[0] if all(x == f[0] + k * n for k, x in enumerate(f)) else None for n, f in fresh.items())
    return PagedStep(
        tokens=views[0], positions=views[1], slots=views[2], single_rows=views[3], single_tables=views[4],
        single_lengths=views[5], sample_index=views[6], fresh_groups=tuple(views[7:7 + n_fresh]), fresh_firsts=firsts,
        later_groups=tuple(tuple(views[7 + n_fresh + 3 * k:10 + n_fresh + 3 * k]) for k in range(len(later))),
    )


def _tables(chunks: Sequence[ChunkPlan], held: np.ndarray, width: int) -> np.ndarray:
    """Each chunk's table as a row of `width` blocks: its first `width` entries, padded with block 0."""
    keep = np.minimum(held, width)
    flat = np.fromiter(itertools.chain.from_iterable(itertools.islice(table, k) for (_, _, table), k
                                                     in zip(chunks, keep.tolist())), np.int64, int(keep.sum()))
    tables = np.zeros((len(chunks), width), dtype=np.int64)
    tables[np.arange(width) < keep[:, None]] = flat
    return tables


@dataclass
class MixedStep(StepContext):
    """The attention of a step of prompt chunks and decodes packed together (see the module doc): each layer's
    rotary embedding and K/V write (`paged_rope.rotate_and_write`, keys kept for the prompt chunks), then one
    attention per kind of chunk."""

    step: PagedStep
    cache: PagedKVCache
    rope_cos: torch.Tensor  # [max_seq_len, hd] tables
    rope_sin: torch.Tensor
    args: ModelArgs
    all_logits: bool  # the final norm of every token, not only of `step.sample_index`
    kernel: AttentionKernelOptions  # the decodes' paged attention kernel's launch settings
    gqa_in_sdpa: bool  # the prompts' attention on CUDA: SDPA's grouped heads (`_fresh_attention`)
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the windowed layers' own tables (Gemma 3)

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        a, step, cache = self.args, self.step, self.cache
        total, group = step.num_tokens, a.n_heads // a.n_kv_heads
        window, scale = a.window(layer), a.softmax_scale
        cos, sin = layer_rope(a, layer, (self.rope_cos, self.rope_sin), self.local_rope)
        v = qkv[:, a.q_size + a.kv_size:].view(total, a.n_kv_heads, a.head_dim)
        q, k = paged_rope.rotate_and_write(qkv, step.positions, step.slots, cos, sin, cache,
                                           layer, a.n_heads, a.n_kv_heads, keys=True)
        if _whole_step_group(step, total):  # one group of prompts is the whole step (the usual prefill step)
            return _fresh_attention(q, k, v, step.fresh_groups[0], group, 0, gqa_in_sdpa=self.gqa_in_sdpa,
                                    window=window, scale=scale)
        y = torch.empty(total, a.q_size, dtype=q.dtype, device=q.device)
        single = step.single_rows.shape[0]
        if single:
            qg = q[step.single_rows].view(single, a.n_kv_heads, group, a.head_dim)  # [Bd, Hkv, G, hd]
            y[step.single_rows] = paged_decode_attention(qg, cache.k[layer], cache.v[layer], step.single_tables,
                                                         step.single_lengths, scale, kernel=self.kernel,
                                                         window=window).reshape(single, a.q_size)
        for rows, first in zip(step.fresh_groups, step.fresh_firsts):
            out = _fresh_attention(q, k, v, rows, group, first, gqa_in_sdpa=self.gqa_in_sdpa, window=window,
                                   scale=scale)
            if first is None:
                y[rows.flatten()] = out
            else:
                y[first:first + out.shape[0]] = out
        for rows, starts, tables in step.later_groups:
            y[rows.flatten()] = _later_chunk_attention(cache, layer, q, rows, starts, tables, group, window=window,
                                                       scale=scale)
        return y

    def last_hidden(self, norm: RMSNorm, x: torch.Tensor, ff: torch.Tensor) -> torch.Tensor:
        x = x + ff
        return norm(x if self.all_logits else x[self.step.sample_index])


def paged_forward(model: Transformer, step: PagedStep, cache: PagedKVCache, rope_cos: torch.Tensor,
                  rope_sin: torch.Tensor, *, all_logits: bool = False,
                  local_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Run `step` through the model (`Transformer.step` with a `MixedStep`), writing its K/V into `cache` ->
    float32 logits [N, V] of the tokens in `step.sample_index` (or of every token, [T, V], with `all_logits`).
    How: `model.options` (each layer's GEMM picked at load for the step's row count). `local_rope`: the cos, sin
    tables of the layers of a local rope (`ModelArgs.local_rope_theta`)."""
    layer, options = model.layers[0], model.options
    total, dev = step.num_tokens, step.tokens.device
    ctx = MixedStep(reference=False, pdl=False,
                    qkv_e4m3=prescale_rows_for(layer.attention.wqkv, total, dev),
                    w13_e4m3=prescale_rows_for(layer.feed_forward.w13, total, dev),
                    step=step, cache=cache, rope_cos=rope_cos, rope_sin=rope_sin, args=model.args,
                    all_logits=all_logits, kernel=options.attention, gqa_in_sdpa=options.gqa_in_sdpa,
                    local_rope=local_rope)
    return model.logits(model.step(step.tokens, ctx))


def _whole_step_group(step: PagedStep, total: int) -> bool:
    """Whether the step is one group of prompts from position 0 lying in a row from token 0, and nothing else."""
    return (len(step.fresh_groups) == 1 and not step.later_groups and step.single_rows.shape[0] == 0
            and step.fresh_firsts[0] == 0 and step.fresh_groups[0].numel() == total)


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, group: int,
                     first: int | None = None, *, gqa_in_sdpa: bool = True, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """m chunks of n tokens from position 0 (their token indices `rows` [m, n]; `first`: the first of them
    when they lie in a row, read as views instead of gathered), causal over their own keys/values
    (q [T, H, hd], k, v [T, Hkv, hd]) -> [m * n, H * hd]. `gqa_in_sdpa` (CUDA): SDPA's grouped heads read each
    K/V head for its query heads, instead of K and V copied out to every query head first; the CPU keeps the
    copies (its kernels then match the reference forward's, which the CPU tests hold the steps to). `window`: a
    sliding window (each query sees its own key and the window - 1 before it); `scale`: the softmax scale."""
    m, n = rows.shape
    if first is None:
        qc, kc, vc = q[rows], k[rows], v[rows]  # [m, n, heads, hd]
    else:
        span = slice(first, first + m * n)
        qc, kc, vc = (t[span].view(m, n, *t.shape[1:]) for t in (q, k, v))
    gqa = group > 1 and gqa_in_sdpa and q.is_cuda
    if group > 1 and not gqa:
        kc, vc = kc.repeat_interleave(group, dim=2), vc.repeat_interleave(group, dim=2)
    band = causal_band(n, window, q.device)
    out = sdpa(qc.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), is_causal=band is None, attn_mask=band,
               enable_gqa=gqa, scale=scale)
    return out.transpose(1, 2).reshape(m * n, -1)


def _later_chunk_attention(cache: PagedKVCache, layer: int, q: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                           tables: torch.Tensor, group: int, *, window: int | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """m chunks of n tokens (their token indices `rows` [m, n] into q [T, H, hd]), chunk i at positions
    [starts[i], starts[i] + n), each over its sequence's positions up to its own, causal -> [m * n, H * hd]. Every
    key and value comes from the cache (these chunks' were written first), in the compute dtype (`gather_tables`
    dequantizes fp8 pools); positions past a chunk's own are read (the group's tables are padded) but masked, and
    so are positions out of a sliding `window`. `scale`: the softmax scale."""
    m, n = rows.shape
    width = tables.shape[1] * cache.block_size
    per = max(1, LATER_CHUNK_POSITIONS // width)
    if m > per:
        return torch.cat([_later_chunk_attention(cache, layer, q, rows[a:a + per], starts[a:a + per],
                                                 tables[a:a + per], group, window=window, scale=scale)
                          for a in range(0, m, per)])
    keys, values = cache.gather_tables(layer, tables)  # [m, Hkv, W * block_size, hd]
    if group > 1:  # expand K/V heads for SDPA
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    positions = starts[:, None] + torch.arange(n, device=q.device)  # [m, n]
    key_positions = torch.arange(width, device=q.device)
    mask = key_positions <= positions[:, :, None]  # [m, n, W * block_size]
    if window is not None:
        mask &= key_positions > positions[:, :, None] - window
    out = sdpa(q[rows].transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1), scale=scale)  # [m, H, n, hd]
    return out.transpose(1, 2).reshape(m * n, -1)

