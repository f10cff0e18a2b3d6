"""`bench paged-attention` (bench/paged_attention_bench.py) on the CPU: its variants, the bytes a
call must read, the case it times (every row's blocks distinct) and its refusals. The timing itself needs
CUDA (device runs)."""

from __future__ import annotations

import pytest
import torch

from bench.paged_attention_bench import (
    AttentionBenchConfig,
    Variant,
    bench_paged_attention,
    kv_bytes,
    make_case,
    parse_variant,
)


def test_variants_join_settings_with_plus_and_an_unknown_one_is_refused_by_name():
    assert parse_variant("plain") == Variant("plain")
    assert parse_variant("prefetch+tile64+split2") == Variant("prefetch+tile64+split2", True, tile=64, splits=2)
    assert parse_variant("dotf16+warps8") == Variant("dotf16+warps8", dot_f16=True, warps=8)
    assert parse_variant("prefetch+dotf16") == Variant("prefetch+dotf16", prefetch=True, dot_f16=True)
    assert parse_variant("warps8+stages3") == Variant("warps8+stages3", warps=8, stages=3)
    for bad in ("fast", "tile", "split0", "prefetch+x", "warpsx"):
        with pytest.raises(ValueError, match="unknown variant setting"):
            parse_variant(bad)


def test_bytes_are_k_and_v_of_every_position_and_head_at_the_pools_dtype():
    cfg = AttentionBenchConfig(rows=400, context=3072)
    assert kv_bytes(cfg) == 2 * 400 * 3072 * 8 * 128  # e4m3: one byte each
    assert kv_bytes(AttentionBenchConfig(rows=400, context=3072, kv_dtype="bf16")) == 2 * kv_bytes(cfg)


def test_the_case_gives_every_row_its_own_blocks_and_the_full_context():
    cfg = AttentionBenchConfig(rows=5, context=70, kv_heads=2, group=4, head_dim=16, block_size=16, kv_dtype="bf16")
    q, k, v, tables, lengths = make_case(cfg, torch.device("cpu"))
    assert q.shape == (5, 2, 4, 16) and k.shape == v.shape == (25, 16, 2, 16)
    assert tables.shape == (5, 5) and tables.unique().numel() == 25
    assert lengths.tolist() == [70] * 5


def test_it_runs_on_cuda_only_and_refuses_an_unknown_kv_dtype():
    with pytest.raises(ValueError, match="device='cpu'"):
        bench_paged_attention(AttentionBenchConfig(), device="cpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="kv_dtype='int4'"):
            bench_paged_attention(AttentionBenchConfig(kv_dtype="int4"))


def test_variant_kernel_options_move_the_kernels_launch():
    from bench.paged_attention_bench import variant_kernel
    from serving.engine.options import AttentionKernelOptions

    settings = ("prefetch_blocks", "fp8_kv_dot_f16", "num_warps", "fp8_num_warps", "num_stages")
    kernel = variant_kernel(parse_variant("plain+warps8+stages2"))
    assert [getattr(kernel, name) for name in settings] == [False, False, 8, 8, 2]
    assert variant_kernel(parse_variant("prefetch+dotf16")) == AttentionKernelOptions()  # the engine's defaults
