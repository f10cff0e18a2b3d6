"""Decode attention through block tables: one query token per sequence over its paged K/V, in place.

`paged_decode_attention(q, k_pool, v_pool, tables, lengths, scale)` computes, for every sequence b, kv head
h and query head g of its group, `softmax(q k^T * scale) v` over positions `[0, lengths[b])`, where position
p of sequence b lives in block `tables[b, p // block_size]` at offset `p % block_size`; softmax in float32.
With a sliding `window` only the last `window` of those positions (`[lengths[b] - window, lengths[b])`): the
kernel starts at the tile holding the first of them, so blocks wholly out of the window are never read.

Layout:
- q: `[B, Hkv, G, hd]` (the G = n_heads // n_kv_heads query heads sharing kv head h next to each other);
- k_pool, v_pool: `[num_blocks, block_size, Hkv, hd]`, one layer's pools (`kv_cache.PagedKVCache`), in
  q's dtype or float8_e4m3fn (an fp8 KV cache, scale 1.0: read as `value.to(q.dtype)`);
- tables: `[B, n]` int64, each row's blocks in position order, padded with any valid block id;
- lengths: `[B]` int64, the visible positions of each row (>= 1, <= n * block_size);
- returns `[B, Hkv, G, hd]` in q.dtype.

On CUDA (Triton importable) one kernel runs with one program per (sequence, kv head): it loads the G query
heads once (padded to 16 rows for `tl.dot`) and walks the sequence's blocks through its table row, one block
of positions per iteration, with an online softmax in float32 (base 2); K/V are read where they lie, never
copied. fp8 pools are converted in registers after the load (the pointer's element type says which; bf16 pools
load as before): with bf16 queries to float16, q clamped to float16's range (`fp8_kv_dot_f16`, the default:
e4m3 widens to float16 in one instruction a pair, to bf16 through several), else to q's dtype, so `tl.dot`
multiplies one dtype on both sides, accumulating in float32. A program over an e4m3 pool runs on one warp
(`fp8_num_warps`: its scores and softmax never cross warps) where the batch fills the GPU, else on four, as over
a bf16 pool. The kernel's launch choices are `options.AttentionKernelOptions`, passed by the caller. When the batch leaves the GPU short of programs (fewer than about two per SM:
batch 1 x 8 KV heads runs 8), each (sequence, kv head)'s blocks are split over `position_splits` programs
(flash-decoding, as `decode_attention.py` does for the static cache): each writes its softmax-weighted values
and log-sum-exp in float32, and a second kernel combines them. The split is by each row's own length, read on the device, so a
CUDA graph captured at one batch size serves every context length. An iteration walks one block, its table
entry loaded an iteration ahead and V issued with K (`prefetch_blocks`, the default: one memory round trip a
block instead of three in a row), or a tile of several blocks (`tile_positions`), each position through its own
table entry (docs/decisions.md). The kernel
needs a power-of-two block_size >= 16 and head_dim >= 16; elsewhere, and on the CPU, `paged_decode_reference`
runs: each row's blocks gathered into `[B, Hkv, n * block_size, hd]` (cast to q's dtype) and the masked matmul
of `model.decode_step`.

Checked with TRITON_INTERPRET=1 on CPU tensors against the reference (tests/test_paged_attention.py).

Imports: stdlib and torch; Triton only if importable.
"""

from __future__ import annotations

import torch

from serving.engine.kv_cache import KV_FP8_DTYPE
from serving.engine.options import AttentionKernelOptions
from serving.engine.pdl import gdc, launch_options

try:
    import triton
    import triton.language as tl

    from serving.engine.pdl import gdc_enter

    _F16_MAX = tl.constexpr(65504.0)
except ImportError:  # CPU-only installs
    triton = None

MIN_ROWS = 16  # tl.dot needs M, K >= 16: query heads are padded to this many rows, blocks must be this long
MAX_SPLITS = 16  # programs over one (sequence, kv head)'s positions at most

def paged_decode_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Pure torch (same signature and semantics as `paged_decode_attention`): gathers, then masks (positions
    past each row's length, and with a `window` those before its last `window`)."""
    bsz, n = tables.shape
    block_size = k_pool.shape[1]
    width = n * block_size
    keys = k_pool[tables].reshape(bsz, width, *k_pool.shape[2:]).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, hd]
    values = v_pool[tables].reshape(bsz, width, *v_pool.shape[2:]).transpose(1, 2).to(q.dtype)
    pos = torch.arange(width, device=q.device).unsqueeze(0)
    visible = pos < lengths.unsqueeze(1)  # [B, L]
    if window is not None:
        visible &= pos >= lengths.unsqueeze(1) - window
    neg = torch.zeros(visible.shape, dtype=torch.float32, device=q.device).masked_fill(
        ~visible, float("-inf")).view(bsz, 1, 1, width)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale + neg  # [B, Hkv, G, L]
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values).to(q.dtype)


