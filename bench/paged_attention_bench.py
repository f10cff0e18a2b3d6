"""`python3 -m bench paged-attention`: the paged decode attention kernel alone, at a step's shape.

`rows` sequences of `context` positions each, one layer's K/V pools of 32-position blocks in bf16 or e4m3,
every row's blocks distinct and scattered over the pool (as a pool that has served for a while lends them),
so each call reads all of its K/V from memory: rows x context x kv_heads x head_dim x 2 (K and V) elements.
For each variant: microseconds a call (calls captured in a CUDA graph, `cuda_timing.graph_time_us`), the
rate its bytes make, and that rate's share of the device copy bandwidth measured in the same run. The
2048/2048 FP8 step (400 rows at ~3,072 positions) is `--rows 400 --context 3072 --kv-dtype fp8`: its
attention was ~45 of the step's 49 ms where the bytes need ~19 (docs/throughput.md).

Variants (comma list; `+` joins settings): `plain` (one block an iteration, its table entry, K and V loaded one
after another), `prefetch` (`PREFETCH_BLOCKS`: the engine's default), `dotf16` (`FP8_KV_DOT_F16`, the
engine's default: an e4m3 pool's dots in float16; without it, bf16), `tile<N>` (N positions an iteration), `split<N>` (positions split N ways; the engine
splits only when the batch leaves SMs idle), `warps<N>` and `stages<N>` (the launch's warps a program and
pipelining stages), e.g. `plain,prefetch,tile128,prefetch+split2,prefetch+warps8`.

Imports: stdlib and torch; the engine's kernel module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from serving.engine.options import AttentionKernelOptions

KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FLAGS = {"prefetch": "prefetch", "dotf16": "dot_f16"}  # variant word -> Variant field
NUMBERS = {"tile": "tile", "split": "splits", "warps": "warps", "stages": "stages"}  # word<N> -> Variant field


@dataclass(frozen=True)
class Variant:
    name: str
    prefetch: bool = False
    dot_f16: bool = False
    tile: int | None = None
    splits: int | None = None
    warps: int | None = None
    stages: int | None = None


@dataclass(frozen=True)
class AttentionBenchConfig:
    rows: int = 400
    context: int = 3072
    kv_heads: int = 8
    group: int = 4  # query heads per KV head
    head_dim: int = 128
    block_size: int = 32
    kv_dtype: str = "fp8"
    variants: tuple[str, ...] = ("plain", "prefetch")
    seed: int = 0


@dataclass
class AttentionBenchReport:
    config: dict[str, Any]
    kv_bytes: int  # K and V bytes one call must read
    copy_gb_s: float
    results: list[dict[str, Any]] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    """`prefetch+tile64+split2` -> Variant; an unknown setting is refused, naming it."""
    settings: dict[str, Any] = {}
    for part in text.split("+"):
        if part == "plain":
            continue
        if part in FLAGS:
            settings[FLAGS[part]] = True
            continue
        key = next((k for k in NUMBERS if part.startswith(k)), None)
        if key is None or not part[len(key):].isdigit() or int(part[len(key):]) < 1:
            raise ValueError(f"bench paged-attention: unknown variant setting {part!r} in {text!r} (plain, "
                             + ", ".join([*FLAGS, *(f"{k}<N>" for k in NUMBERS)]) + ", joined by '+')")
        settings[NUMBERS[key]] = int(part[len(key):])
    return Variant(text, **settings)


def kv_bytes(cfg: AttentionBenchConfig) -> int:
    """The K and V bytes one call reads: every row's `context` positions, every KV head."""
    element = torch.empty((), dtype=KV_DTYPES[cfg.kv_dtype]).element_size()
    return 2 * cfg.rows * cfg.context * cfg.kv_heads * cfg.head_dim * element


def make_case(cfg: AttentionBenchConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q [rows, kv_heads, group, hd] bf16; pools [blocks, block_size, kv_heads, hd] of `kv_dtype`, each row's
    blocks distinct and shuffled over the pool; tables [rows, blocks a row]; lengths [rows] = context."""
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    per_row = -(-cfg.context // cfg.block_size)
    num_blocks = cfg.rows * per_row
    shape = (num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim)
    k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16).to(KV_DTYPES[cfg.kv_dtype]) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=gen).view(cfg.rows, per_row).to(device)
    lengths = torch.full((cfg.rows,), cfg.context, dtype=torch.long, device=device)
    q = torch.randn(cfg.rows, cfg.kv_heads, cfg.group, cfg.head_dim, device=device, dtype=torch.bfloat16)
    return q, k, v, tables, lengths


def variant_call(variant: Variant, case: tuple[torch.Tensor, ...], scale: float) -> Callable[[], torch.Tensor]:
    from serving.engine.paged_attention import paged_decode_triton

    kernel = variant_kernel(variant)
    return lambda: paged_decode_triton(*case, scale, splits=variant.splits, tile=variant.tile, kernel=kernel)


def variant_kernel(variant: Variant) -> AttentionKernelOptions:
    """The kernel's launch options a variant runs with (the engine's defaults for what it leaves alone)."""
    from serving.engine.options import AttentionKernelOptions

    warps = {} if variant.warps is None else {"num_warps": variant.warps, "fp8_num_warps": variant.warps}
    return AttentionKernelOptions(prefetch_blocks=variant.prefetch, fp8_kv_dot_f16=variant.dot_f16,
                                  num_stages=variant.stages, **warps)


def bench_paged_attention(cfg: AttentionBenchConfig, *, device: str = "cuda",
                          progress: Callable[[str], None] = print) -> AttentionBenchReport:
    """Time each variant on one case (see the module doc); the first variant's output is the others' check."""
    from bench.offline import copy_bandwidth_gb_s
    from serving.engine.cuda_timing import graph_time_us

    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"bench paged-attention: device={device!r}: the kernel is timed on CUDA only")
    if cfg.kv_dtype not in KV_DTYPES:
        raise ValueError(f"bench paged-attention: kv_dtype={cfg.kv_dtype!r} is not one of {sorted(KV_DTYPES)}")
    variants = [parse_variant(v) for v in cfg.variants]
    nbytes = kv_bytes(cfg)
    report = AttentionBenchReport(asdict(cfg), nbytes, copy_bandwidth_gb_s(device))
    progress(f"{cfg.rows} rows x {cfg.context} positions, {cfg.kv_dtype} K/V {nbytes / 1e9:.2f} GB a call; "
             f"copy bandwidth {report.copy_gb_s:.0f} GB/s")
    case = make_case(cfg, dev)
    scale = cfg.head_dim ** -0.5
    first: torch.Tensor | None = None
    for variant in variants:
        call = variant_call(variant, case, scale)
        out = call()
        us = graph_time_us(call, calls=5, replays=4)
        diff = 0.0 if first is None else float((out.float() - first.float()).abs().max())
        first = out if first is None else first
        rate = nbytes / (us * 1e-6) / 1e9
        row = {"variant": variant.name, "us": us, "gb_s": rate, "of_copy": rate / report.copy_gb_s,
               "max_diff_vs_first": diff}
        report.results.append(row)
        progress(f"{variant.name:>24}: {us:9.1f} us  {rate:7.0f} GB/s  {100 * rate / report.copy_gb_s:5.1f}% of copy"
                 f"  max |diff| vs {variants[0].name} {diff:.3g}")
    return report
