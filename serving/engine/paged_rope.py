"""The paged steps' rotary embedding and K/V write in one Triton kernel.

`rope_and_write(qkv, positions, slots, cos, sin, k_pool, v_pool, n_heads, n_kv_heads)` takes the wqkv
projection of B tokens ([B, (n_heads + 2 n_kv_heads) * hd]), rotates each token's query and key heads by its
position's row of the cos / sin tables ([max_seq_len, hd], HF's layout: the half-table twice), writes the
rotated keys and the values into the pools at the tokens' `slots` (block * block_size + offset, pools
`[num_blocks, block_size, Hkv, hd]`) and returns the rotated queries [B, n_heads, hd]; `rope_write_keys`
returns the rotated keys too, for a mixed step whose prompts attend over their own keys.

In torch that is a gather of the tables' rows, ten elementwise launches (`model._rope_1` on q and on k) and
two index writes a layer, each a pass over the step's heads: about a quarter of the paged decode step's
launches (and a share of a long prompt step: docs/decisions.md).
One program per token does it all here. It asks for torch's rounding (each product to the dtype, then the
sum), which the interpreter gives to the last bit; compiled for the GPU a product may stay unrounded, so a
rotated value can land one step of the dtype away (tests/test_paged_rope.py). Values are copied exactly.

Pools of float8_e4m3fn (an fp8 KV cache, `kv_cache`'s module doc) take the rotated keys and the values as
`PagedKVCache.write` stores them: clamped to +-448 in float32, then cast to e4m3 rounding to nearest (scale
1.0); the queries and the returned keys stay in qkv's dtype. The pointer's element type picks the store, so
bf16 pools are written as before.

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

from serving.engine.kv_cache import KV_FP8_DTYPE, KV_FP8_MAX, KV_FP8_SCALE, PagedKVCache
from serving.engine.model import _rope_1
from serving.engine.pdl import gdc, launch_options

try:
    import triton
    import triton.language as tl

    from serving.engine.pdl import gdc_enter
except ImportError:  # CPU-only installs
    triton = None

DTYPES = (torch.bfloat16, torch.float16)

if triton is not None:
    _FP8_MAX = tl.constexpr(KV_FP8_MAX)

    @triton.jit
    def _rotated(x_ptr, offs_h, h_mask, offs_d, c1, c2, s1, s2, HALF: tl.constexpr):
        """Heads at x_ptr ([heads, 2 * HALF] rows) rotated: x * cos + cat(-x2, x1) * sin as two halves, each
        product rounded to the dtype before the sum (torch's order)."""
        src = x_ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        x1 = tl.load(src, mask=h_mask[:, None], other=0.0)
        x2 = tl.load(src + HALF, mask=h_mask[:, None], other=0.0)
        dt = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _as_stored(x, dst_ptr):
        """x in the element type of dst_ptr: clamped to +-448 and rounded to nearest for an e4m3 pool, as
        `PagedKVCache.write`; unchanged for a pool of x's dtype."""
        if dst_ptr.dtype.element_ty == tl.float8e4nv:
            x = tl.minimum(tl.maximum(x.to(tl.float32), -_FP8_MAX), _FP8_MAX)
            x = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        return x.to(dst_ptr.dtype.element_ty)

    @triton.jit
    def _store_halves(dst_ptr, offs_h, h_mask, offs_d, o1, o2, HALF: tl.constexpr):
        dst = dst_ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        tl.store(dst, _as_stored(o1, dst_ptr), mask=h_mask[:, None])
        tl.store(dst + HALF, _as_stored(o2, dst_ptr), mask=h_mask[:, None])

    @triton.jit
    def _rope_write_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, k_pool_ptr, v_pool_ptr,
                           stride_qkv, stride_table, stride_q, stride_k, stride_slot,
                           N_HEADS: tl.constexpr, N_KV: tl.constexpr, H_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                           HALF: tl.constexpr, KEYS_OUT: tl.constexpr, GDC: tl.constexpr = False):
        if GDC:
            gdc_enter()
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs_d = tl.arange(0, HALF)
        table = pos * stride_table + offs_d
        c1 = tl.load(cos_ptr + table).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + table + HALF).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + table).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + table + HALF).to(tl.float32)[None, :]
        row = qkv_ptr + t * stride_qkv
        offs_h = tl.arange(0, H_PAD)
        h_mask = offs_h < N_HEADS
        q1, q2 = _rotated(row, offs_h, h_mask, offs_d, c1, c2, s1, s2, HALF)
        _store_halves(q_ptr + t * stride_q, offs_h, h_mask, offs_d, q1, q2, HALF)
        offs_kv = tl.arange(0, KV_PAD)
        kv_mask = offs_kv < N_KV
        k1, k2 = _rotated(row + N_HEADS * 2 * HALF, offs_kv, kv_mask, offs_d, c1, c2, s1, s2, HALF)
        _store_halves(k_pool_ptr + slot * stride_slot, offs_kv, kv_mask, offs_d, k1, k2, HALF)
        if KEYS_OUT:
            _store_halves(k_ptr + t * stride_k, offs_kv, kv_mask, offs_d, k1, k2, HALF)
        offs_v = offs_kv[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
        v = tl.load(row + (N_HEADS + N_KV) * 2 * HALF + offs_v, mask=kv_mask[:, None], other=0.0)
        tl.store(v_pool_ptr + slot * stride_slot + offs_v, _as_stored(v, v_pool_ptr), mask=kv_mask[:, None])


def fits(qkv: torch.Tensor, k_pool: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel takes this step: Triton importable, CUDA half-precision rows, contiguous pools of
    the same dtype (or e4m3, stored with scale 1.0), an even power-of-two head_dim of at least 16."""
    pool_ok = k_pool.dtype == qkv.dtype or (k_pool.dtype == KV_FP8_DTYPE and KV_FP8_SCALE == 1.0)
    return (triton is not None and qkv.is_cuda and qkv.dtype in DTYPES and pool_ok
            and qkv.stride(-1) == 1 and k_pool.is_contiguous() and head_dim >= 16 and not head_dim & (head_dim - 1))


def rope_and_write(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, n_heads: int,
                   n_kv_heads: int) -> torch.Tensor:
    """See the module doc. qkv [B, (n_heads + 2 n_kv_heads) * hd]; positions, slots [B] int64; cos, sin
    [max_seq_len, hd] in qkv's dtype; pools [num_blocks, block_size, n_kv_heads, hd] -> q [B, n_heads, hd]."""
    return _launch(qkv, positions, slots, cos, sin, k_pool, v_pool, n_heads, n_kv_heads, keys_out=False)[0]


def rope_write_keys(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, n_heads: int,
                    n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_and_write`, also returning the rotated keys [B, n_kv_heads, hd] (a mixed step's prompts attend
    over their own)."""
    return _launch(qkv, positions, slots, cos, sin, k_pool, v_pool, n_heads, n_kv_heads, keys_out=True)


def _launch(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            k_pool: torch.Tensor, v_pool: torch.Tensor, n_heads: int, n_kv_heads: int, *,
            keys_out: bool, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    bsz = qkv.shape[0]
    head_dim = k_pool.shape[-1]
    q = qkv.new_empty(bsz, n_heads, head_dim)
    k = qkv.new_empty(bsz if keys_out else 1, n_kv_heads, head_dim)
    _rope_write_kernel[(bsz,)](
        qkv, positions, slots, cos, sin, q, k, k_pool, v_pool, qkv.stride(0), cos.stride(0), q.stride(0),
        k.stride(0), n_kv_heads * head_dim, N_HEADS=n_heads, N_KV=n_kv_heads, H_PAD=triton.next_power_of_2(n_heads),
        KV_PAD=triton.next_power_of_2(n_kv_heads), HALF=head_dim // 2, KEYS_OUT=keys_out, GDC=gdc(pdl), num_warps=4,
        **launch_options(pdl))
    return q, k


def rotate_and_write(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache: PagedKVCache, layer: int, n_heads: int, n_kv_heads: int, *,
                     keys: bool, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A paged step's rotations and K/V write for `layer`: the kernel where it `fits` (launched with
    programmatic dependent launch when `pdl`), else the torch ops (`model._rope_1`, `PagedKVCache.write`) ->
    (q [T, n_heads, hd], the rotated keys [T, n_kv_heads, hd] when `keys`, else None)."""
    head_dim = cache.k[layer].shape[-1]
    if fits(qkv, cache.k[layer], head_dim):
        q, k = _launch(qkv, positions, slots, cos, sin, cache.k[layer], cache.v[layer], n_heads, n_kv_heads,
                       keys_out=keys, pdl=pdl)
        return q, k if keys else None
    total, q_size, kv_size = qkv.shape[0], n_heads * head_dim, n_kv_heads * head_dim
    c, s = cos[positions], sin[positions]  # [T, hd]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = _rope_1(q.view(total, n_heads, head_dim), c, s)
    k = _rope_1(k.view(total, n_kv_heads, head_dim), c, s)
    cache.write(layer, slots, k, v.view(total, n_kv_heads, head_dim))
    return q, k if keys else None
