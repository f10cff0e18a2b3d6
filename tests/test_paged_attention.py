"""Decode attention through block tables (serving/engine/paged_attention.py).

- CPU, every run: the torch reference against a naive per-row softmax over each row's own positions.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the Triton kernel on CPU tensors
  against the reference, with the pools NaN wherever no row's visible positions lie.
- CUDA (`gpu`): the kernel against the reference in bf16.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from serving.engine.paged_attention import kernel_fits, paged_decode_reference, paged_decode_triton, triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton is not None
HAS_CUDA = torch.cuda.is_available() and triton is not None and not INTERPRET


def _case(*, bsz=3, n_kv=2, group=4, hd=16, block=16, lengths=(1, 17, 40), dtype=torch.float32, device="cpu",
          fill=0.0, seed=0):
    """Random q and pools; each row gets its own shuffled blocks; positions no row sees hold `fill`."""
    gen = torch.Generator().manual_seed(seed)
    n = max(-(-x // block) for x in lengths)
    num_blocks = bsz * n + 3
    k = torch.full((num_blocks, block, n_kv, hd), fill)
    v = torch.full((num_blocks, block, n_kv, hd), fill)
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(bsz, n, dtype=torch.long)
    for b, length in enumerate(lengths):
        tables[b] = ids[b * n:(b + 1) * n]
        for p in range(length):
            k[tables[b, p // block], p % block] = torch.randn(n_kv, hd, generator=gen)
            v[tables[b, p // block], p % block] = torch.randn(n_kv, hd, generator=gen)
    q = torch.randn(bsz, n_kv, group, hd, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.long)
    return [t.to(device) for t in (q.to(dtype), k.to(dtype), v.to(dtype), tables, lens)]


def _naive(q, k, v, tables, lengths, scale):
    out = torch.empty_like(q, dtype=torch.float32)
    block = k.shape[1]
    for b in range(q.shape[0]):
        pos = torch.arange(int(lengths[b]))
        keys = k[tables[b, pos // block], pos % block].float()  # [L, Hkv, hd]
        values = v[tables[b, pos // block], pos % block].float()
        for h in range(q.shape[1]):
            probs = (q[b, h].float() @ keys[:, h].T * scale).softmax(-1)  # [G, L]
            out[b, h] = probs @ values[:, h]
    return out


def test_reference_equals_a_naive_softmax_over_each_rows_blocks():
    q, k, v, tables, lengths = _case()
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_reference(q, k, v, tables, lengths, scale)
    assert torch.allclose(got, _naive(q, k, v, tables, lengths, scale), atol=1e-5)
    assert not kernel_fits(8, 16) and not kernel_fits(16, 24)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton (the kernel on CPU tensors)")
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_under_the_interpreter_equals_the_reference(group):
    q, k, v, tables, lengths = _case(group=group, fill=float("nan"))
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q, k, v, tables, lengths, scale)
    want = _naive(q, k, v, tables, lengths, scale)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and Triton")
def test_kernel_on_cuda_bf16_equals_the_reference():
    q, k, v, tables, lengths = _case(bsz=64, n_kv=8, group=4, hd=128, block=32,
                                     lengths=tuple(range(1, 640, 10)), dtype=torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q, k, v, tables, lengths, scale).float()
    want = paged_decode_reference(q, k, v, tables, lengths, scale).float()
    assert (got - want).abs().max() < 2e-2
