"""`head_norm.norm_heads_` (Qwen3's q and k head norms in one Triton kernel, in place) against the two
`model.RMSNorm` modules' torch ops on the heads of the same projection.

- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the kernel on CPU tensors, in
  float16 (the interpreter's float32 -> bfloat16 cast does not round to nearest, so bf16 is checked on the GPU).
- CUDA (`gpu`): `Qwen3Attention.qkv` on the GPU, which dispatches eager calls to the kernel.
The kernel rounds as the modules do; only the sum's order and the rsqrt differ, so a value may land a step of
the dtype away (as `row_norm`'s, tests/test_row_norm.py); the value columns are never touched.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from serving.engine import head_norm
from serving.engine.model import ModelArgs, RMSNorm, StepContext
from serving.engine.models.qwen3 import Qwen3Attention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and head_norm.triton is not None
HAS_CUDA = torch.cuda.is_available() and head_norm.triton is not None and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if head_norm.triton is not None else "needs a CUDA GPU and the triton package"
SHAPES = ((5, 4, 2, 32), (3, 8, 2, 128), (2, 3, 3, 80))  # tokens, H, Hkv, head_dim (80: a masked tail)


def case(shape: tuple[int, int, int, int], device: str, dtype: torch.dtype):
    tokens, n_heads, n_kv_heads, head_dim = shape
    torch.manual_seed(sum(shape))
    q_norm, k_norm = (RMSNorm(head_dim, 1e-6).to(device=device, dtype=dtype) for _ in range(2))
    for norm in (q_norm, k_norm):
        norm.weight.data = (1 + 0.2 * torch.randn(head_dim, device=device)).to(dtype)
    qkv = (3 * torch.randn(tokens, (n_heads + 2 * n_kv_heads) * head_dim, device=device)).to(dtype)
    return q_norm, k_norm, qkv


def torch_ops(q_norm: RMSNorm, k_norm: RMSNorm, qkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """What `Qwen3Attention.qkv` computes without the kernel: each head view through its module's torch ops."""
    d = q_norm.weight.shape[0]
    q, k, v = qkv.split([n_heads * d, n_kv_heads * d, n_kv_heads * d], dim=-1)
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        q, k = q_norm(q.unflatten(-1, (n_heads, d))), k_norm(k.unflatten(-1, (n_kv_heads, d)))
    return torch.cat([q.flatten(-2), k.flatten(-2), v], dim=-1)


def check_close(out: torch.Tensor, ref: torch.Tensor, values_from: int) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.equal(out[:, values_from:], ref[:, values_from:]), "the value heads are left as they were"
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2.0**-6 + 1e-6).all()), float(diff.max())
    assert float((diff == 0).float().mean()) > 0.97


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pdl", (False, True))
def test_kernel_norms_each_head_in_place_as_the_modules_do_interpreted(shape, pdl) -> None:
    _, n_heads, n_kv_heads, head_dim = shape
    q_norm, k_norm, qkv = case(shape, "cpu", torch.float16)
    ref = torch_ops(q_norm, k_norm, qkv, n_heads, n_kv_heads)
    out = head_norm.norm_heads_(qkv, q_norm.weight, k_norm.weight, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                eps=q_norm.eps, pdl=pdl)
    assert out is qkv
    check_close(out, ref, (n_heads + n_kv_heads) * head_dim)


def test_fits_only_half_precision_projections_of_the_weights_dtype() -> None:
    w = torch.ones(32, dtype=torch.bfloat16)
    qkv = torch.ones(3, 8 * 32, dtype=torch.bfloat16)
    assert head_norm.fits(qkv, w, w) is (head_norm.triton is not None)
    assert not head_norm.fits(qkv.float(), w.float(), w.float()) and not head_norm.fits(qkv, w.half(), w.half())
    assert not head_norm.fits(torch.ones(3, 8 * 32, 2, dtype=torch.bfloat16)[..., 0], w, w)  # strided columns


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("shape", (*SHAPES, (4096, 32, 8, 128)))
def test_qwen3_attention_runs_the_kernel_on_the_gpu(shape) -> None:
    tokens, n_heads, n_kv_heads, head_dim = shape
    args = ModelArgs(architecture="Qwen3ForCausalLM", vocab_size=16, dim=64, n_layers=1, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, head_dim=head_dim, intermediate_size=64, norm_eps=1e-6,
                     max_position_embeddings=64)
    q_norm, k_norm, qkv = case(shape, "cuda", torch.bfloat16)
    attention = Qwen3Attention(args).to(device="cuda", dtype=torch.bfloat16)
    attention.q_norm, attention.k_norm = q_norm, k_norm
    ctx = StepContext(reference=False, pdl=False, qkv_e4m3=False, w13_e4m3=False)
    ref = torch_ops(q_norm, k_norm, qkv, n_heads, n_kv_heads)
    with mock.patch.object(ctx, "linear", return_value=qkv.clone()), \
            mock.patch.object(head_norm, "norm_heads_", wraps=head_norm.norm_heads_) as kernel:
        out = attention.qkv(torch.empty(tokens, 64, device="cuda", dtype=torch.bfloat16), ctx)
    assert kernel.called, "the eager GPU call went through the kernel"
    check_close(out, ref, (n_heads + n_kv_heads) * head_dim)
