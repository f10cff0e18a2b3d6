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

fp8 pools (an fp8 KV cache): the keys and values are stored clamped to +-448 and rounded to e4m3, as
`PagedKVCache.write` stores them. On the GPU that is checked against torch's cast of the torch ops' K/V. The
interpreter's float32 -> float8e4nv cast is not torch's: it takes e4m3's subnormals to zero and, where
rounding up carries into the next binade, halves the value (0.0304 -> 0.015625 for 0.03125, in Triton
3.9), so under it the kernel's stores are checked against that same cast (`_as_stored` applied to the torch
ops' K/V by a one-line kernel): slots, heads, the clamp and the dtype path, with rounding left to the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from serving.engine import paged_rope
from serving.engine.kv_cache import KV_FP8_DTYPE, KV_FP8_MAX, to_kv_fp8
from serving.engine.model import _rope_1

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and paged_rope.triton is not None
HAS_CUDA = torch.cuda.is_available() and paged_rope.triton is not None and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if paged_rope.triton is not None else "needs a CUDA GPU and the triton package"
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


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_the_torch_ops_interpreted(shape: tuple[int, int, int, int]) -> None:
    check(shape, "cpu", torch.float16, exact=True)


@pytest.mark.interpreter
def test_kernel_launched_with_pdl_writes_what_it_writes_without_interpreted() -> None:
    c, again = case(SHAPES[0], "cpu", torch.float16), case(SHAPES[0], "cpu", torch.float16)
    q, keys = paged_rope._launch(**c, keys_out=True)
    q_pdl, keys_pdl = paged_rope._launch(**again, keys_out=True, pdl=True)
    assert torch.equal(q_pdl, q) and torch.equal(keys_pdl, keys)
    for pool in ("k_pool", "v_pool"):
        assert torch.equal(again[pool].nan_to_num(), c[pool].nan_to_num())


def test_fits_only_cuda_half_precision_steps() -> None:
    qkv = torch.ones(2, 96, dtype=torch.bfloat16)
    pool = torch.ones(4, 4, 2, 16, dtype=torch.bfloat16)
    assert not paged_rope.fits(qkv, pool, 16), "CPU tensors take the torch ops"
    if torch.cuda.is_available() and paged_rope.triton is not None:
        assert paged_rope.fits(qkv.cuda(), pool.cuda(), 16)
        assert not paged_rope.fits(qkv.cuda().float(), pool.cuda().float(), 16)
        assert not paged_rope.fits(qkv.cuda(), pool.cuda(), 24)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("shape", (*SHAPES, (64, 32, 8, 128), (1024, 32, 8, 128)))
def test_kernel_equals_the_torch_ops_on_the_gpu(shape: tuple[int, int, int, int]) -> None:
    check(shape, "cuda", torch.bfloat16, exact=False)


if paged_rope.triton is not None:
    tl = paged_rope.tl

    @paged_rope.triton.jit
    def _stored_by_triton(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, paged_rope._as_stored(tl.load(x_ptr + offs), out_ptr))


def as_triton_stores(x: torch.Tensor) -> torch.Tensor:
    """x cast to e4m3 by the kernel's own store path (`paged_rope._as_stored`), back in float32; x's NaN (the
    slots not written) kept NaN (the clamp's max/min would turn them into a number)."""
    flat = x.reshape(-1)
    n = paged_rope.triton.next_power_of_2(flat.numel())
    src = torch.cat((flat.nan_to_num(), flat.new_zeros(n - flat.numel())))
    out = torch.empty(n, dtype=KV_FP8_DTYPE, device=x.device)
    _stored_by_triton[(1,)](src, out, N=n)
    return out[:flat.numel()].view(x.shape).float().masked_fill(x.isnan(), float("nan"))


def check_fp8(shape: tuple[int, int, int, int], device: str, dtype: torch.dtype, *, interpreted: bool) -> None:
    """The kernel with e4m3 pools: queries and returned keys as with pools of qkv's dtype (exactly under the
    interpreter, within one dtype step on the GPU); the pools hold the torch ops' K/V clamped and rounded
    (on the GPU: torch's cast of the torch ops' keys, a key off by no more than its rotation may be (two dtype
    steps at the size of its terms: the kernel rotates in float32, the torch ops round each term to the dtype)
    plus one e4m3 step, since each side rounds to nearest;
    interpreted: the interpreter's own cast, see the module doc); a value of 1000 is stored as 448."""
    c, plain = case(shape, device, dtype), case(shape, device, dtype)
    c["qkv"][0, -1] = plain["qkv"][0, -1] = 1000.0  # the first token's last value: out of e4m3's range
    for name in ("k_pool", "v_pool"):
        c[name] = torch.full(c[name].shape, float("nan"), dtype=KV_FP8_DTYPE, device=device)
    _, _, k_ref, v_ref = torch_ops(plain)
    k_size = term_sizes(plain)[2]
    q, keys = paged_rope.rope_write_keys(**c)
    q_plain, keys_plain = paged_rope.rope_write_keys(**plain)
    assert torch.equal(q, q_plain) and torch.equal(keys, keys_plain), "queries and keys do not depend on the pools"
    assert c["v_pool"].view(-1, *c["v_pool"].shape[2:])[c["slots"][0], -1, -1].float() == KV_FP8_MAX
    cast = as_triton_stores if interpreted else to_kv_fp8
    for name, out, ref in (("k", c["k_pool"], k_ref), ("v", c["v_pool"], v_ref)):
        want = cast(ref.float()).float()
        got = out.float()
        assert torch.equal(got.isnan(), want.isnan()), f"{name}: written where torch writes, nowhere else"
        got, want = got.nan_to_num(), want.nan_to_num()
        diff = (got - want).abs()
        what = f"{name}: {int((diff > 0).sum())} of {diff.numel()} differ, the largest by {float(diff.max()):.3g}"
        if interpreted or name == "v":
            assert torch.equal(got, want), what
        else:  # the rotations' difference, then one e4m3 step (2**-3 relative, 2**-9 below the normal range)
            rotation = 2 * torch.finfo(dtype).eps * k_size.nan_to_num()
            assert bool((diff <= rotation + got.abs().maximum(want.abs()) * 2 ** -3 + 2 ** -9).all()), what
    if interpreted:
        off = int((c["k_pool"].float().nan_to_num() != to_kv_fp8(k_ref.float()).float().nan_to_num()).sum())
        print(f"{shape}: {off} keys stored otherwise than torch's cast, by the interpreter's fp8 cast")


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_writes_fp8_pools_as_the_interpreter_casts_interpreted(shape: tuple[int, int, int, int]) -> None:
    check_fp8(shape, "cpu", torch.float16, interpreted=True)


def test_fits_takes_fp8_pools_of_half_precision_rows() -> None:
    qkv = torch.ones(2, 96, dtype=torch.bfloat16)
    pool = torch.ones(4, 4, 2, 16).to(KV_FP8_DTYPE)
    assert not paged_rope.fits(qkv, pool, 16), "CPU tensors take the torch ops (PagedKVCache.write casts)"
    if torch.cuda.is_available() and paged_rope.triton is not None:
        assert paged_rope.fits(qkv.cuda(), pool.cuda(), 16)
        assert not paged_rope.fits(qkv.cuda().float(), pool.cuda(), 16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("shape", (*SHAPES, (64, 32, 8, 128), (1024, 32, 8, 128)))
def test_kernel_writes_fp8_pools_as_torch_casts_on_the_gpu(shape: tuple[int, int, int, int]) -> None:
    check_fp8(shape, "cuda", torch.bfloat16, interpreted=False)
