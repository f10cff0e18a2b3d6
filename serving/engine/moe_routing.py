"""A decode step's expert routing in one launch: router logits -> top-k weights and ids -> the grouped GEMMs'
alignment (`moe_gemm.align`'s three tensors), what `models.moe.route` and `moe_gemm.align` compute in about twenty
torch kernels a layer (softmax, a sort, gathers, counts, cumsums, an argsort, a searchsorted). At batch 1 those
launches, not the experts' bytes, set a mixture of experts' step time; here one program does them all.

One program holds the [tokens, experts] probabilities (so `fits`: at most MAX_CELLS of them, padded to powers of
two: Qwen3-30B-A3B's 128 experts up to 128 tokens); larger batches keep the torch ops. The same rules as theirs:
- softmax over the experts in float32 (Triton's exp: within a few ulp of torch's), the k largest, **ties to the
  lowest expert index** (`models.moe` module doc), weights divided by their sum with `renormalize`;
- assignment a = token k + slot; each expert's assignments in token order at the start of its run, padded to a
  multiple of `block_m` with the sentinel N k; `block_expert` the expert of each block of rows, `n_experts` past
  the used ones; `padded` the rows in use. Every position of `sorted_ids` is written once (runs, their padding,
  the tail), so no barrier orders two writes.

Imports: torch; Triton only if importable (this module runs inside Triton's python backend).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_CELLS = 16384  # tokens x experts (each padded to a power of two) one program holds
BLOCK_CHUNK = 64  # blocks of rows whose expert one pass finds


def fits(tokens: int, n_experts: int) -> bool:
    """Whether one program routes `tokens` over `n_experts` (`MAX_CELLS`)."""
    return triton is not None and triton.next_power_of_2(tokens) * triton.next_power_of_2(n_experts) <= MAX_CELLS


def _warps(cells: int) -> int:
    """Warps for one program over `cells` probabilities: about 32 a thread (its matrices stay in registers)."""
    return min(16, max(4, cells // 1024))


def sorted_length(tokens: int, top_k: int, n_experts: int, block_m: int) -> int:
    """Rows of `sorted_ids`: the N k assignments with the most padding their experts can need, in whole blocks."""
    total = tokens * top_k
    return -(-(total + min(n_experts, total) * (block_m - 1)) // block_m) * block_m


if triton is not None:

    @triton.jit
    def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, padded_ptr,
                            n_tokens, n_experts, stride_l, n_sorted,
                            TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                            N_P2: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr, CHUNK: tl.constexpr):
        tokens = tl.arange(0, N_P2)
        experts = tl.arange(0, E_P2)
        live = tokens < n_tokens
        real = experts < n_experts
        x = tl.load(logits_ptr + tokens[:, None] * stride_l + experts[None, :],
                    mask=live[:, None] & real[None, :], other=float("-inf")).to(tl.float32)
        x = tl.where(live[:, None], x, 0.0)  # a padding token's row stays finite
        p = tl.exp(x - tl.max(x, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        p = tl.where(real[None, :], p, -1.0)  # never picked

        slots = tl.arange(0, K_P2)
        weights = tl.zeros((N_P2, K_P2), tl.float32)
        ids = tl.zeros((N_P2, K_P2), tl.int32)
        slot_of = tl.zeros((N_P2, E_P2), tl.int32) - 1  # each token's slot of each expert, -1 where not picked
        for j in tl.static_range(TOP_K):
            best = tl.max(p, 1)
            pick = tl.min(tl.where(p == best[:, None], experts[None, :], E_P2), 1)  # ties: the lowest index
            weights = tl.where(slots[None, :] == j, best[:, None], weights)
            ids = tl.where(slots[None, :] == j, pick[:, None], ids)
            picked = experts[None, :] == pick[:, None]
            slot_of = tl.where(picked, j, slot_of)
            p = tl.where(picked, -1.0, p)
        if RENORMALIZE:
            weights = weights / tl.sum(weights, 1)[:, None]  # slots past TOP_K hold 0
        out = live[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + tokens[:, None] * TOP_K + slots[None, :], weights, mask=out)
        tl.store(ids_ptr + tokens[:, None] * TOP_K + slots[None, :], ids.to(tl.int64), mask=out)

        chosen = (slot_of >= 0) & live[:, None]
        counts = tl.sum(chosen.to(tl.int32), 0)  # [E_P2]: each token picks an expert at most once
        padded_counts = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        padded_end = tl.cumsum(padded_counts, 0)
        padded_start = padded_end - padded_counts
        rank = tl.cumsum(chosen.to(tl.int32), 0) - chosen.to(tl.int32)  # earlier tokens of the same expert
        total = n_tokens * TOP_K
        tl.store(sorted_ptr + padded_start[None, :] + rank, tokens[:, None] * TOP_K + slot_of, mask=chosen)
        pads = tl.arange(0, BLOCK_M)
        pad_at = (padded_start + counts)[None, :] + pads[:, None]
        tl.store(sorted_ptr + pad_at, tl.zeros((BLOCK_M, E_P2), tl.int32) + total,
                 mask=(pads[:, None] < (padded_counts - counts)[None, :]) & real[None, :])
        used = tl.sum(padded_counts, 0)
        for start in range(0, n_sorted, CHUNK * BLOCK_M):
            rows = start + tl.arange(0, CHUNK * BLOCK_M)
            tl.store(sorted_ptr + rows, tl.zeros((CHUNK * BLOCK_M,), tl.int32) + total,
                     mask=(rows >= used) & (rows < n_sorted))
        ends = padded_end // BLOCK_M
        for start in range(0, n_sorted // BLOCK_M, CHUNK):
            blocks = start + tl.arange(0, CHUNK)
            expert = tl.sum(((ends[None, :] <= blocks[:, None]) & real[None, :]).to(tl.int32), 1)
            tl.store(block_expert_ptr + blocks, expert, mask=blocks < n_sorted // BLOCK_M)
        tl.store(padded_ptr, used)


def route_and_align(logits: torch.Tensor, top_k: int, *, renormalize: bool, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (float32 weights [N, k], expert ids [N, k] int64, sorted_ids, block_expert, padded):
    `models.moe.route` then `moe_gemm.align`, in one launch (module doc; `fits` must hold)."""
    n, n_experts = logits.shape
    if not fits(n, n_experts):
        raise ValueError(f"one routing program holds at most {MAX_CELLS} tokens x experts (powers of two); got "
                         f"{n} x {n_experts}: route with models.moe.route and moe_gemm.align")
    logits, dev = logits.contiguous(), logits.device
    n_p2, e_p2 = triton.next_power_of_2(n), triton.next_power_of_2(n_experts)
    n_sorted = sorted_length(n, top_k, n_experts, block_m)
    weights = torch.empty(n, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=dev)
    sorted_ids = torch.empty(n_sorted, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_sorted // block_m, dtype=torch.int32, device=dev)
    padded = torch.empty(1, dtype=torch.int32, device=dev)
    _route_align_kernel[(1,)](
        logits, weights, ids, sorted_ids, block_expert, padded, n, n_experts, logits.stride(0), n_sorted,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_M=block_m, N_P2=n_p2, E_P2=e_p2,
        K_P2=triton.next_power_of_2(top_k), CHUNK=BLOCK_CHUNK, num_warps=_warps(n_p2 * e_p2))
    return weights, ids, sorted_ids, block_expert, padded