def kernel_fits(block_size: int, head_dim: int) -> bool:
    """Whether the Triton kernel takes these shapes (powers of two, >= 16)."""
    def pow2(x: int) -> bool:
        return x >= MIN_ROWS and not x & (x - 1)

    return triton is not None and pow2(block_size) and pow2(head_dim)


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, o_ptr, part_ptr, lse_ptr,
                             stride_qb, stride_qh, stride_qg, stride_kblk, stride_kpos, stride_kh,
                             stride_vblk, stride_vpos, stride_vh, stride_tb, qk_scale, window,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
                             IEEE_DOT: tl.constexpr, GDC: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                             DOT_F16: tl.constexpr = False):
        if GDC:
            gdc_enter()
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        n_heads = tl.num_programs(1)
        qk_scale = tl.cast(qk_scale, tl.float32)
        length = tl.load(len_ptr + b).to(tl.int32)
        lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # the first visible position
        n_tiles = tl.cdiv(length, TILE)
        first_tile = lo // TILE  # tiles wholly before the window are never read
        per_split = tl.cdiv(n_tiles - first_tile, SPLITS)
        first = first_tile + split * per_split
        last = tl.minimum(first + per_split, n_tiles)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, TILE)
        g_mask = offs_g < GROUP
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :],
                    mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
        if DOT_F16:  # K, V and the probabilities follow q's dtype below
            q = tl.minimum(tl.maximum(q.to(tl.float32), -_F16_MAX), _F16_MAX).to(tl.float16)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        if PREFETCH:  # the first block's table entry; each iteration loads the next one's
            ahead = tl.load(table_ptr + b * stride_tb + first, mask=first < last, other=0).to(tl.int64)
        for i in range(first, last):
            pos = i * TILE + offs_n
            n_mask = (pos < length) & (pos >= lo)
            if TILE == BLOCK_SIZE:  # one block: one table entry
                if PREFETCH:
                    block = ahead
                    ahead = tl.load(table_ptr + b * stride_tb + i + 1, mask=i + 1 < last, other=0).to(tl.int64)
                else:
                    block = tl.load(table_ptr + b * stride_tb + i).to(tl.int64)
                k_rows = block * stride_kblk + offs_n * stride_kpos
                v_rows = block * stride_vblk + offs_n * stride_vpos
            else:  # each position's own block
                blocks = tl.load(table_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
                k_rows = blocks * stride_kblk + (pos % BLOCK_SIZE) * stride_kpos
                v_rows = blocks * stride_vblk + (pos % BLOCK_SIZE) * stride_vpos
            k = tl.load(k_ptr + k_rows[None, :] + h * stride_kh + offs_d[:, None],
                        mask=n_mask[None, :], other=0.0).to(q.dtype)  # [HEAD_DIM, TILE]; fp8 pools converted
            if PREFETCH:  # V issued with K
                v = tl.load(v_ptr + v_rows[:, None] + h * stride_vh + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            if IEEE_DOT:
                qk = tl.dot(q, k, input_precision="ieee")
            else:
                qk = tl.dot(q, k)
            qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))  # [GROUP_PAD, TILE]
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if not PREFETCH:
                v = tl.load(v_ptr + v_rows[:, None] + h * stride_vh + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            v = v.to(q.dtype)  # [TILE, HEAD_DIM]
            if IEEE_DOT:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if SPLITS == 1:
            out = acc / l_i[:, None]
            dst = o_ptr + ((b * n_heads + h) * GROUP + offs_g[:, None]) * HEAD_DIM + offs_d[None, :]
            tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:  # this split's softmax-weighted values and log2-sum-exp; an empty split: zeros and -inf
            row = (b * n_heads + h) * SPLITS + split
            seen = l_i > 0
            part = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
            tl.store(part_ptr + (row * GROUP_PAD + offs_g[:, None]) * HEAD_DIM + offs_d[None, :], part)
            tl.store(lse_ptr + row * GROUP_PAD + offs_g, tl.where(seen, m_i + tl.log2(l_i), float("-inf")))

    @triton.jit
    def _combine_splits_kernel(part_ptr, lse_ptr, o_ptr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                               HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, GDC: tl.constexpr = False):
        if GDC:
            gdc_enter()
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        n_heads = tl.num_programs(1)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        first_row = (b * n_heads + h) * SPLITS
        top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        for s in range(SPLITS):
            top = tl.maximum(top, tl.load(lse_ptr + (first_row + s) * GROUP_PAD + offs_g))
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        for s in range(SPLITS):
            row = first_row + s
            w = tl.exp2(tl.load(lse_ptr + row * GROUP_PAD + offs_g) - top)  # 0 for an empty split
            acc += w[:, None] * tl.load(part_ptr + (row * GROUP_PAD + offs_g[:, None]) * HEAD_DIM + offs_d[None, :])
            total += w
        out = acc / total[:, None]
        dst = o_ptr + ((b * n_heads + h) * GROUP + offs_g[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None])


def position_splits(bsz: int, n_kv_heads: int, device: torch.device) -> int:
    """How many programs share each (sequence, kv head)'s positions: enough for about two per SM when the
    batch alone leaves the GPU short of programs (1 when it does not; MAX_SPLITS at most)."""
    programs = bsz * n_kv_heads
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1 if programs >= target else min(MAX_SPLITS, -(-target // programs))


def paged_decode_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                        lengths: torch.Tensor, scale: float, *, splits: int | None = None,
                        tile: int | None = None, pdl: bool = False, dot_f16: bool | None = None,
                        kernel: AttentionKernelOptions | None = None, window: int | None = None) -> torch.Tensor:
    """The Triton kernel on any device Triton runs on (CUDA; CPU tensors under TRITON_INTERPRET=1), its
    positions split `splits` ways (default `position_splits`), `tile` positions an iteration (default
    `kernel.tile_positions`, else one block); `pdl`: its kernels launched with programmatic dependent launch;
    `dot_f16`: the dots in float16 (default: `kernel.fp8_kv_dot_f16` for bf16 queries over an e4m3 pool);
    `kernel`: the launch's other choices (default `AttentionKernelOptions()`); `window`: a sliding window (each
    row sees its last `window` positions; the tiles before them are not read)."""
    kernel = kernel or AttentionKernelOptions()
    bsz, n_kv_heads, group, head_dim = q.shape
    block_size = int(k_pool.shape[1])
    tile = tile or kernel.tile_positions or block_size
    if tile < MIN_ROWS or tile & (tile - 1):
        raise ValueError(f"paged decode kernel: tile={tile} positions an iteration must be a power of two >= {MIN_ROWS}")
    if triton is None:
        raise RuntimeError("Triton is needed for the paged decode attention kernel")
    if not kernel_fits(block_size, head_dim):
        raise ValueError(f"paged decode kernel needs power-of-two block_size and head_dim >= {MIN_ROWS}, "
                         f"got block_size={block_size}, head_dim={head_dim}")
    q = q.contiguous()
    out = torch.empty_like(q)
    splits = position_splits(bsz, n_kv_heads, q.device) if splits is None else splits
    group_pad = max(MIN_ROWS, triton.next_power_of_2(group))
    part = lse = out  # unused with one split
    if dot_f16 is None:
        dot_f16 = kernel.fp8_kv_dot_f16 and q.dtype == torch.bfloat16 and k_pool.dtype == KV_FP8_DTYPE
    if splits > 1:
        part = torch.empty(bsz * n_kv_heads * splits, group_pad, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz * n_kv_heads * splits, group_pad, dtype=torch.float32, device=q.device)
    log2e = 1.4426950408889634
    _paged_decode_kernel[(bsz, n_kv_heads, splits)](
        q, k_pool, v_pool, tables, lengths, out, part, lse,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), tables.stride(0), scale * log2e, window or 0,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE=tile, SPLITS=splits,
        IEEE_DOT=q.dtype == torch.float32 and not dot_f16, GDC=gdc(pdl), DOT_F16=dot_f16,
        PREFETCH=kernel.prefetch_blocks and tile == block_size,
        num_warps=kernel.fp8_num_warps if k_pool.dtype == KV_FP8_DTYPE and splits == 1 else kernel.num_warps,
        **({} if kernel.num_stages is None else {"num_stages": kernel.num_stages}), **launch_options(pdl))
    if splits > 1:
        _combine_splits_kernel[(bsz, n_kv_heads)](part, lse, out, GROUP=group, GROUP_PAD=group_pad,
                                                  HEAD_DIM=head_dim, SPLITS=splits, GDC=gdc(pdl), num_warps=4,
                                                  **launch_options(pdl))
    return out


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float, *, pdl: bool = False,
                           kernel: AttentionKernelOptions | None = None, window: int | None = None) -> torch.Tensor:
    """See the module doc: the Triton kernel on CUDA where it fits (`pdl`: launched with programmatic
    dependent launch; `kernel`: its launch), the torch reference elsewhere. `window`: a sliding window (each row
    sees its last `window` positions: a query at position p the keys at (p - window, p])."""
    if q.device.type == "cuda" and kernel_fits(int(k_pool.shape[1]), int(q.shape[-1])):
        return paged_decode_triton(q, k_pool, v_pool, tables, lengths, scale, pdl=pdl, kernel=kernel, window=window)
    return paged_decode_reference(q, k_pool, v_pool, tables, lengths, scale, window)
