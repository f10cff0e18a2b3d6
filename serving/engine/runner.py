"""Load an engine folder and generate: the weights, the paged KV cache its engine.json records, the steps.

The engine speaks token ids, not text: prompts are lists of token ids and generations are lists of token ids
(the tokenizer files in the engine folder are for the caller).

`load_engine(engine_dir, device=...)` is what every consumer of a built engine calls (the release gates, the
Triton `llm` model's default `engine_loader`): it reads and checks the folder (`load_model`), sizes the block
pools from the engine's `kv_cache` settings (`kv_cache.resolve_num_blocks`: `num_blocks`, `free_mem_fraction` of
the CUDA memory free after the weights, or by default room for `max_batch_size` sequences of `max_seq_len`),
checks them against the engine's limits (`kv_cache.check_kv_cache_config`) and returns an `EngineRunner`:

- `generate(prompts, *, max_new_tokens, sampling, stop_token_ids, top_logprobs, logprobs)`: every prompt
  at once through a `scheduler.Scheduler`, which admits them as blocks, the token budget and the live cap
  allow (more prompts than fit simply queue). A seeded sampler seeds each request on its own;
- `prefill_logits(prompt)`: teacher-forced logits of every position, through borrowed blocks;
- `forward(chunks, sample)`: one mixed step (`step.paged_forward`), for the scheduler.

An engine built by an earlier release loads too: its `paged` record is read as `kv_cache`, and one built with
the static cache of that release gets a pool of that cache's room (`build.read_engine_info`).

With `config.kv_cache_dtype` "fp8" the pools hold float8_e4m3fn (`kv_cache`'s module doc): a block takes
half the bytes of a bf16 one, so `free_mem_fraction` sizes twice the blocks; a GPU below compute capability
8.9 is refused at load (`kv_cache.check_kv_cache_device`).

A step of decodes only (every live request past its prompt) runs through `cuda_graphs.DecodeGraphs`:
block tables kept on the device, the layers' GEMMs as picked at load for the engine's options
(`options.resolve_options`, `linears.apply_options`), on CUDA one graph per batch bucket. A step with a prefill chunk in it runs `step.paged_forward` eagerly.

Imports: stdlib and torch only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from serving.engine.build import EngineInfo, check_toolchain, read_engine_info
from serving.engine.convert import DTYPES
from serving.engine.cuda_graphs import DecodeGraphs, is_decode_only
from serving.engine.errors import EngineFormatError, EngineLimitError
from serving.engine.kv_cache import (
    BlockAllocator,
    KVCacheConfig,
    PagedKVCache,
    blocks_for,
    check_kv_cache_config,
    check_kv_cache_device,
    check_kv_cache_dtype,
    kv_block_bytes,
    kv_element_bytes,
    resolve_num_blocks,
)
from serving.engine.linears import apply_options, install_quantized_linears
from serving.engine.model import rope_cos_sin
from serving.engine.models.llama import Transformer
from serving.engine.models.registry import registered
from serving.engine.options import resolve_options
from serving.engine.parallel import SINGLE, ParallelConfig
from serving.engine.parallel_protocol import AllLogits, Forward, ForwardAhead, Message, WarmUpDecode
from serving.engine.parallel_shard import shard_state
from serving.engine.parallel_workers import Workers, start_workers
from serving.engine.prefix_cache import PrefixCachingAllocator
from serving.engine.quantize import check_device as check_quantization_device
from serving.engine.sampling import SamplingParams
from serving.engine.scheduler import GenRequest, Scheduler
from serving.engine.step import ChunkPlan, build_step, paged_forward


@dataclass
class Generation:
    """New tokens of one prompt (the stop token included when finish_reason == "stop")."""

    token_ids: list[int]
    logprobs: list[float]  # raw model log-prob of each chosen token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per position, when requested
    finish_reason: str = "length"  # "length" | "stop"


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineLimitError(f"device={str(device)!r} requested but CUDA is not available here")
    return dev


class EngineRunner:
    """A loaded engine with a paged KV cache. Not thread-safe: one scheduler drives it."""

    def __init__(self, info: EngineInfo, model: Transformer, device: torch.device, config: KVCacheConfig, *,
                 cuda_graphs: bool = True, parallel: ParallelConfig = SINGLE, peers: Workers | None = None) -> None:
        """`model` runs as its `options` say (`linears.apply_options` before this, or its defaults). `parallel`: this
        rank of a tensor-parallel engine (the model built with it: `model.args` are this rank's, its pool holds
        its KV heads, the pool's size agreed by every rank); `peers`: on rank 0, the worker ranks
        (`parallel_workers`), sent each step."""
        a, lim = model.args, info.limits
        weight = model.tok_embeddings.weight
        self.info, self.model, self.device, self.config = info, model, device, config
        self.parallel, self.peers = parallel, peers
        self.max_live = lim.max_batch_size
        check_kv_cache_dtype(config.kv_cache_dtype)
        check_kv_cache_device(config.kv_cache_dtype, device, where=f"engine {str(info.path)!r}")
        self.block_bytes = kv_block_bytes(n_layers=a.n_layers, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                                          block_size=config.block_size,
                                          element_bytes=kv_element_bytes(config.kv_cache_dtype, weight.element_size()))
        self.num_blocks = resolve_num_blocks(config, device, self.block_bytes, max_batch_size=self.max_live,
                                             max_seq_len=lim.max_seq_len)
        if parallel.group is not None:
            self.num_blocks = parallel.group.min_int(self.num_blocks)
        check_kv_cache_config(config, num_blocks=self.num_blocks, max_seq_len=lim.max_seq_len,
                              max_batch_size=self.max_live, block_bytes=self.block_bytes)
        # one block more than the allocator hands out: the decode graphs' padding rows write there
        self.cache = PagedKVCache(n_layers=a.n_layers, num_blocks=self.num_blocks + 1, block_size=config.block_size,
                                  n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, dtype=weight.dtype, device=device,
                                  kv_cache_dtype=config.kv_cache_dtype)
        self.allocator = (PrefixCachingAllocator(self.num_blocks) if config.prefix_caching
                          else BlockAllocator(self.num_blocks))
        cos, sin = rope_cos_sin(a, lim.max_seq_len, device)
        self.rope_cos, self.rope_sin = cos.to(weight.dtype), sin.to(weight.dtype)
        self.local_rope = None  # the windowed layers' own rope tables, for a model with a local rope (Gemma 3)
        if a.local_rope_theta is not None:
            local = rope_cos_sin(a, lim.max_seq_len, device, local=True)
            self.local_rope = (local[0].to(weight.dtype), local[1].to(weight.dtype))
        self.decode = DecodeGraphs(model, self.cache, self.rope_cos, self.rope_sin, max_live=self.max_live,
                                   max_seq_len=lim.max_seq_len, graphs=cuda_graphs and device.type == "cuda",
                                   parallel=parallel, local_rope=self.local_rope)
        self.step_events: list | None = None  # set by `generate(events=...)` on CUDA: one event per sampling step

    @torch.no_grad()
    def forward(self, chunks: Sequence[ChunkPlan], sample: Sequence[int], *,
                every_token: Sequence[int] = ()) -> torch.Tensor:
        """One mixed step -> float32 logits [len(sample), V] of the sampled chunks' last tokens, followed (with
        `every_token`) by the logits of every token of those chunks, in order (prompt log-probs)."""
        with self._on_every_rank(Forward(list(chunks), list(sample), list(every_token))):
            if not every_token and is_decode_only(chunks, sample) and len(chunks) <= self.max_live:
                logits = self.decode.step(chunks)
            else:
                step = build_step(chunks, sample, self.config.block_size, self.device)
                if every_token:
                    step = dataclasses.replace(step, sample_index=torch.cat(
                        [step.sample_index, _token_rows(chunks, every_token).to(self.device)]))
                logits = paged_forward(self.model, step, self.cache, self.rope_cos, self.rope_sin,
                                       local_rope=self.local_rope)
        if self.step_events is not None and sample:
            self.step_events.append(_recorded_event())
        return logits

    @torch.no_grad()
    def forward_ahead(self, chunks: Sequence[ChunkPlan], tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A decode-only step whose input tokens are `tokens[rows]` on the device (the previous step's samples,
        not read by the host yet) -> float32 logits [len(chunks), V]. The worker ranks of a tensor-parallel engine
        get `tokens` by a broadcast."""
        with self._on_every_rank(ForwardAhead(list(chunks), list(rows), tokens.numel())):
            if self.peers is not None:
                tokens = self.parallel.group.broadcast(tokens.to(torch.long).contiguous())
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
                logits.append(self.all_token_logits([(list(prompt[start:end]), start, blocks)]).cpu())
            return torch.cat(logits)
        finally:
            self.allocator.give_back(blocks)

    @torch.no_grad()
    def all_token_logits(self, chunks: Sequence[ChunkPlan]) -> torch.Tensor:
        """One step of `chunks` -> float32 logits of every one of their tokens [T, V] (teacher forcing)."""
        with self._on_every_rank(AllLogits(list(chunks))):
            step = build_step(chunks, [0], self.config.block_size, self.device)
            return paged_forward(self.model, step, self.cache, self.rope_cos, self.rope_sin, all_logits=True,
                                 local_rope=self.local_rope)

    def warm_up_decode(self) -> None:
        """Capture the decode step's graph of every batch bucket (CUDA; nothing elsewhere)."""
        with self._on_every_rank(WarmUpDecode()):
            self.decode.warm_up()

    def _on_every_rank(self, message: Message) -> contextlib.AbstractContextManager:
        """Around rank 0's part of a step: `message` sent to the worker ranks first (a tensor-parallel engine)."""
        return contextlib.nullcontext() if self.peers is None else self.peers.step(message)

    def close(self) -> None:
        """Stop the worker ranks of a tensor-parallel engine (nothing for one process); the Triton model's unload."""
        if self.peers is not None:
            self.peers.stop()

    def scheduler(self, **options: Any) -> Scheduler:
        """The in-flight scheduler that serves this runner (`scheduler.Scheduler`'s options), refusing requests
        past the engine's `kv_cache.max_waiting`."""
        return Scheduler(self, max_waiting=self.config.max_waiting, **options)

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
        for the benchmarks' timings): a CUDA event recorded at the start, then one after each step that sampled
        tokens (the first of them: the first token of the prompts admitted first); left empty on the CPU."""
        vocab = self.info.model.vocab_size
        if max_new_tokens < 1:
            raise EngineLimitError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if not 0 <= top_logprobs <= vocab:
            raise EngineLimitError(f"top_logprobs={top_logprobs} must be in [0, vocab_size={vocab}]")
        scheduler = Scheduler(self)
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
            scheduler.submit(GenRequest(list(p), max_new_tokens, emit, failures.append, sampling, tuple(stop_token_ids),
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


def load_engine(engine_dir: Path, *, config: KVCacheConfig | None = None, device: str = "auto",
                overrides: Mapping[str, Any] | None = None, prefix_caching: bool | None = None) -> EngineRunner:
    """Read, check and load an engine folder with its paged KV cache (see the module doc). Also Triton's `llm`
    model's default `engine_loader` (`serving.engine.runner:load_engine`). `config` (default: the engine's own
    `kv_cache`, from its build) sizes the cache; `overrides`: `EngineOptions` fields set for this load (the `llm`
    model's `decode_gemm` parameter among them), resolved once with the device and the
    engine's record (`options.resolve_options`) and handed to every layer (`linears.apply_options`);
    `prefix_caching` (None: as configured) turns prefix caching on or off for this load."""
    recorded = read_engine_info(Path(engine_dir))
    config = config or recorded.kv_cache
    if prefix_caching is not None:
        config = dataclasses.replace(config, prefix_caching=prefix_caching)
    size = recorded.tensor_parallel
    peers = (start_workers(Path(engine_dir), size, resolve_device(device), overrides=overrides, kv_cache=config)
             if size > 1 else None)
    try:
        parallel = peers.parallel if peers is not None else SINGLE
        info, model, dev = load_model(engine_dir, device=device, parallel=parallel)
        apply_options(model, resolve_options(dev, info, overrides))
        return EngineRunner(info, model, dev, config, parallel=parallel, peers=peers)
    except BaseException:
        if peers is not None:
            peers.stop()
        raise


def load_model(engine_dir: Path, *, device: str = "auto",
               parallel: ParallelConfig = SINGLE) -> tuple[EngineInfo, Transformer, torch.device]:
    """Read, check (toolchain, quantization) and load an engine folder's weights onto `device`, without the
    KV cache (`load_engine` adds it); with a `parallel` group of several ranks, this rank's shard of them
    (`parallel_shard.shard_state`, cut from the memory-mapped files)."""
    info = read_engine_info(Path(engine_dir))
    dev = resolve_device(device)
    check_toolchain(info, device=dev)
    check_quantization_device(info.quantization.method, dev, where=f"engine {str(info.path)!r}")
    state: dict[str, torch.Tensor] = {}
    for name in info.weight_files:
        state.update(torch.load(info.path / name, map_location="cpu", weights_only=True, mmap=True))
    if parallel.size > 1:
        state = shard_state(state, info.model, parallel)
    with torch.device("meta"):
        model = (registered(info.model.architecture).model_class(info.model) if parallel.size == 1
                 else registered(info.model.architecture).model_class(info.model, parallel))
    install_quantized_linears(model, info.quantization, n_layers=info.model.n_layers,
                              tie_word_embeddings=info.model.tie_word_embeddings, dtype=DTYPES[info.limits.dtype])
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # a quantization record that does not match the weights
        raise EngineFormatError(f"engine {str(info.path)!r}: its weights do not match engine.json (quantization "
                                f"{info.quantization.method!r}): {exc}") from None
    return info, model.to(dev).eval().requires_grad_(False), dev
