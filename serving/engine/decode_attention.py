"""Fused decode attention (flash-decoding, split-K) for the decode step, in Triton, with a torch fallback.

`decode_attention(q, k_cache, v_cache, lengths, kv_len, scale)` computes, for every cache row b, kv head h
and query head g of the group, `softmax(q k^T * scale) v` over cache positions `[0, lengths[b])`, the
softmax in float32.

Layout:
- q: `[B, Hkv, G, hd]`, one query token per row, the G = n_heads // n_kv_heads query heads that share
  kv head h next to each other (that is `q.view(B, n_kv_heads, G, hd)` of the `[B, n_heads, hd]` query).
- k_cache, v_cache: `[maxB, Hkv, S, hd]`, the layer's whole static cache; only rows `< B` are read.
- lengths: `[B]` int64 on the device, the visible positions of each row (`input_pos + 1`).
- kv_len: a static bound on lengths (the decode graph's KV bucket); it only sizes the split-K grid.
- returns `[B, Hkv, G, hd]` in q.dtype.

On CUDA (when Triton and `torch.library.triton_op`, torch >= 2.6, are importable) two Triton kernels
run. The split kernel has one program per (row b, kv head h, split s): it loads the G query heads of
h once (padded to 16 rows for `tl.dot`), walks its chunk of positions `[s * chunk, (s + 1) * chunk)`
clipped to `lengths[b]` in blocks of `block_n(hd)` positions with an online softmax in float32, and
writes a partial (the chunk's normalised output and its log-sum-exp, base 2), or, when it is the only
split (B * Hkv alone fills the GPU: batch 64 of Llama's 8 KV heads), the output itself, and the
combine kernel is not launched. K/V are read only up
to `lengths[b]`, never the rest of the bucket; a split that starts past `lengths[b]` writes the
neutral partial (lse = -inf), which the combine kernel (one program per (b, h)) gives weight zero.
The number of splits (about 512 programs in all, at most 16 splits; tuned on an H200) depends only
on (B, Hkv, kv_len) and head_dim, through guard-free integer arithmetic; the one guard is whether
there is a single split, so a `torch.compile(dynamic=True)` step compiles twice at most (the buckets
with one split, those with more), and each CUDA graph captures a fixed grid. A fixed batch of 1 with a
short bucket (`one_block`) reads the whole bucket as one block, in one split of 8 warps. The op is registered as
`torch.ops.enginewright.decode_attention` (a `triton_op`), so it traces under `torch.compile(fullgraph=True)` and launches inside CUDA-graph capture (no host sync).

`decode_attention_rope(qkv, rope_cos, rope_sin, k_cache, v_cache, lengths, kv_len, scale)` runs the same
kernels on the step's qkv projection before the rotary embedding (or its split-K partial products,
which the kernel sums): the split holding position `lengths[b] - 1` rotates the new k, writes k and v
there, and folds that position in from registers; every program rotates q. Registered as
`torch.ops.enginewright.decode_attention_rope`, mutating the caches (CUDA only; the decode step runs the
separate rotary and cache-write ops elsewhere).

Elsewhere (CPU, no Triton) `decode_attention_reference` runs: the masked matmul of
`model.decode_step`, which reads the whole `[0, kv_len)` bucket.

The kernels were developed and checked with TRITON_INTERPRET=1 on CPU tensors against the reference
(tests/test_decode_attention.py); every change must also be checked on the GPU: the `gpu` tests
there, and `bench_decode_attention` (PYTHONPATH=. python tests/test_decode_attention.py) for timings.

Imports: stdlib and torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import math

import torch

from serving.engine.cuda_timing import graph_time_us

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op

    from serving.engine.pdl import gdc, gdc_enter, kernel_for, launch_options
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

# Split-K grid, tuned on an H200 (132 SMs) with bf16 Llama-1B/8B shapes: about four waves of programs
# (B * Hkv * splits) while B is small, but at most 16 splits: beyond that the per-split fixed cost
# (loading q, writing and combining the partial) outweighs the parallelism (64 splits of 64 positions
# took 2x the time of 16 of 256 at batch 1, kv 4096).
TARGET_PROGRAMS = 512
MAX_SPLITS = 16
MIN_GROUP_ROWS = 16  # tl.dot needs M >= 16: the G query heads are padded to this many rows
MIN_BLOCK = 16  # tl.dot needs K >= 16: the positions of a block
ONE_BLOCK_ELEMENTS = 16384  # a batch-1 KV bucket this small (positions x head_dim) is read as one block
# The split kernel's tuning knobs (`_launch`'s keywords) that the registered ops launch with; empty: the
# shipped ones. Read when a step compiles or captures; `bench profile`'s `+kv...` parts set it for an A/B.
STEP_KNOBS: dict[str, int] = {}


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """Pure-torch decode attention (same signature and semantics as `decode_attention`).

    Reads the whole `[0, kv_len)` bucket and masks positions `>= lengths[b]` out of the scores, so
    keys there may hold anything; values there must be finite (they are multiplied by 0).
    """
    bsz = q.shape[0]
    keys = k_cache[:bsz, :, :kv_len]  # [B, Hkv, L, hd]
    values = v_cache[:bsz, :, :kv_len]
    visible = torch.arange(kv_len, device=q.device) < lengths.unsqueeze(1)  # [B, L]
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~visible.view(bsz, 1, 1, kv_len), float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values).to(q.dtype)


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"decode_attention needs a power-of-two head_dim >= 16, got {head_dim}")


def rope_group(qkv_width: int, n_kv_heads: int, head_dim: int) -> int:
    """Query heads per KV head in a qkv row of `qkv_width` = (G + 2) x n_kv_heads x head_dim."""
    return qkv_width // head_dim // n_kv_heads - 2


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def block_n(head_dim: int) -> int:
    """Positions per step of a split's loop: K/V tiles of 8192 elements (measured best on the H200)."""
    return max(MIN_BLOCK, 8192 // head_dim)


def one_block(bsz: int | torch.SymInt, kv_len: int | torch.SymInt, head_dim: int) -> bool:
    """Whether a batch-1 step reads its whole KV bucket as one block, in one split of 8 warps, with no
    combine kernel. On an H200 the Llama-1B batch-1 step (256 positions of 64) took 0.848-0.854 ms so,
    against 0.878-0.912 ms with two splits (`bench profile`, `+kvt8+kvb256+kvw8`, two runs); at batch 64
    the same knobs were slower. Llama-8B (128 positions of 128) takes the same path, not timed apart.
    `bsz` and `kv_len` are plain ints only where they are fixed (a static compile, the PDL op's eager
    body), so a dynamic compile adds no guard."""
    fixed = isinstance(bsz, int) and isinstance(kv_len, int)
    return fixed and bsz == 1 and kv_len * head_dim <= ONE_BLOCK_ELEMENTS


def split_plan(bsz: int, n_kv_heads: int, kv_len: int, block: int, target_programs: int = TARGET_PROGRAMS,
               max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(num_splits, chunk): the split-K grid of a (batch, kv heads, KV bucket) shape.

    `chunk` (positions per split) is a multiple of `block` and `num_splits * chunk >= kv_len`. Written
    with floor divisions and `torch.sym_min` only, so symbolic sizes under torch.compile add no guards.
    """
    wanted = torch.sym_min(_cdiv(kv_len, block), _cdiv(target_programs, bsz * n_kv_heads))
    wanted = torch.sym_min(wanted, max_splits)
    chunk = _cdiv(_cdiv(kv_len, wanted), block) * block
    return _cdiv(kv_len, chunk), chunk


if triton is not None:

    @triton.jit
    def _load_summed(ptrs, mask, stride_part, PARTS: tl.constexpr, DTYPE: tl.constexpr):
        """The sum of PARTS split-K partial products at ptrs, rounded to DTYPE once (as the unfused step
        rounds its qkv), in float32."""
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        for i in tl.static_range(1, PARTS):
            x += tl.load(ptrs + i * stride_part, mask=mask, other=0.0).to(tl.float32)
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _rotated(rows, offs_d, mask, cos, sin, stride_part, PARTS: tl.constexpr, DTYPE: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
        """The head vectors at rows + offs_d after the rotary embedding ("rotate half"), in float32."""
        half: tl.constexpr = HEAD_DIM // 2
        x = _load_summed(rows + offs_d, mask, stride_part, PARTS, DTYPE)
        partner = _load_summed(rows + (offs_d + half) % HEAD_DIM, mask, stride_part, PARTS, DTYPE)
        return x * cos + tl.where(offs_d < half, -1.0, 1.0) * partner * sin

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, o_part_ptr, lse_part_ptr, cos_ptr, sin_ptr,
                      stride_qb, stride_qh, stride_qg, stride_kb, stride_kh, stride_ks,
                      stride_vb, stride_vh, stride_vs, stride_rope, stride_part, chunk, qk_scale,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK: tl.constexpr, IEEE_DOT: tl.constexpr, FINAL: tl.constexpr, ROPE: tl.constexpr,
                      PARTS: tl.constexpr, GDC: tl.constexpr):
        if GDC:
            gdc_enter()
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        s = tl.program_id(2)
        n_heads = tl.num_programs(1)
        n_splits = tl.num_programs(2)
        qk_scale = tl.cast(qk_scale, tl.float32)  # inductor passes python floats as fp64
        length = tl.load(len_ptr + b).to(tl.int32)
        start = s * chunk
        end = tl.minimum(start + chunk, length)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK)
        g_mask = offs_g < GROUP
        q_rows = q_ptr + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg  # [GROUP_PAD, 1]
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        dtype = k_ptr.dtype.element_ty
        if ROPE:  # q_ptr: the step's qkv [PARTS, B, (H + 2 Hkv) hd] before the rotary embedding, summed here
            new_pos = length - 1  # the step's own token: rotated here, written to the cache here
            cos = tl.load(cos_ptr + new_pos * stride_rope + offs_d).to(tl.float32)
            sin = tl.load(sin_ptr + new_pos * stride_rope + offs_d).to(tl.float32)
            q = _rotated(q_rows, offs_d[None, :], g_mask[:, None], cos[None, :], sin[None, :], stride_part, PARTS,
                         dtype, HEAD_DIM)
            q = q.to(dtype)  # rounded as the unfused step rounds its rotated q
            end_cached = tl.minimum(end, new_pos)  # positions before the new one come from the cache
        else:
            q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
            end_cached = end

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max, log2 units
        l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(start, end_cached, BLOCK):
            pos = n0 + offs_n
            n_mask = pos < end_cached
            k = tl.load(k_base + pos[None, :] * stride_ks + offs_d[:, None], mask=n_mask[None, :], other=0.0)
            if IEEE_DOT:
                qk = tl.dot(q, k, input_precision="ieee")
            else:
                qk = tl.dot(q, k)
            qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))  # [GROUP_PAD, BLOCK]
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + pos[:, None] * stride_vs + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            if IEEE_DOT:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if ROPE:  # noqa: SIM102 - a compile-time branch around a run-time one (Triton)
            if (new_pos >= start) & (new_pos < start + chunk):  # this split holds the new position
                new_k = q_ptr + b * stride_qb + n_heads * GROUP * HEAD_DIM + h * HEAD_DIM  # after the H q heads
                full = offs_d < HEAD_DIM
                k_new = _rotated(new_k, offs_d, full, cos, sin, stride_part, PARTS, dtype, HEAD_DIM).to(dtype)
                v_new = _load_summed(new_k + n_heads * HEAD_DIM + offs_d, full, stride_part, PARTS, dtype).to(dtype)
                tl.store(k_base + new_pos * stride_ks + offs_d, k_new)
                tl.store(v_base + new_pos * stride_vs + offs_d, v_new)
                qk = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale  # [GROUP_PAD]
                m_new = tl.maximum(m_i, qk)
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new)
                l_i = l_i * alpha + p
                acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new

        if FINAL:  # the only split (lengths >= 1, so l_i > 0): the output itself, no partial
            out = acc / l_i[:, None]
            dst = o_part_ptr + ((b * n_heads + h) * GROUP + offs_g[:, None]) * HEAD_DIM + offs_d[None, :]
            tl.store(dst, out.to(o_part_ptr.dtype.element_ty), mask=g_mask[:, None])
            return
        # an empty split (start >= lengths[b]) leaves l_i = 0: write o = 0, lse = -inf
        filled = l_i > 0.0
        o = acc / tl.where(filled, l_i, 1.0)[:, None]
        lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
        row = ((b * n_heads + h) * n_splits + s) * GROUP + offs_g  # partial rows of [B, Hkv, NS, G]
        tl.store(lse_part_ptr + row, lse, mask=g_mask)
        tl.store(o_part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_mask[:, None])

    @triton.jit
    def _combine_kernel(o_part_ptr, lse_part_ptr, out_ptr, n_splits,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, GDC: tl.constexpr):
        if GDC:
            gdc_enter()
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        n_heads = tl.num_programs(1)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        g_mask = offs_g < GROUP

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        den = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        first = (b * n_heads + h) * n_splits * GROUP
        for s in range(n_splits):
            row = first + s * GROUP + offs_g
            lse = tl.load(lse_part_ptr + row, mask=g_mask, other=float("-inf"))
            o = tl.load(o_part_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=g_mask[:, None],
                        other=0.0)
            m_new = tl.maximum(m, lse)
            # while every split so far is empty m_new is -inf: shift by 0 so the weights are 0, not NaN
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - shift)
            w = tl.exp2(lse - shift)
            den = den * alpha + w
            acc = acc * alpha[:, None] + o * w[:, None]
            m = m_new
        out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
        dst = out_ptr + ((b * n_heads + h) * GROUP + offs_g[:, None]) * HEAD_DIM + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])

    def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                kv_len: int, scale: float, *, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                block: int | None = None, num_warps: int = 4, num_stages: int = 2,
                target_programs: int = TARGET_PROGRAMS, max_splits: int = MAX_SPLITS, pdl: bool = False
                ) -> torch.Tensor:
        """The two kernels. q is [B, Hkv, G, hd]; or, with `rope` (the cos and sin tables [S, hd]), the
        step's qkv [B, (H + 2 Hkv) hd] (or its split-K partial products [P, B, (H + 2 Hkv) hd]) before the
        rotary embedding, whose K/V the kernel rotates and writes into the caches at position
        lengths[b] - 1. `pdl`: launched with programmatic dependent launch (`serving.engine.pdl`). The
        other keyword arguments are the tuning knobs (`sweep_decode_attention`)."""
        n_kv_heads, head_dim = int(k_cache.shape[1]), int(k_cache.shape[3])
        if rope is None:
            group = int(q.shape[2])
            q = q.contiguous().view(1, q.shape[0], -1)  # one part of B rows, as the qkv layout below
        else:
            if q.dim() == 2:
                q = q.unsqueeze(0)
            group = rope_group(q.shape[2], n_kv_heads, head_dim)
            if q.shape[2] != (group + 2) * n_kv_heads * head_dim or rope[0].shape[-1] != head_dim:
                raise ValueError(f"qkv {tuple(q.shape)} does not hold (G + 2) x {n_kv_heads} heads of {head_dim}, "
                                 f"or the rotary tables {tuple(rope[0].shape)} are not [S, {head_dim}]")
        parts, bsz = int(q.shape[0]), q.shape[1]  # q: [P, B, row] from here on
        check_head_dim(head_dim)
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("decode_attention needs caches contiguous in head_dim")
        if k_cache.dtype != v_cache.dtype or (k_cache.dtype != q.dtype and (rope is None or q.dtype != torch.float32)):
            raise ValueError(f"decode_attention needs q and the caches in one dtype, got {q.dtype}, "
                             f"{k_cache.dtype}, {v_cache.dtype}")
        q = q.contiguous()
        cos, sin = (c.contiguous() for c in rope) if rope is not None else (q, q)  # (unused without rope)
        group_pad = max(MIN_GROUP_ROWS, triton.next_power_of_2(group))
        if block is None and one_block(bsz, kv_len, head_dim):
            block, max_splits, num_warps = max(MIN_BLOCK, triton.next_power_of_2(kv_len)), 1, 8
        block = block or block_n(head_dim)
        n_splits, chunk = split_plan(bsz, n_kv_heads, kv_len, block, target_programs, max_splits)
        out = torch.empty((bsz, n_kv_heads, group, head_dim), dtype=k_cache.dtype, device=q.device)
        single = n_splits == 1  # one split per (row, head) fills the GPU: it writes the output, no combine
        # flat partials of shape [B, Hkv, n_splits, G(, hd)]: flat, so a symbolic n_splits adds no guard.
        # With a single split the unused log-sum-exp argument still gets a tensor of its own: torch.compile
        # functionalises a kernel's tensor arguments one by one and does not handle two that alias (a TODO
        # in torch/_higher_order_ops/triton_kernel_wrap.py); `out` passed twice came back unwritten
        rows = 1 if single else bsz * n_kv_heads * n_splits * group
        lse_part = torch.empty(rows, dtype=torch.float32, device=q.device)
        o_part = out if single else torch.empty(rows * head_dim, dtype=torch.float32, device=q.device)
        kernel_for(_split_kernel, pdl)[(bsz, n_kv_heads, n_splits)](
            q, k_cache, v_cache, lengths, o_part, lse_part, cos, sin,
            q.stride(1), group * head_dim, head_dim,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), cos.stride(0), q.stride(0), chunk, scale * math.log2(math.e),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK=block,
            IEEE_DOT=k_cache.dtype == torch.float32, FINAL=single, ROPE=rope is not None, PARTS=parts, GDC=gdc(pdl),
            num_warps=num_warps, num_stages=num_stages, **launch_options(pdl),
        )
        if not single:
            kernel_for(_combine_kernel, pdl)[(bsz, n_kv_heads)](
                o_part, lse_part, out, n_splits, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, GDC=gdc(pdl),
                num_warps=4, **launch_options(pdl),
            )
        return out

    @triton_op("enginewright::decode_attention", mutates_args=())
    def _decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             lengths: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
        return _launch(q, k_cache, v_cache, lengths, kv_len, scale, **STEP_KNOBS)

    @triton_op("enginewright::decode_attention_rope", mutates_args=("k_cache", "v_cache"))
    def _decode_attention_rope_op(qkv: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                                  k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                                  kv_len: int, scale: float) -> torch.Tensor:
        return _launch(qkv, k_cache, v_cache, lengths, kv_len, scale, rope=(rope_cos, rope_sin), **STEP_KNOBS)

    # the PDL variant: opaque to inductor, which would launch the kernels without the attribute
    # (`serving.engine.pdl`)
    @torch.library.custom_op("enginewright::decode_attention_rope_pdl", mutates_args=("k_cache", "v_cache"))
    def _decode_attention_rope_pdl_op(qkv: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                                      k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                                      kv_len: int, scale: float) -> torch.Tensor:
        return _launch(qkv, k_cache, v_cache, lengths, kv_len, scale, rope=(rope_cos, rope_sin), pdl=True,
                       **STEP_KNOBS)

    @_decode_attention_rope_pdl_op.register_fake
    def _(qkv: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, k_cache: torch.Tensor,
          v_cache: torch.Tensor, lengths: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
        n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
        group = rope_group(qkv.shape[-1], n_kv_heads, head_dim)
        return k_cache.new_empty((qkv.shape[-2], n_kv_heads, group, head_dim))


def triton_available() -> bool:
    """Whether the Triton kernels (and the `enginewright::decode_attention` op) are registered."""
    return triton is not None


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            lengths: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """The Triton path through the registered op, on any device Triton can run on (CUDA; CPU tensors
    under TRITON_INTERPRET=1)."""
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the Triton decode attention")
    check_head_dim(q.shape[-1])
    return torch.ops.enginewright.decode_attention(q, k_cache, v_cache, lengths, kv_len, scale)


def decode_attention_rope(qkv: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, kv_len: int,
                          scale: float, *, pdl: bool = False) -> torch.Tensor:
    """The decode step's rotary embedding, K/V cache write and attention in one kernel (two with the
    combine), where the unfused step runs four small kernels before `decode_attention`.

    qkv: [B, (H + 2 Hkv) hd], the step's q, k, v projections (bias added, no rotary yet), or their split-K
    partial products [P, B, (H + 2 Hkv) hd] (float32), which the kernel sums;
    rope_cos, rope_sin: [S, hd] tables indexed by position; row b's token is at position lengths[b] - 1:
    its k (rotated) and v are written into k_cache/v_cache [maxB, Hkv, S, hd] there, and its rotated q
    attends over positions [0, lengths[b]) -> [B, Hkv, G, hd]. Triton only (CUDA; CPU tensors under
    TRITON_INTERPRET=1); `model.decode_step` runs the unfused ops elsewhere. `pdl`: the kernels launched
    with programmatic dependent launch (CUDA, Hopper and later; `serving.engine.pdl`).
    """
    if triton is None:
        raise RuntimeError("Triton (and torch >= 2.6) is needed for the Triton decode attention")
    op = torch.ops.enginewright.decode_attention_rope_pdl if pdl else torch.ops.enginewright.decode_attention_rope
    return op(qkv, rope_cos, rope_sin, k_cache, v_cache, lengths, kv_len, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     kv_len: int, scale: float) -> torch.Tensor:
    """q: [B, Hkv, G, hd] (one query token per row, G = n_heads // n_kv_heads query heads per KV head);
    k_cache, v_cache: [maxB, Hkv, S, hd] (the layer's static cache, contiguous, rows >= B untouched);
    lengths: [B] int64 on the device = number of visible cache positions of row b (input_pos[b] + 1,
    always >= 1 and <= kv_len); kv_len: static upper bound of lengths (<= S), used only to size the
    split-K grid; -> [B, Hkv, G, hd] in q.dtype. Equals softmax(q k^T * scale over positions [0, lengths[b])) v,
    softmax in float32."""
    if q.device.type == "cuda" and triton is not None:
        return decode_attention_triton(q, k_cache, v_cache, lengths, kv_len, scale)
    return decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, scale)


# ---------------------------------------------------------------------------------------------
# benchmark (on the GPU: PYTHONPATH=. python tests/test_decode_attention.py). Not a `python -m` entry
# point: running this file as __main__ next to an import of it would register the op twice.


def bench_decode_attention(length: int = 192, kv_len: int = 256, max_seq: int = 1024) -> None:
    """Print µs per call and GB/s of K/V read, Triton vs reference, Llama-3.2-1B and 3.1-8B shapes."""
    shapes = {"llama-1B": (8, 4, 64), "llama-8B": (8, 4, 128)}
    dtype = torch.bfloat16
    for name, (n_kv_heads, group, head_dim) in shapes.items():
        for bsz in (1, 64):
            q = torch.randn(bsz, n_kv_heads, group, head_dim, device="cuda", dtype=dtype)
            k_cache = torch.randn(bsz, n_kv_heads, max(max_seq, kv_len), head_dim, device="cuda", dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            lengths = torch.full((bsz,), length, device="cuda", dtype=torch.int64)
            scale = head_dim ** -0.5
            row_bytes = 2 * bsz * n_kv_heads * head_dim * k_cache.element_size()  # K and V of one position
            paths = {"triton": (decode_attention_triton, length),
                     "reference": (decode_attention_reference, kv_len)}
            for path, (fn, positions) in paths.items():
                if path == "triton" and triton is None:
                    continue
                us = graph_time_us(fn, q, k_cache, v_cache, lengths, kv_len, scale)
                gbs = row_bytes * positions / (us * 1e-6) / 1e9
                print(f"{name} B={bsz:<3} length={length} kv_len={kv_len} {path:<9}: {us:8.2f} us/call "
                      f"{gbs:8.1f} GB/s of K/V read ({positions} positions)")


def sweep_decode_attention(layers: int = 1) -> None:
    """Print µs per call of the split kernel's tuning knobs (block, warps, stages, target programs) at the
    Llama-1B/8B decode shapes, batch 1 and 64, 192 and 2000 filled positions; the first row of each shape
    is the shipped setting. `layers` > 1 cycles through that many caches, as a step does through its
    layers, so that K/V come from memory rather than a warm L2 (H200: 50 MB)."""
    if triton is None:
        raise RuntimeError("the sweep needs Triton on CUDA")
    shapes = {"llama-1B": (8, 4, 64), "llama-8B": (8, 4, 128)}
    knobs = [{}] + [{"block": b, "num_warps": w, "num_stages": st, "target_programs": t}
                    for b in (32, 64, 128) for w in (4, 8) for st in (2, 3) for t in (512, 1024)]
    for name, (n_kv_heads, group, head_dim) in shapes.items():
        for bsz, length, kv_len in ((1, 192, 256), (64, 192, 256), (64, 2000, 2048)):
            q = torch.randn(bsz, n_kv_heads, group, head_dim, device="cuda", dtype=torch.bfloat16)
            caches = [(torch.randn(bsz, n_kv_heads, kv_len, head_dim, device="cuda", dtype=torch.bfloat16),
                       torch.randn(bsz, n_kv_heads, kv_len, head_dim, device="cuda", dtype=torch.bfloat16))
                      for _ in range(layers)]
            lengths = torch.full((bsz,), length, device="cuda", dtype=torch.int64)
            kv_bytes = 2 * bsz * n_kv_heads * head_dim * 2 * length
            results = []
            for knob in knobs:
                if knob.get("block", 0) * head_dim > 16384:
                    continue
                us = graph_time_us(_every_layer, q, caches, lengths, kv_len, head_dim ** -0.5, knob,
                                   calls=max(1, 50 // layers))
                results.append((us / layers, knob))
            shipped = results[0][0]
            best = sorted(results, key=lambda r: r[0])[:3]
            print(f"{name} B={bsz} length={length} layers={layers}: shipped {shipped:.2f} us "
                  f"({kv_bytes / shipped / 1e3:.0f} GB/s); "
                  + "; ".join(f"{us:.2f} us {knob}" for us, knob in best), flush=True)


def _every_layer(q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor,
                 kv_len: int, scale: float, knob: dict[str, int]) -> None:
    for k_cache, v_cache in caches:
        _launch(q, k_cache, v_cache, lengths, kv_len, scale, **knob)
