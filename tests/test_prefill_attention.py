"""`prefill_attention.sdpa`: the prefills' SDPA without cuDNN's backend (which compiles a plan per new shape).

- CPU, every run: the same values as `F.scaled_dot_product_attention` (it is that call).
- CUDA (`gpu`): causal bf16 attention at a few prompt counts, against the default SDPA within bf16 noise, and
  no cuDNN kernel in the profile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving.engine.prefill_attention import sdpa


def qkv(m: int, device: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(m)
    return tuple(torch.randn(m, 8, 64, 64, device=device, dtype=dtype) for _ in range(3))


def test_on_the_cpu_it_is_sdpa() -> None:
    q, k, v = qkv(3, "cpu")
    assert torch.equal(sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", (1, 7, 33))
def test_on_cuda_no_cudnn_kernel_and_the_same_attention(m: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    q, k, v = qkv(m, "cuda", torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = sdpa(q, k, v, is_causal=True)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert not any("cudnn" in n for n in names), names
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("first", (None, 0))
def test_paged_prompt_attention_with_sdpa_grouped_heads_matches_the_copied_heads(first: int | None) -> None:
    from serving.engine import step

    m, n, heads, kv_heads, hd = 6, 40, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(m * n, heads, hd, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(m * n, kv_heads, hd, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    rows = torch.arange(m * n, device="cuda").view(m, n)
    grouped = step._fresh_attention(q, k, v, rows, heads // kv_heads, first)
    copied = step._fresh_attention(q, k, v, rows, heads // kv_heads, first, gqa_in_sdpa=False)
    torch.testing.assert_close(grouped, copied)
