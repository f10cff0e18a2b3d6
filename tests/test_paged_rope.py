"""`paged_rope.rope_and_write` / `rope_write_keys` (one Triton kernel) against the torch ops they replace in the
paged steps: the tables' rows gathered, `model._rope_1` on the query and key heads, `PagedKVCache.write`.

- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): CPU tensors in float16 (the
  interpreter's float32 -> bfloat16 cast does not round to nearest; bf16 is checked on the GPU).
- CUDA (`gpu`): bf16 at the Llama-8B head shapes.
The values are copied exactly; the rotations agree with torch's to rounding: the kernel asks for each product
rounded to the dtype before the sum, as the torch ops do (and under the interpreter, in float16, they are equal
to the last bit), but on the H200 the compiler may keep a product unrounded (46 of 320 rotated values one bf16
step away), so there each value is held within one step of the dtype at the size of its two terms. Slots not
written keep their NaN, so a write to a wrong slot or head shows.
"""

from __future__ import annotations

import os

import pytest
import torch

from serving.engine import paged_rope
from serving.engine.model import _rope_1

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and paged_rope.triton is not None
HAS_CUDA = torch.cuda.is_available() and paged_rope.triton is not None and not INTERPRET
SHAPES = ((5, 4, 2, 16), (3, 6, 2, 32))  # tokens, query heads, kv heads, head_dim (6 and 2: padded head tiles)


def case(shape: tuple[int, int, int, int], device: str, dtype: torch.dtype) -> dict:
    tokens, heads, kv_heads, hd = shape
    torch.manual_seed(sum(shape))
    block_size = 4
    blocks, max_seq = max(6, tokens // block_size + 2), max(64, tokens)  # room for every token's own slot
    angles = torch.arange(max_seq, device=device)[:, None] * (0.1 ** torch.linspace(0, 3, hd // 2, device=device))
    angles = torch.cat((angles, angles), dim=-1)
    return {"qkv": (2 * torch.randn(tokens, (heads + 2 * kv_heads) * hd, device=device)).to(dtype),
            "positions": torch.randperm(max_seq, device=device)[:tokens],
            "slots": torch.randperm(blocks * block_size, device=device)[:tokens],
            "cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype),
            "k_pool": torch.full((blocks, block_size, kv_heads, hd), float("nan"), device=device, dtype=dtype),
            "v_pool": torch.full((blocks, block_size, kv_heads, hd), float("nan"), device=device, dtype=dtype),
            "n_heads": heads, "n_kv_heads": kv_heads}


def torch_ops(c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, heads, kv_heads = c["qkv"].shape[0], c["n_heads"], c["n_kv_heads"]
    hd = c["k_pool"].shape[-1]
    cos, sin = c["cos"][c["positions"]], c["sin"][c["positions"]]
    q, k, v = c["qkv"].split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q = _rope_1(q.view(n, heads, hd), cos, sin)
    k_pool, v_pool = c["k_pool"].clone(), c["v_pool"].clone()
    k = _rope_1(k.reshape(n, kv_heads, hd), cos, sin)
    k_pool.view(-1, kv_heads, hd)[c["slots"]] = k
    v_pool.view(-1, kv_heads, hd)[c["slots"]] = v.reshape(n, kv_heads, hd)
    return q, k, k_pool, v_pool


def term_sizes(c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|x| |cos| + |rotate_half(x)| |sin| of every rotated query and key value, in float32 (the size of the
    two terms each result is the rounded sum of): q [T, H, hd], k [T, Hkv, hd] and k laid out as the pool."""
    n, heads, kv_heads = c["qkv"].shape[0], c["n_heads"], c["n_kv_heads"]
    hd = c["k_pool"].shape[-1]
    cos, sin = c["cos"][c["positions"]].float().abs()[:, None], c["sin"][c["positions"]].float().abs()[:, None]
    x = c["qkv"].float().abs()
    q, k = x[:, :heads * hd].view(n, heads, hd), x[:, heads * hd:(heads + kv_heads) * hd].view(n, kv_heads, hd)
    size = [t * cos + torch.cat(t.chunk(2, dim=-1)[::-1], dim=-1) * sin for t in (q, k)]
    k_size = torch.zeros(c["k_pool"].shape, device=q.device).view(-1, kv_heads, hd)
    k_size[c["slots"]] = size[1]
    return size[0], size[1], k_size.view(c["k_pool"].shape)


def check(shape: tuple[int, int, int, int], device: str, dtype: torch.dtype, exact: bool) -> None:
    c, again = case(shape, device, dtype), case(shape, device, dtype)
    q_ref, keys_ref, k_ref, v_ref = torch_ops(c)
    q_size, keys_size, k_size = term_sizes(c)
    q = paged_rope.rope_and_write(**c)
    q_again, keys = paged_rope.rope_write_keys(**again)
    assert torch.equal(q_again, q) and torch.equal(again["k_pool"].nan_to_num(), c["k_pool"].nan_to_num())
    step = torch.finfo(dtype).eps  # one step of the dtype at 1.0
    for name, out, ref, size in (("q", q, q_ref, q_size), ("k", c["k_pool"], k_ref, k_size),
                                 ("v", c["v_pool"], v_ref, None), ("keys", keys, keys_ref, keys_size)):
        assert torch.equal(out.isnan(), ref.isnan()), f"{name}: written where torch writes, nowhere else"
        diff = (out.nan_to_num().float() - ref.nan_to_num().float()).abs()
        what = f"{name}: {int((diff > 0).sum())} of {diff.numel()} differ, the largest by {float(diff.max()):.3g}"
        if exact or size is None:
            assert torch.equal(out.nan_to_num(), ref.nan_to_num()), what
        else:
            assert bool((diff <= 2 * step * size + 1e-6).all()), what


@pytest.mark.skipif(not INTERPRET, reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_the_torch_ops_interpreted(shape: tuple[int, int, int, int]) -> None:
    check(shape, "cpu", torch.float16, exact=True)


def test_fits_only_cuda_half_precision_steps() -> None:
    qkv = torch.ones(2, 96, dtype=torch.bfloat16)
    pool = torch.ones(4, 4, 2, 16, dtype=torch.bfloat16)
    assert not paged_rope.fits(qkv, pool, 16), "CPU tensors take the torch ops"
    if torch.cuda.is_available() and paged_rope.triton is not None:
        assert paged_rope.fits(qkv.cuda(), pool.cuda(), 16)
        assert not paged_rope.fits(qkv.cuda().float(), pool.cuda().float(), 16)
        assert not paged_rope.fits(qkv.cuda(), pool.cuda(), 24)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("shape", (*SHAPES, (64, 32, 8, 128), (1024, 32, 8, 128)))
def test_kernel_equals_the_torch_ops_on_the_gpu(shape: tuple[int, int, int, int]) -> None:
    check(shape, "cuda", torch.bfloat16, exact=False)
