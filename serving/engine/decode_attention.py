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
with one split, those with more), and each CUDA graph captures a fixed grid. The op is registered as `torch.ops.enginewright.decode_attention` (a `triton_op`), so it
traces under `torch.compile(fullgraph=True)` and launches inside CUDA-graph capture (no host sync).

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
    from torch.library import triton_op, wrap_triton
except ImportError:  # no Triton (CPU-only installs) or torch < 2.6
    triton = None

# Split-K grid, tuned on an H200 (132 SMs) with bf16 Llama-1B/8B shapes: about four waves of programs
# (B * Hkv * splits) while B is small, but at most 16 splits: beyond that the per-split fixed cost
# (loading q, writing and combining the partial) outweighs the parallelism (64 splits of 64 positions
# took 2x the time of 16 of 256 at batch 1, kv 4096).
TARGET_PROGRAMS = 512
MAX_SPLITS = 16
MIN_GROUP_ROWS = 16  # tl.dot needs M >= 16: the G query heads are padded to this many rows


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


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def block_n(head_dim: int) -> int:
    """Positions per step of a split's loop: K/V tiles of 8192 elements (measured best on the H200)."""
    return max(16, 8192 // head_dim)


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
    def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, o_part_ptr, lse_part_ptr,
                      stride_qb, stride_qh, stride_qg, stride_kb, stride_kh, stride_ks,
                      stride_vb, stride_vh, stride_vs, chunk, qk_scale,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK: tl.constexpr, IEEE_DOT: tl.constexpr, FINAL: tl.constexpr):
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
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :],
                    mask=g_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max, log2 units
        l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK):
            pos = n0 + offs_n
            n_mask = pos < end
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
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
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
                kv_len: int, scale: float, *, block: int | None = None, num_warps: int = 4, num_stages: int = 2,
                target_programs: int = TARGET_PROGRAMS, max_splits: int = MAX_SPLITS) -> torch.Tensor:
        """The two kernels; the keyword arguments are the tuning knobs (`sweep_decode_attention`)."""
        bsz, n_kv_heads, group, head_dim = q.shape
        group, head_dim = int(group), int(head_dim)
        check_head_dim(head_dim)
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("decode_attention needs caches contiguous in head_dim")
        if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise ValueError(f"decode_attention needs q and the caches in one dtype, got {q.dtype}, "
                             f"{k_cache.dtype}, {v_cache.dtype}")
        q = q.contiguous()
        group_pad = max(MIN_GROUP_ROWS, triton.next_power_of_2(group))
        block = block or block_n(head_dim)
        n_splits, chunk = split_plan(bsz, n_kv_heads, kv_len, block, target_programs, max_splits)
        out = torch.empty((bsz, n_kv_heads, group, head_dim), dtype=q.dtype, device=q.device)
        if n_splits == 1:  # one split per (row, head) fills the GPU: it writes the output, no combine
            # a tensor of its own for the unused log-sum-exp argument: torch.compile functionalises a
            # kernel's tensor arguments one by one and does not handle two that alias (a TODO in
            # torch/_higher_order_ops/triton_kernel_wrap.py); `out` passed twice came back unwritten
            unused_lse = torch.empty(1, dtype=torch.float32, device=q.device)
            wrap_triton(_split_kernel)[(bsz, n_kv_heads, 1)](
                q, k_cache, v_cache, lengths, out, unused_lse,
                q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), chunk, scale * math.log2(math.e),
                GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK=block,
                IEEE_DOT=q.dtype == torch.float32, FINAL=True, num_warps=num_warps, num_stages=num_stages,
            )
            return out
        # flat partials of shape [B, Hkv, n_splits, G(, hd)]: flat, so a symbolic n_splits adds no guard
        rows = bsz * n_kv_heads * n_splits * group
        lse_part = torch.empty(rows, dtype=torch.float32, device=q.device)
        o_part = torch.empty(rows * head_dim, dtype=torch.float32, device=q.device)
        wrap_triton(_split_kernel)[(bsz, n_kv_heads, n_splits)](
            q, k_cache, v_cache, lengths, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), chunk, scale * math.log2(math.e),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK=block,
            IEEE_DOT=q.dtype == torch.float32, FINAL=False, num_warps=num_warps, num_stages=num_stages,
        )
        wrap_triton(_combine_kernel)[(bsz, n_kv_heads)](
            o_part, lse_part, out, n_splits, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, num_warps=4,
        )
        return out

    @triton_op("enginewright::decode_attention", mutates_args=())
    def _decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             lengths: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
        return _launch(q, k_cache, v_cache, lengths, kv_len, scale)


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


def sweep_decode_attention() -> None:
    """Print µs per call of the split kernel's tuning knobs (block, warps, stages, target programs) at the
    Llama-1B/8B decode shapes, batch 1 and 64, 192 and 2000 filled positions; the first row of each shape
    is the shipped setting."""
    if triton is None:
        raise RuntimeError("the sweep needs Triton on CUDA")
    shapes = {"llama-1B": (8, 4, 64), "llama-8B": (8, 4, 128)}
    knobs = [{}] + [{"block": b, "num_warps": w, "num_stages": st, "target_programs": t}
                    for b in (32, 64, 128) for w in (4, 8) for st in (2, 3) for t in (512, 1024)]
    for name, (n_kv_heads, group, head_dim) in shapes.items():
        for bsz, length, kv_len in ((1, 192, 256), (64, 192, 256), (64, 2000, 2048)):
            q = torch.randn(bsz, n_kv_heads, group, head_dim, device="cuda", dtype=torch.bfloat16)
            k_cache = torch.randn(bsz, n_kv_heads, kv_len, head_dim, device="cuda", dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            lengths = torch.full((bsz,), length, device="cuda", dtype=torch.int64)
            kv_bytes = 2 * bsz * n_kv_heads * head_dim * 2 * length
            results = []
            for knob in knobs:
                if knob.get("block", 0) * head_dim > 16384:
                    continue
                us = graph_time_us(lambda *a, knob=knob: _launch(*a, **knob), q, k_cache, v_cache, lengths, kv_len,
                              head_dim ** -0.5)
                results.append((us, knob))
            shipped = results[0][0]
            best = sorted(results, key=lambda r: r[0])[:3]
            print(f"{name} B={bsz} length={length}: shipped {shipped:.2f} us ({kv_bytes / shipped / 1e3:.0f} GB/s); "
                  + "; ".join(f"{us:.2f} us {knob}" for us, knob in best), flush=True)
