"""Decode attention through block tables (serving/engine/paged_attention.py).

- CPU, every run: the torch reference against a naive per-row softmax over each row's own positions.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the Triton kernel on CPU tensors
  against the reference, with the pools NaN wherever no row's visible positions lie.
- CUDA (`gpu`): the kernel against the reference in bf16.

Sliding windows: the reference against the naive softmax over each row's last `window` positions, and the kernel
(interpreter, CUDA) against both, with the blocks before each row's window holding NaN.

fp8 pools (an fp8 KV cache, e4m3 with scale 1.0): the reference against float32 attention over the same
e4m3-rounded K/V (equal to float error) and over the unrounded K/V (within the bound the rounding errors
allow); the kernel under the interpreter (it loads float8e4nv and converts exactly) and on CUDA with bf16 q.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from serving.engine.kv_cache import KV_FP8_DTYPE, to_kv_fp8
from serving.engine.paged_attention import kernel_fits, paged_decode_reference, paged_decode_triton, triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton is not None
HAS_CUDA = torch.cuda.is_available() and triton is not None and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if triton is not None else "needs a CUDA GPU and the triton package"


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


def _naive(q, k, v, tables, lengths, scale, window=None):
    out = torch.empty_like(q, dtype=torch.float32)
    block = k.shape[1]
    for b in range(q.shape[0]):
        length = int(lengths[b])
        pos = torch.arange(max(0, length - window) if window else 0, length)
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


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("prefetch", [True, False])
def test_blocks_prefetched_ahead_give_the_reference_result(splits, fp8, prefetch):
    """`AttentionKernelOptions.prefetch_blocks` (the next block's table entry loaded an iteration ahead, V with
    K) or not; rows of 1 position up to several blocks, splits (empty ones too), bf16-sized and fp8 pools: the
    reference's result."""
    from serving.engine.options import AttentionKernelOptions

    q, k, v, tables, lengths = _case(group=4, fill=float("nan"))
    if fp8:
        k, v = to_kv_fp8(k), to_kv_fp8(v)
    scale = 1 / math.sqrt(q.shape[-1])
    kernel = AttentionKernelOptions(prefetch_blocks=prefetch)
    got = paged_decode_triton(q, k, v, tables, lengths, scale, splits=splits, kernel=kernel)
    want = _naive(q, k.float(), v.float(), tables, lengths, scale)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [1, 4])
def test_kernel_under_the_interpreter_equals_the_reference(group):
    q, k, v, tables, lengths = _case(group=group, fill=float("nan"))
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q, k, v, tables, lengths, scale)
    want = _naive(q, k, v, tables, lengths, scale)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [2, 3, 16])
@pytest.mark.parametrize("pdl", [False, True])
def test_positions_split_over_programs_give_the_one_program_result(splits, pdl):
    """Split over positions (more splits than some rows have blocks: empty splits weigh nothing), combined:
    the reference's result, for rows of 1 position up to several blocks; both kernels launched with
    programmatic dependent launch or without."""
    q, k, v, tables, lengths = _case(group=4, fill=float("nan"))
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q, k, v, tables, lengths, scale, splits=splits, pdl=pdl)
    want = _naive(q, k, v, tables, lengths, scale)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.interpreter
@pytest.mark.parametrize("tile, splits", [(32, 1), (64, 1), (32, 2), (64, 16)])
def test_tiles_of_several_blocks_give_the_one_block_result(tile, splits):
    """Iterations over tiles of 2-4 blocks (each position through its own table entry; rows shorter than a
    tile, a tile cut by the length, splits of tiles, empty ones): the reference's result."""
    q, k, v, tables, lengths = _case(group=4, lengths=(1, 17, 40, 64, 65), bsz=5, fill=float("nan"))
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q, k, v, tables, lengths, scale, splits=splits, tile=tile)
    want = _naive(q, k, v, tables, lengths, scale)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def _windowed_case(window: int, garbage: float):
    """A case whose rows' blocks wholly before their window hold `garbage` (released blocks another sequence took:
    the reference reads them, masked, so it needs finite values there; the kernel never reads them)."""
    q, k, v, tables, lengths = _case(group=4, lengths=(1, 17, 40, 64, 65), bsz=5, fill=garbage)
    block = k.shape[1]
    for b, length in enumerate(lengths.tolist()):
        for i in range(max(0, length - window) // block):
            k[tables[b, i]], v[tables[b, i]] = garbage, garbage
    return q, k, v, tables, lengths


@pytest.mark.parametrize("window", [1, 12, 16, 33])
def test_reference_with_a_window_sees_only_each_rows_last_window_positions(window):
    q, k, v, tables, lengths = _windowed_case(window, 1e4)
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_reference(q, k, v, tables, lengths, scale, window)
    want = _naive(q, k, v, tables, lengths, scale, window)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    full = paged_decode_reference(q, k, v, tables, lengths, scale)
    assert not torch.allclose(got[2:], full[2:], atol=1e-3)  # the rows longer than the window see less


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [1, 12, 33])
@pytest.mark.parametrize("splits, tile, prefetch", [(1, None, True), (3, None, True), (1, None, False), (2, 32, True)])
def test_kernel_with_a_window_skips_the_blocks_before_it_and_equals_the_reference(window, splits, tile, prefetch):
    """A sliding window (`window` positions a row, ending at its last): the kernel starts at the tile holding
    the window's first position, so the NaN blocks before it are never read; splits over the window's tiles
    (empty ones too), tiles of two blocks, blocks prefetched or not: the reference's result."""
    from serving.engine.options import AttentionKernelOptions

    q, k, v, tables, lengths = _windowed_case(window, float("nan"))
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q, k, v, tables, lengths, scale, splits=splits, tile=tile, window=window,
                              kernel=AttentionKernelOptions(prefetch_blocks=prefetch))
    want = _naive(q, k, v, tables, lengths, scale, window)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_a_tile_that_is_not_a_power_of_two_is_refused():
    q, k, v, tables, lengths = _case()
    with pytest.raises(ValueError, match="tile=24 positions"):
        paged_decode_triton(q, k, v, tables, lengths, 0.25, tile=24)


