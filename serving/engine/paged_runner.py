"""The paged engine: an engine folder's weights with a paged KV cache instead of the static one (opt-in).

`load_paged_engine(engine_dir, config=PagedKVConfig(...))` loads the same weights as `load_engine`, sizes
the block pools (`config.num_blocks`, or `config.free_mem_fraction` of the CUDA memory free after the
weights), checks the combination against the engine's limits (`paged_cache.check_paged_config`) and
returns a `PagedRunner`. It answers what the validation gate and the offline benchmark call on the
static runner:

- `generate(prompts, *, max_new_tokens, sampling, stop_token_ids, top_logprobs, logprobs)`: every prompt
  at once through a `PagedScheduler`, which admits them as blocks, the token budget and the live cap
  allow (more prompts than fit simply queue). A seeded sampler seeds each request on its own (the static
  runner's one generator per batch is not reproduced: greedy tokens are the contract between the two);
- `prefill_logits(prompt)`: teacher-forced logits of every position, through borrowed blocks;
- `forward(chunks, sample)`: one mixed step (`paged_model.paged_forward`), for the scheduler.

With `config.kv_cache_dtype` "fp8" the pools hold float8_e4m3fn (`paged_cache`'s module doc): a block takes
half the bytes of a bf16 one, so `free_mem_fraction` sizes twice the blocks; a GPU below compute capability
8.9 is refused at load (`paged_cache.check_kv_cache_device`).

A step of decodes only (every live request past its prompt) runs through `paged_decode.PagedDecodeGraphs`:
block tables kept on the device, the static step's GEMMs (`decode_gemm`), on CUDA one graph per batch
bucket. A step with a prefill chunk in it runs `paged_model.paged_forward` eagerly.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from serving.engine.build import EngineInfo
from serving.engine.errors import EngineLimitError
from serving.engine.model import Transformer, rope_cos_sin
from serving.engine.paged_cache import (
    BlockAllocator,
    PagedKVCache,
    PagedKVConfig,
    blocks_for,
    check_kv_cache_device,
    check_kv_cache_dtype,
    check_paged_config,
    kv_block_bytes,
    kv_element_bytes,
    resolve_num_blocks,
)
from serving.engine.paged_decode import PagedDecodeGraphs, is_decode_only
from serving.engine.paged_model import ChunkPlan, build_step, paged_forward
from serving.engine.paged_scheduler import PagedRequest, PagedScheduler
from serving.engine.prefix_cache import PrefixCachingAllocator
from serving.engine.runner import Generation, load_model, pick_decode_gemm
from serving.engine.sampling import SamplingParams


class PagedRunner:
    """A loaded engine with a paged KV cache. Not thread-safe: one scheduler drives it."""

    def __init__(self, info: EngineInfo, model: Transformer, device: torch.device, config: PagedKVConfig, *,
                 decode_gemm: str = "torch", cuda_graphs: bool = True) -> None:
        a, lim = info.model, info.limits
        weight = model.tok_embeddings.weight
        self.info, self.model, self.device, self.config = info, model, device, config
        self.max_live = lim.max_batch_size
        check_kv_cache_dtype(config.kv_cache_dtype)
        check_kv_cache_device(config.kv_cache_dtype, device, where=f"paged engine {str(info.path)!r}")
        self.block_bytes = kv_block_bytes(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                          block_size=config.block_size,
                                          element_bytes=kv_element_bytes(config.kv_cache_dtype, weight.element_size()))
        self.num_blocks = resolve_num_blocks(config, device, self.block_bytes)
        check_paged_config(config, num_blocks=self.num_blocks, max_seq_len=lim.max_seq_len,
                           max_batch_size=self.max_live, block_bytes=self.block_bytes)
        # one block more than the allocator hands out: the decode graphs' padding rows write there
        self.cache = PagedKVCache(n_layers=a.n_layers, num_blocks=self.num_blocks + 1, block_size=config.block_size,
                                  n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, dtype=weight.dtype, device=device,
                                  kv_cache_dtype=config.kv_cache_dtype)
        self.allocator = (PrefixCachingAllocator(self.num_blocks) if config.prefix_caching
                          else BlockAllocator(self.num_blocks))
        cos, sin = rope_cos_sin(a, lim.max_seq_len, device)
        self.rope_cos, self.rope_sin = cos.to(weight.dtype), sin.to(weight.dtype)
        self.decode = PagedDecodeGraphs(model, self.cache, self.rope_cos, self.rope_sin, max_live=self.max_live,
                                        max_seq_len=lim.max_seq_len, gemm=decode_gemm,
                                        graphs=cuda_graphs and device.type == "cuda")
        self.step_events: list | None = None  # set by `generate(events=...)` on CUDA: one event per sampling step

    @torch.no_grad()
    def forward(self, chunks: Sequence[ChunkPlan], sample: Sequence[int], *,
                every_token: Sequence[int] = ()) -> torch.Tensor:
        """One mixed step -> float32 logits [len(sample), V] of the sampled chunks' last tokens, followed (with
        `every_token`) by the logits of every token of those chunks, in order (prompt log-probs)."""
        if not every_token and is_decode_only(chunks, sample):
            logits = self.decode.step(chunks)
        else:
            step = build_step(chunks, sample, self.config.block_size, self.device)
            if every_token:
                step = dataclasses.replace(step, sample_index=torch.cat(
                    [step.sample_index, _token_rows(chunks, every_token).to(self.device)]))
            logits = paged_forward(self.model, step, self.cache, self.rope_cos, self.rope_sin)
        if self.step_events is not None and sample:
            self.step_events.append(_recorded_event())
        return logits

    @torch.no_grad()
    def forward_ahead(self, chunks: Sequence[ChunkPlan], tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A decode-only step whose input tokens are `tokens[rows]` on the device (the previous step's samples,
        not read by the host yet) -> float32 logits [len(chunks), V]."""
        logits = self.decode.step(chunks, device_tokens=(tokens, rows))
        if self.step_events is not None:
            self.step_events.append(_recorded_event())
        return logits

    @torch.no_grad()
    def prefill_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Teacher-forced float32 logits of every position of `prompt`: [S, V] on the CPU (up to
        limits.max_seq_len tokens, through blocks borrowed for the call). One chunk; with an fp8 KV cache two:
        its first block, then the rest attending over K/V read back from the pool, so that every position
        past the first block sees the e4m3 rounding that served decodes and later chunks see (the quality gate
        scores the engine through this; one chunk would attend over the fresh, unrounded K/V alone)."""
        lim, vocab = self.info.limits, self.info.model.vocab_size
        if not 1 <= len(prompt) <= lim.max_seq_len:
            raise EngineLimitError(f"prefill_logits: {len(prompt)} tokens, need 1..limits.max_seq_len="
                                   f"{lim.max_seq_len}")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise EngineLimitError(f"prefill_logits prompt has token ids {bad[:5]} outside [0, vocab_size={vocab})")
        need = blocks_for(len(prompt), self.config.block_size)
        blocks = self.allocator.take(need)
        if blocks is None:
            raise EngineLimitError(f"prefill_logits: {len(prompt)} tokens need {need} KV blocks, "
                                   f"{self.allocator.free} are free (live requests hold the rest)")
        try:
            starts = [0, self.config.block_size] if self.cache.fp8 else [0]
            ends = [*starts[1:], len(prompt)]
            logits = []
            for start, end in zip(starts, ends):
                if start >= end:
                    break
                step = build_step([(list(prompt[start:end]), start, blocks)], [0], self.config.block_size, self.device)
                logits.append(paged_forward(self.model, step, self.cache, self.rope_cos, self.rope_sin,
                                            all_logits=True).cpu())
            return torch.cat(logits)
        finally:
            self.allocator.give_back(blocks)

    graphs = None  # no static-cache graphs to compile (Triton's `llm` model asks); the decode graphs: `decode`

    def warm_up_decode(self) -> None:
        """Capture the decode step's graph of every batch bucket (CUDA; nothing elsewhere)."""
        self.decode.warm_up()

    def scheduler(self, **options: Any) -> PagedScheduler:
        """The in-flight scheduler that serves this runner (`scheduler.Scheduler`'s options), refusing requests
        past the engine's `paged.max_waiting`."""
        return PagedScheduler(self, max_waiting=self.config.max_waiting, **options)

    @torch.no_grad()
    def warm_up_prefill(self, typical_len: int = 128) -> list[tuple[int, int]]:
        """Before serving: one step of a batch of `typical_len`-token prompts (capped by the token budget
        and the live cap) and one of two unequal prompts, each to its first token; then a mixed step (a
        decode, a new prompt and a prompt's second chunk: what serving runs once requests overlap, whose
        kernels would otherwise compile in the first such step); blocks given back. Then the decode graphs
        of every batch bucket (`warm_up_decode`). Returns the (prompts, tokens) of each prompt step."""
        lim = self.info.limits
        short = max(1, min(typical_len, lim.max_input_len))
        batch = max(1, min(self.max_live, self.config.max_num_tokens // short, self.num_blocks // 2))
        shapes = [[short] * batch, [max(1, short // 2), short]]
        for lengths in shapes:
            self.generate([[1] * n for n in lengths], max_new_tokens=1, logprobs=False)
        self._warm_up_mixed_step(max(2, min(short, (lim.max_seq_len - 1) // 2, self.config.max_num_tokens // 3)))
        self.warm_up_decode()
        return [(len(lengths), sum(lengths)) for lengths in shapes]

    def _warm_up_mixed_step(self, n: int) -> None:
        """Prompts of `n` tokens for sequences a and c, then one step of a's decode, b's prompt and c's second
        chunk of `n` (skipped when the pool cannot lend the blocks)."""
        per = blocks_for(2 * n + 1, self.config.block_size)
        blocks = self.allocator.take(3 * per)
        if blocks is None:
            return
        a, b, c = blocks[:per], blocks[per:2 * per], blocks[2 * per:]
        try:
            self.forward([([1] * n, 0, a), ([1] * n, 0, c)], [0, 1])
            self.forward([([1], n, a), ([1] * n, 0, b), ([1] * n, n, c)], [0, 1, 2])
        finally:
            self.allocator.give_back(blocks)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] = (),
                 top_logprobs: int = 0, logprobs: bool = True, events: list | None = None) -> list[Generation]:
        """New tokens for each prompt (greedy when `sampling` is None), all submitted at once. `events` (CUDA,
        as the static runner's): a CUDA event recorded at the start, then one after each step that sampled
        tokens (the first of them: the first token of the prompts admitted first); left empty on the CPU."""
        vocab = self.info.model.vocab_size
        if not 0 <= top_logprobs <= vocab:
            raise EngineLimitError(f"top_logprobs={top_logprobs} must be in [0, vocab_size={vocab}]")
        scheduler = PagedScheduler(self)
        out = [Generation(token_ids=[], logprobs=[]) for _ in prompts]
        want = logprobs or top_logprobs > 0

        def sinks(gen: Generation):
            def emit(ids: list[int], reason: str | None) -> None:
                gen.token_ids.extend(ids)
                if reason is not None:
                    gen.finish_reason = reason

            def on_logprobs(lp: float, top: dict[int, float]) -> None:
                gen.logprobs.append(lp)
                if top_logprobs:
                    gen.top_logprobs.append(top)

            return emit, (on_logprobs if want else None)

        failures: list[BaseException] = []

        for i, p in enumerate(prompts):  # all checked before any is queued
            try:
                scheduler.check(p, max_new_tokens)
            except EngineLimitError as exc:
                raise EngineLimitError(f"prompt {i}: {exc}") from None
        for p, gen in zip(prompts, out):
            emit, on_lp = sinks(gen)
            scheduler.submit(PagedRequest(list(p), max_new_tokens, emit, failures.append, sampling, tuple(stop_token_ids),
                                          top_logprobs=top_logprobs, on_logprobs=on_lp))
        timed = events is not None and self.device.type == "cuda"
        if timed:
            events.append(_recorded_event())
            self.step_events = events
        try:
            scheduler.run_until_idle()
        finally:
            self.step_events = None
        if failures:
            raise failures[0]
        return out


def _token_rows(chunks: Sequence[ChunkPlan], which: Sequence[int]) -> torch.Tensor:
    """The rows in a step's packed tokens of every token of the chunks `which`, in order."""
    offsets = [0]
    for tokens, _, _ in chunks:
        offsets.append(offsets[-1] + len(tokens))
    return torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in which])


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def load_paged_engine(engine_dir: Path, *, config: PagedKVConfig | None = None, device: str = "auto",
                      decode_attention: str = "auto", decode_gemm: str = "auto",
                      prefix_caching: bool | None = None) -> PagedRunner:
    """Read, check and load an engine folder with a paged KV cache sized by `config` (default: the engine's
    own `paged` settings, from its build; see module doc). Also Triton's `llm` model's `engine_loader`
    (`serving.engine.paged_runner:load_paged_engine`). `decode_gemm` is `load_engine`'s (the decode-only
    steps' GEMMs); `decode_attention` is accepted for its signature and unused (the paged kernel reads the
    pools); `prefix_caching` (None: as configured) turns prefix caching on or off for this load."""
    info, model, dev = load_model(engine_dir, device=device)
    gemm = pick_decode_gemm(decode_gemm, dev, model.tok_embeddings.weight.dtype)
    config = config or info.paged
    if config is None:
        raise EngineLimitError(f"engine {str(info.path)!r} was built without paged KV settings (engine.paged); "
                               "build it with engine.paged set, or pass config=PagedKVConfig(...)")
    if prefix_caching is not None:
        config = dataclasses.replace(config, prefix_caching=prefix_caching)
    return PagedRunner(info, model, dev, config, decode_gemm=gemm)
