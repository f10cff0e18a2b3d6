"""`python3 -m bench throughput`: throughput at saturation, offline, the engine and its variants (sides).

N requests arrive at once (an infinite request rate, as `trtllm-bench throughput` runs by default) or at
`request_rate` a second in a seeded Poisson process (`vllm bench serve --request-rate`), with
fixed input/output lengths or lengths spread uniformly around them (`spread`: a fraction, each length drawn
from [len * (1 - spread), len * (1 + spread)]). The engine's in-flight scheduler (`scheduler.Scheduler`:
chunked prefill under `max_num_tokens`, admission by free blocks, CUDA graphs of the decode-only steps) serves
them (on this thread when they arrive at once, else on its own while this one submits them on time). Every
side is one variant of the one engine (`engine`; `engine-sync` without a step ahead, `engine-prefix-cache`,
`engine-torch-ops` and the option sides): they share one runner's weights and pool and run one after the other
in the same process on the same requests.

Reported per side, like `trtllm-bench` and `vllm bench serve`: output tok/s (generated tokens / wall time
from the first submit to the last token), requests/s, TTFT (the request's submit -> its first token on the
host), TPOT (a request's (last - first token) / (tokens - 1)) and ITL (every gap between a request's
consecutive tokens) at p50 / p90 / p99, the most live requests in one step, the preemptions,
and with SLOs (`slo_ttft_ms`, `slo_tpot_ms`) goodput: the requests a second that met every SLO set, as
`vllm bench serve --goodput` counts them.

Weights are random (`quantized.random_model`, or the tiny shape on the CPU), quantized in memory by
`quantization` as conversion would (`quantized.quantized_model`): the figures are of the
engine's speed, not of a model's answers, and requests never stop early (no stop tokens).

Imports: stdlib and torch; the engine modules.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

from serving.engine.heap import frozen_heap
from serving.engine.timing import percentile

if TYPE_CHECKING:
    from serving.engine.options import EngineOptions

Work = list[tuple[list[int], int]]  # (prompt ids, max_tokens) per request


@dataclass(frozen=True)
class ThroughputConfig:
    shape: str = "llama-3.1-8b"
    requests: int = 1024
    input_len: int = 128
    output_len: int = 128
    spread: float = 0.0
    max_live: int = 1024  # the engine's max_batch_size (live requests)
    block_size: int = 32
    max_num_tokens: int = 8192
    num_blocks: int | None = None  # None: free_mem_fraction of the free CUDA memory
    free_mem_fraction: float = 0.9
    sides: tuple[str, ...] = ("engine",)
    warmup_requests: int = 64
    # measured runs of each side, back to back; the report keeps the last one's figures and lists every run's
    # output tok/s (on the H200 the first run after a process's warm-up was ~10% slower than the ones after it)
    runs: int = 1
    seed: int = 0
    profile_decode: tuple[int, ...] = ()  # rows of the decode-only steps to profile after the run (CUDA)
    profile_prefill: bool = False  # after the run, the kernels and wall time of one step of prompts only
    profile_run: bool = False  # after the run, the run again under the profiler: GPU busy share and kernels (CUDA)
    request_rate: float = 0.0  # requests a second, Poisson; 0: all at once
    quantization: str = "none"  # engine.quantization of the weights every side shares
    fp8_direct: bool = False  # random weights made in FP8 on the device tensor by tensor (no bf16 model first)
    kv_cache_dtype: str = "auto"  # the pool's kv_cache.kv_cache_dtype ("fp8": e4m3 K/V)
    shared_prefix: int = 0  # leading prompt tokens every request shares (a system prompt), within input_len
    max_seq_len: int | None = None  # the engine's limits.max_seq_len (None: the longest request + 1)
    admit_every_steps: int = 8  # the schedulers' admission rule, the served llm model's default
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass
class SideResult:
    side: str
    requests: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    request_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    largest_batch: int
    preempted: int = 0
    setup_s: float = 0.0
    note: str = ""
    goodput_per_s: float | None = None  # requests a second that met every SLO set (None: no SLO set)
    met_slo: int | None = None
    run_tok_s: list[float] = field(default_factory=list)  # output tok/s of each measured run, in order

    def row(self) -> str:
        def pct(d: dict[str, float]) -> str:
            return "/".join(f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))

        return (f"{self.side:>7}: {self.output_tok_s:>9.0f} output tok/s  {self.request_per_s:7.1f} req/s  wall "
                f"{self.wall_s:6.1f} s  TTFT p50/p90/p99 {pct(self.ttft_ms)} ms  TPOT {pct(self.tpot_ms)} ms  "
                f"ITL {pct(self.itl_ms)} ms  live<= {self.largest_batch}  preempted {self.preempted}  "
                + (f"goodput {self.goodput_per_s:.1f} req/s ({self.met_slo} met the SLOs)  "
                   if self.goodput_per_s is not None else "")
                + f"setup {self.setup_s:.0f} s {self.note}"
                + (f"  runs {' / '.join(f'{r:.0f}' for r in self.run_tok_s)} tok/s" if len(self.run_tok_s) > 1 else ""))


@dataclass
class ThroughputReport:
    config: dict[str, Any]
    device: str
    sides: list[SideResult] = field(default_factory=list)


def workload(cfg: ThroughputConfig, vocab: int, *, requests: int | None = None, output_len: int | None = None) -> Work:
    """The requests of one run: random prompt ids, lengths fixed or spread (seeded); with `shared_prefix`, every
    prompt starts with the same that many ids (the rest of its length random)."""
    rng = random.Random(cfg.seed)
    out_len = output_len or cfg.output_len
    prefix = [rng.randrange(1, vocab) for _ in range(cfg.shared_prefix)]

    def length(mean: int) -> int:
        lo, hi = max(1, round(mean * (1 - cfg.spread))), max(1, round(mean * (1 + cfg.spread)))
        return rng.randint(lo, hi)

    def prompt(n: int) -> list[int]:
        head = prefix[:n - 1]  # at least one id of its own
        return head + [rng.randrange(1, vocab) for _ in range(n - len(head))]

    return [(prompt(length(cfg.input_len)), length(out_len)) for _ in range(requests or cfg.requests)]


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def arrivals(cfg: ThroughputConfig, n: int) -> list[float]:
    """Each request's submit time in seconds from the start: all 0 at an infinite rate, else the seeded
    Poisson process of `request_rate` (exponential gaps)."""
    if cfg.request_rate <= 0:
        return [0.0] * n
    rng = random.Random(cfg.seed + 1)
    return list(itertools.accumulate(rng.expovariate(cfg.request_rate) for _ in range(n)))


def parse_slos(text: str) -> dict[str, float]:
    """`ttft:500,tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds); "" -> {}."""
    slos: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition(":")
        if name not in ("ttft", "tpot"):
            raise ValueError(f"--goodput: unknown SLO {name!r} in {text!r} (ttft or tpot, in milliseconds)")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {part!r} needs a number of milliseconds, e.g. {name}:500") from None
        if not slos[name] > 0:
            raise ValueError(f"--goodput: {part!r} must be more than 0 ms")
    return slos


def met_slos(ttft_ms: float, tpot_ms: float | None, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether one request met every SLO set (a one-token answer has no TPOT to miss)."""
    return ((slo_ttft_ms is None or ttft_ms <= slo_ttft_ms)
            and (slo_tpot_ms is None or tpot_ms is None or tpot_ms <= slo_tpot_ms))


def run_side(scheduler: Any, work: Work, side: str, at: list[float] | None = None,
             slos: tuple[float | None, float | None] = (None, None)) -> SideResult:
    """Submit every request of `work` to `scheduler` at its time in `at` (default: all at
    once, served on this thread; else the scheduler runs on its own thread while this one submits), and time
    every token as the host receives it."""
    from serving.engine.scheduler import GenRequest

    at = at or [0.0] * len(work)
    times: list[list[float]] = [[] for _ in work]
    submitted = [0.0] * len(work)
    failures: list[BaseException] = []
    finished = threading.Semaphore(0)

    def emitter(i: int) -> Callable[[list[int], str | None], None]:
        def emit(ids: list[int], reason: str | None) -> None:
            now = time.perf_counter()
            times[i].extend([now] * len(ids))
            if reason is not None:
                finished.release()
        return emit

    def failed(exc: BaseException) -> None:
        failures.append(exc)
        finished.release()

    paced = any(at)
    if paced:
        scheduler.start()
    started = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(work):
        delay = started + at[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submitted[i] = time.perf_counter()
        scheduler.submit(GenRequest(prompt, max_tokens, emitter(i), failed))
    if paced:
        for _ in work:
            finished.acquire()
        scheduler.stop()
    else:
        scheduler.run_until_idle()
    if scheduler.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{side}: {len(failures)} requests failed, the first: {failures[0]!r}")
    ttft = [(t[0] - s) * 1e3 for t, s in zip(times, submitted)]  # every request answered (failures raised)
    tpots = [(t[-1] - t[0]) * 1e3 / (len(t) - 1) if len(t) > 1 else None for t in times]
    tpot = [x for x in tpots if x is not None]
    itl = [(b - a) * 1e3 for t in times for a, b in itertools.pairwise(t)]
    generated = sum(len(t) for t in times)
    met = None
    if slos != (None, None):
        met = sum(met_slos(a, b, *slos) for a, b in zip(ttft, tpots))
    stats = scheduler.stats
    note = (f"{stats.steps} steps: plan {stats.plan_s:.1f} s, forward {stats.forward_s:.1f} s, wait {stats.wait_s:.1f} s, "
            f"deliver {stats.deliver_s:.1f} s; {stats.mixed_steps} steps with a prefill chunk: {stats.mixed_s:.1f} s "
            f"of forward + wait")
    if stats.prefix_hit_tokens:
        note += f"; {stats.prefix_hit_tokens} prompt tokens from the prefix cache"
    return SideResult(side=side, requests=len(work), input_tokens=sum(len(p) for p, _ in work),
                      output_tokens=generated, wall_s=wall, output_tok_s=generated / wall,
                      request_per_s=len(work) / wall, ttft_ms=_stats(ttft), tpot_ms=_stats(tpot), itl_ms=_stats(itl),
                      largest_batch=stats.largest_batch, preempted=stats.preempted, note=note,
                      goodput_per_s=None if met is None else met / wall, met_slo=met)


ENGINE_SIDE = "engine"  # the engine as it serves
SYNC_SIDE = "engine-sync"  # the engine waiting for every step's tokens (no step ahead)
PREFIX_SIDE = "engine-prefix-cache"  # the engine with prefix caching (blocks cached across its runs)
TORCH_ROW_OPS_SIDE = "engine-torch-ops"  # the engine with its norms, rotations, K/V writes, SiLU * up as torch ops
TILE_SIDE = "engine-tile"  # + N: the engine whose decode attention walks N positions an iteration
# sides that run the engine with some of its options changed: side -> `EngineOptions` fields (`attention`: the
# decode attention kernel's, `AttentionKernelOptions`)
OPTION_SIDES: dict[str, dict[str, Any]] = {
    "engine-unscaled": {"prescale_rows": False},  # FP8 GEMMs scaling their rows (not the norms, SiLU * up)
    "engine-precise-accum": {"fp8_fast_accum": False},  # fp8 prompt GEMMs promoting to float32 as they go
    "engine-no-prefetch": {"attention": {"prefetch_blocks": False}},  # decode attention: table, K, V in a row
    "engine-kv-dot-bf16": {"attention": {"fp8_kv_dot_f16": False}},  # ... over an e4m3 pool: bf16 dots
    "engine-fp8-warps4": {"attention": {"fp8_num_warps": 4}},  # ... over an e4m3 pool: 4 warps a program
    "engine-pdl": {"decode_pdl": True},  # decode graphs with programmatic dependent launch
    "engine-sum-adds": {"partial_sums_one_kernel": False},  # eager split-K sums as a kernel an add
    "engine-repeat-kv": {"gqa_in_sdpa": False},  # prompt attention copying K/V per query head
}


def side_options(side: str, base: EngineOptions) -> EngineOptions:
    """The options a side runs with: `base` with each joined part's changes ('+': `engine-pdl+no-prefetch`
    both; `engine-tile<N>`: the attention walking N positions an iteration)."""
    fields: dict[str, Any] = {}
    attention: dict[str, Any] = {}
    for part in joined_sides(side):
        if part.startswith(TILE_SIDE) and part.removeprefix(TILE_SIDE).isdigit():
            attention["tile_positions"] = int(part.removeprefix(TILE_SIDE))
        for name, value in OPTION_SIDES.get(part, {}).items():
            if name == "attention":
                attention.update(value)
            else:
                fields[name] = value
    if attention:
        fields["attention"] = replace(base.attention, **attention)
    return replace(base, **fields)


@contextlib.contextmanager
def side_context(side: str, model: Any) -> Iterator[None]:
    """What a side changes while it runs (its decode graphs are captured inside it): `model`'s options
    (`side_options`, applied to its layers too), and for `engine-torch-ops` the row kernels."""
    from serving.engine.linears import apply_options

    base = model.options
    apply_options(model, side_options(side, base))
    try:
        with torch_row_ops() if TORCH_ROW_OPS_SIDE in joined_sides(side) else contextlib.nullcontext():
            yield
    finally:
        apply_options(model, base)


def joined_sides(side: str) -> list[str]:
    """`engine-pdl+no-prefetch` -> [`engine-pdl`, `engine-no-prefetch`]; a side without '+' -> [side]."""
    return [f"engine-{part}" for part in side.removeprefix("engine-").split("+")] if "+" in side else [side]


def check_sides(sides: tuple[str, ...]) -> None:
    """Refuse, naming it and the known ones, a side this bench does not run."""
    known = (ENGINE_SIDE, SYNC_SIDE, PREFIX_SIDE, TORCH_ROW_OPS_SIDE, *OPTION_SIDES)
    for side in sides:
        for part in joined_sides(side):
            tile = part.removeprefix(TILE_SIDE)
            if part not in known and not (part != tile and tile.isdigit()):
                raise ValueError(f"bench throughput: unknown side {side!r} ({', '.join(known)}, {TILE_SIDE}<N>, "
                                 f"option sides joined by '+')")


@contextlib.contextmanager
def prefix_caching(runner: Any, *, on: bool) -> Iterator[None]:
    """The runner with a prefix-caching allocator (`serving.engine.prefix_cache`) while a side runs."""
    if not on:
        yield
        return
    from serving.engine.prefix_cache import PrefixCachingAllocator

    plain = runner.allocator
    runner.allocator = PrefixCachingAllocator(plain.num_blocks)
    try:
        yield
    finally:
        runner.allocator = plain


@contextlib.contextmanager
def torch_row_ops() -> Iterator[None]:
    """The eager steps' row kernels (`row_norm`, `paged_rope`, `silu_mul`) turned off: what they replaced, for
    an A/B."""
    from serving.engine import paged_rope, row_norm, silu_mul

    off = [mock.patch.object(module, "fits", lambda *a: False) for module in (row_norm, paged_rope, silu_mul)]
    with off[0], off[1], off[2]:
        yield


def _runner(cfg: ThroughputConfig, device: torch.device) -> Any:
    """The engine's runner over one random model's weights (quantized in memory by `cfg.quantization`)."""
    from bench.models import model_args
    from bench.quantized import quantized_model
    from serving.engine.build import EngineInfo, EngineLimits
    from serving.engine.kv_cache import KVCacheConfig
    from serving.engine.linears import apply_options
    from serving.engine.models.llama import Transformer
    from serving.engine.options import resolve_options
    from serving.engine.quantize import NONE, QuantInfo, check_device
    from serving.engine.runner import EngineRunner

    args = model_args(cfg.shape)
    seq = cfg.input_len + cfg.output_len
    longest = max(round(cfg.input_len * (1 + cfg.spread)) + round(cfg.output_len * (1 + cfg.spread)), seq) + 1
    if cfg.max_seq_len is not None and cfg.max_seq_len < longest:
        raise ValueError(f"bench throughput: max_seq_len={cfg.max_seq_len} is shorter than the longest request "
                         f"({longest} positions with its first generated token)")
    max_seq_len = cfg.max_seq_len or longest
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(cfg.seed)
    if cfg.fp8_direct:
        from bench.tensor_parallel import fp8_random_model

        if cfg.quantization != "fp8":
            raise ValueError(f"bench throughput --fp8-direct makes FP8 weights: --quantization fp8, not "
                             f"{cfg.quantization!r}")
        check_device(cfg.quantization, device, where="bench throughput --quantization")
        model = fp8_random_model(args, device, dtype=dtype, seed=cfg.seed)
    else:
        with torch.device(device):
            model = Transformer(args)
        model = model.to(dtype).eval().requires_grad_(False)
    if cfg.quantization != NONE and not cfg.fp8_direct:
        check_device(cfg.quantization, device, where="bench throughput --quantization")
        model = quantized_model(model, cfg.quantization, dtype=dtype)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the bf16 weights it replaced, before the pool is sized from free memory
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    limits = EngineLimits(name, max_batch_size=cfg.max_live, max_input_len=max_seq_len - 1, max_seq_len=max_seq_len)
    config = KVCacheConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_num_tokens=cfg.max_num_tokens,
                           free_mem_fraction=cfg.free_mem_fraction if device.type == "cuda" else None,
                           kv_cache_dtype=cfg.kv_cache_dtype)
    info = EngineInfo(fingerprint="random-weights", toolchain={}, limits=limits, model=args, path=Path("."),
                      quantization=QuantInfo(cfg.quantization), kv_cache=config)
    apply_options(model, resolve_options(device, info))
    return EngineRunner(info, model, device, config)


def bench_throughput(cfg: ThroughputConfig, *, device: str = "auto", out_json: Path | None = None,
                     progress: Callable[[str], None] = print) -> ThroughputReport:
    """Every side on the same requests, one after the other; each warmed first on `warmup_requests`."""
    from serving.engine.runner import resolve_device
    from serving.engine.scheduler import Scheduler

    dev = resolve_device(device)
    check_sides(cfg.sides)
    if cfg.runs < 1:
        raise ValueError(f"bench throughput: runs={cfg.runs} must be at least 1")
    started = time.perf_counter()
    runner = _runner(cfg, dev)
    progress(f"model {cfg.shape} on {dev} in {time.perf_counter() - started:.0f} s; "
             f"KV cache {runner.num_blocks} blocks of {cfg.block_size}")
    report = ThroughputReport(config=asdict(cfg), device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    vocab = runner.info.model.vocab_size
    work = workload(cfg, vocab)
    warm = workload(cfg, vocab, requests=cfg.warmup_requests, output_len=min(8, cfg.output_len))
    for side in cfg.sides:
        def make(ahead: bool = side != SYNC_SIDE) -> Any:
            return Scheduler(runner, step_ahead=ahead, admit_every_steps=cfg.admit_every_steps)

        t0 = time.perf_counter()
        with side_context(side, runner.model), prefix_caching(runner, on=PREFIX_SIDE in joined_sides(side)):
            runner.decode.drop_graphs()  # captured again, with the side's options
            runner.warm_up_prefill(cfg.input_len)  # as the served model loads it: prompt steps, a mixed step, graphs
            if cfg.warmup_requests:
                run_side(make(), warm, side)
            setup = time.perf_counter() - t0
            with frozen_heap():  # as the served engine runs (serving.engine.heap)
                runs = [run_side(make(), work, side, arrivals(cfg, len(work)), (cfg.slo_ttft_ms, cfg.slo_tpot_ms))
                        for _ in range(cfg.runs)]
            result = runs[-1]
            result.run_tok_s = [r.output_tok_s for r in runs]
            profiled = None
            if cfg.profile_run and dev.type == "cuda":
                with frozen_heap():
                    profiled = profile_run(partial(run_side, make(), work, side), side)
        result.setup_s = setup
        report.sides.append(result)
        progress(result.row())
        if profiled:
            progress(profiled)
        if dev.type == "cuda":
            for rows in cfg.profile_decode:
                progress(profile_decode_step(runner, rows, cfg.input_len + cfg.output_len // 2))
            if cfg.profile_prefill:
                progress(profile_prefill_step(runner, cfg.input_len))
        if out_json is not None:
            out_json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def profile_run(run: Callable[[], object], side: str) -> str:
    """The side's run once more under the profiler: the GPU's busy share of its wall time, and its kernels."""
    from bench.kernel_table import kernel_table

    return kernel_table(run, f"{side}, the run again under the profiler", rows=30, busy=True)


def profile_decode_step(runner: Any, rows: int, position: int) -> str:
    """The kernels of one replay of the decode graph of `rows` rows (padding rows at `position`: each
    writes and reads the spare block, so attention's reads hit the cache more than live rows' would)."""
    from bench.kernel_table import kernel_table

    decode = runner.decode
    bsz = decode.bucket(rows)
    if bsz not in decode.graphs:
        decode._capture(bsz)
    decode.inputs[0, :bsz].fill_(decode.trash)
    decode.inputs[1, :bsz].zero_()
    decode.inputs[2, :bsz].fill_(position)
    decode.graphs[bsz].replay()
    return kernel_table(decode.graphs[bsz].replay, f"decode step, {bsz} rows at position {position}")


def profile_prefill_step(runner: Any, prompt_len: int) -> str:
    """One step of prompts only, as many `prompt_len`-token prompts as the step budget and the live cap
    take, each to its first token: wall time on the host (best of 3), then its kernels by device time."""
    from bench.kernel_table import kernel_table

    n = max(1, min(runner.config.max_num_tokens // prompt_len, runner.max_live))
    prompts = [[1 + i % 97] * prompt_len for i in range(n)]

    def step() -> None:
        runner.generate(prompts, max_new_tokens=1, logprobs=False)

    walls = []
    for _ in range(4):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    title = f"one step of {n} x {prompt_len} prompt tokens ({min(walls[1:]) * 1e3:.1f} ms wall)"
    return kernel_table(step, title, rows=30)