def test_positions_are_split_only_when_the_batch_leaves_sms_idle():
    from unittest import mock

    from serving.engine.paged_attention import MAX_SPLITS, position_splits

    assert position_splits(1, 8, torch.device("cpu")) == 1
    props = mock.Mock(multi_processor_count=132)
    with mock.patch.object(torch.cuda, "get_device_properties", return_value=props):
        cuda = torch.device("cuda", 0)
        assert position_splits(1, 8, cuda) == MAX_SPLITS  # 8 programs: 16 each would make 128 < 264
        assert position_splits(8, 8, cuda) == 5  # 64 programs x 5 >= 264
        assert position_splits(33, 8, cuda) == 1 and position_splits(1024, 8, cuda) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_kernel_split_over_positions_and_in_tiles_on_cuda_equals_the_reference():
    q, k, v, tables, lengths = _case(bsz=2, n_kv=8, group=4, hd=128, block=32, lengths=(1, 1000),
                                     dtype=torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    want = paged_decode_reference(q, k, v, tables, lengths, scale).float()
    for splits, tile in ((1, None), (7, None), (16, None), (1, 64), (1, 128), (5, 128)):
        got = paged_decode_triton(q, k, v, tables, lengths, scale, splits=splits, tile=tile).float()
        assert (got - want).abs().max() < 2e-2, (splits, tile)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_kernel_on_cuda_bf16_equals_the_reference():
    q, k, v, tables, lengths = _case(bsz=64, n_kv=8, group=4, hd=128, block=32,
                                     lengths=tuple(range(1, 640, 10)), dtype=torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q, k, v, tables, lengths, scale).float()
    want = paged_decode_reference(q, k, v, tables, lengths, scale).float()
    assert (got - want).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_kernel_on_cuda_with_blocks_prefetched_gives_the_same_values():
    """`AttentionKernelOptions.prefetch_blocks` changes when the loads are issued, not what is computed: the
    same values to the bit, with and without splits, over bf16 and fp8 pools."""
    from serving.engine.options import AttentionKernelOptions

    q, k, v, tables, lengths = _case(bsz=64, n_kv=8, group=4, hd=128, block=32,
                                     lengths=tuple(range(1, 640, 10)), dtype=torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    for pools, splits in itertools.product(((k, v), (to_kv_fp8(k), to_kv_fp8(v))), (1, 4)):
        plain = paged_decode_triton(q, *pools, tables, lengths, scale, splits=splits,
                                    kernel=AttentionKernelOptions(prefetch_blocks=False))
        ahead = paged_decode_triton(q, *pools, tables, lengths, scale, splits=splits)
        assert torch.equal(ahead, plain), (pools[0].dtype, splits)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_kernel_on_cuda_with_a_window_equals_the_reference():
    """Sliding windows (Mistral's, Gemma 3's local layers) on bf16 and fp8 pools, split and tiled."""
    q, k, v, tables, lengths = _case(bsz=64, n_kv=8, group=4, hd=128, block=32,
                                     lengths=tuple(range(1, 640, 10)), dtype=torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(q.shape[-1])
    for pools, window, splits, tile in itertools.product(((k, v), (to_kv_fp8(k), to_kv_fp8(v))), (1, 100, 512),
                                                         (1, 4), (None, 64)):
        want = paged_decode_reference(q, *pools, tables, lengths, scale, window).float()
        got = paged_decode_triton(q, *pools, tables, lengths, scale, splits=splits, tile=tile, window=window).float()
        assert (got - want).abs().max() < 2e-2, (pools[0].dtype, window, splits, tile)


def _rounding_bound(q, k, v, k8, v8, tables, lengths, scale):
    """Per (row, kv head, query head): how far attention over K/V perturbed to k8, v8 can be from attention
    over k, v. With every score moved by at most d = scale * max_i |q . dk_i|, each probability moves by a
    factor within exp(+-2d), so |out' - out| <= max_i |dv_i| + (exp(2d) - 1) * max_i |v_i|."""
    bound = torch.empty_like(q, dtype=torch.float32)
    block = k.shape[1]
    for b in range(q.shape[0]):
        pos = torch.arange(int(lengths[b]))
        at = (tables[b, pos // block], pos % block)
        dk, dv = (k8[at].float() - k[at].float()), (v8[at].float() - v[at].float())  # [L, Hkv, hd]
        for h in range(q.shape[1]):
            d = (q[b, h].float() @ dk[:, h].T).abs().max(-1).values * scale  # [G]
            vmax, dvmax = v[at][:, h].float().abs().max(), dv[:, h].abs().max()
            bound[b, h] = (dvmax + torch.expm1(2 * d) * vmax)[:, None]
    return bound


def test_reference_over_fp8_pools_is_attention_over_the_rounded_kv():
    """Pools of e4m3 (values of N(0, 1) K/V rounded to nearest): the reference equals float32 attention over
    the same rounded K/V to float error, and differs from attention over the unrounded K/V (the rounding is
    visible) by no more than the K/V rounding errors allow (`_rounding_bound`)."""
    q, k, v, tables, lengths = _case(bsz=4, lengths=(1, 17, 40, 64))
    scale = 1 / math.sqrt(q.shape[-1])
    k8, v8 = to_kv_fp8(k), to_kv_fp8(v)
    got = paged_decode_reference(q, k8, v8, tables, lengths, scale)
    assert got.dtype == torch.float32 and k8.dtype == KV_FP8_DTYPE
    exact = (got - _naive(q, k8.float(), v8.float(), tables, lengths, scale)).abs().max()
    off = (got - _naive(q, k, v, tables, lengths, scale)).abs()
    bound = _rounding_bound(q, k, v, k8, v8, tables, lengths, scale)
    print(f"fp8 pools: {float(exact):.2e} from attention over the rounded K/V, {float(off.max()):.3f} "
          f"(mean {float(off.mean()):.4f}) from the unrounded, bound {float(bound.min()):.3f}-{float(bound.max()):.3f}")
    assert exact < 1e-5
    assert 0 < off.max() and bool((off <= bound + 1e-5).all())


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_over_fp8_pools_under_the_interpreter_equals_the_reference(dtype):
    """The interpreter loads float8e4nv exactly (its fp8 *stores* round wrongly at some binade edges, see
    tests/test_paged_rope.py; loads do not), so the kernel with fp8 pools and q in float32 (IEEE dots) or
    float16 equals the reference over the same pools, to float error and to float16 rounding."""
    q, k, v, tables, lengths = _case(group=4, fill=float("nan"))
    k8, v8 = to_kv_fp8(k), to_kv_fp8(v)  # NaN where no row looks: a read of a wrong position shows
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q.to(dtype), k8, v8, tables, lengths, scale)
    want = _naive(q.to(dtype), k8.float(), v8.float(), tables, lengths, scale)
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (got.float() - want).abs().max() < tol, (got.float() - want).abs().max()


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, 3])
def test_dots_in_float16_over_fp8_pools_give_the_reference_to_float16_rounding(splits):
    """`AttentionKernelOptions.fp8_kv_dot_f16`'s kernel (q, K, V and the probabilities in float16, float32 accumulators), forced on a
    float32 query: the reference over the same pools, to float16 rounding; a query past float16's range is
    clamped to it, not made infinite."""
    q, k, v, tables, lengths = _case(group=4, fill=float("nan"))
    k8, v8 = to_kv_fp8(k), to_kv_fp8(v)
    scale = 1 / math.sqrt(q.shape[-1])
    got = paged_decode_triton(q, k8, v8, tables, lengths, scale, splits=splits, dot_f16=True)
    want = _naive(q, k8.float(), v8.float(), tables, lengths, scale)
    assert got.dtype == torch.float32 and (got - want).abs().max() < 2e-3, (got - want).abs().max()
    huge = q.clone()
    huge[0, 0, 0, 0] = 1e6
    assert torch.isfinite(paged_decode_triton(huge, k8, v8, tables, lengths, scale, dot_f16=True)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_kernel_on_cuda_bf16_q_over_fp8_pools_equals_the_reference():
    """Llama-8B's head shapes, bf16 queries over e4m3 pools: the kernel (fp8 loads converted to bf16 before
    tl.dot) against the reference (the pools cast to bf16), within bf16 noise as for bf16 pools."""
    q, k, v, tables, lengths = _case(bsz=64, n_kv=8, group=4, hd=128, block=32,
                                     lengths=tuple(range(1, 640, 10)), dtype=torch.bfloat16, device="cuda")
    k8, v8 = to_kv_fp8(k), to_kv_fp8(v)
    scale = 1 / math.sqrt(q.shape[-1])
    want = paged_decode_reference(q, k8, v8, tables, lengths, scale).float()
    exact = _naive(q, k8.float(), v8.float(), tables, lengths, scale)
    for dot_f16 in (False, True):  # the bf16 dots, then the float16 ones (`fp8_kv_dot_f16`)
        got = paged_decode_triton(q, k8, v8, tables, lengths, scale, dot_f16=dot_f16).float()
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() < 2e-2 and (got - exact).abs().max() < 2e-2, (dot_f16, (got - exact).abs().max())
