"""The fused decode attention (serving/engine/decode_attention.py).

- CPU, every run: the torch reference against a naive per-row softmax and against the masked matmul
  of `model.decode_step`; the split-K plan.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the Triton kernels on CPU
  tensors against the reference, the caches NaN past each row's length.
- CUDA (`gpu`, the lead's H200 run): the Triton path eager, under torch.compile(fullgraph=True,
  dynamic=True) and inside CUDA-graph capture/replay.

`PYTHONPATH=. python tests/test_decode_attention.py` on the GPU prints the benchmark.
"""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch

from serving.engine.decode_attention import (
    MAX_SPLITS,
    bench_decode_attention,
    block_n,
    check_head_dim,
    decode_attention,
    decode_attention_reference,
    decode_attention_rope,
    decode_attention_triton,
    one_block,
    split_plan,
    sweep_decode_attention,
    triton_available,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if triton_available() else "needs a CUDA GPU and the triton package"
# (atol, rtol). In bf16/fp16 both paths round the probabilities before p @ v, each its own way (the
# kernel's are unnormalised), so the difference scales with sum_i |p_i v_i| (|v| up to ~4 here), not |out|.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def make_inputs(bsz: int, n_kv_heads: int, group: int, head_dim: int, kv_len: int, dtype: torch.dtype,
                device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q [B, Hkv, G, hd], caches [B + 2, Hkv, kv_len + 9, hd] (random everywhere), lengths [B] in
    [1, kv_len] with 1 and kv_len among them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, n_kv_heads, group, head_dim, generator=gen)
    shape = (bsz + 2, n_kv_heads, kv_len + 9, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    lengths = torch.randint(1, kv_len + 1, (bsz,), generator=gen)
    lengths[0] = kv_len
    lengths[-1] = 1 if bsz > 1 else lengths[-1]
    return tuple(t.to(device) for t in (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), lengths))


def poisoned(cache: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A copy of `cache` with NaN at every position a row may not read: past lengths[b], rows >= B."""
    out = cache.clone()
    past = torch.arange(cache.shape[2], device=cache.device) >= lengths.unsqueeze(1)  # [B, S]
    out[: lengths.shape[0]].masked_fill_(past.view(lengths.shape[0], 1, -1, 1), float("nan"))
    out[lengths.shape[0]:] = float("nan")
    return out


def naive(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
          scale: float) -> torch.Tensor:
    """Row by row, head by head, in float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        n = int(lengths[b])
        for h in range(q.shape[1]):
            keys, values = k_cache[b, h, :n].float(), v_cache[b, h, :n].float()
            for g in range(q.shape[2]):
                probs = torch.softmax(keys @ q[b, h, g].float() * scale, dim=0)
                out[b, h, g] = probs @ values
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """Elementwise |got - want| <= atol + rtol * |want|; returns the max abs error."""
    assert got.shape == want.shape and got.dtype == want.dtype
    atol, rtol = TOLERANCE[dtype]
    diff = (got.float() - want.float()).abs()
    err = diff.max().item()
    excess = (diff - atol - rtol * want.float().abs()).max().item()
    assert math.isfinite(err) and excess <= 0, f"max abs error {err} beyond atol {atol} rtol {rtol} ({dtype})"
    return err


# ---------------------------------------------------------------------------------------------
# CPU: the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8, 4, 64), (3, 2, 1, 128), (5, 1, 8, 64)])
@pytest.mark.parametrize("kv_len", [1, 17, 256])
def test_reference_matches_naive_softmax(dtype, shape, kv_len):
    q, k_cache, v_cache, lengths = make_inputs(*shape, kv_len, dtype)
    scale = shape[-1] ** -0.5
    got = decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, scale)
    assert_close(got, naive(q, k_cache, v_cache, lengths, scale).to(dtype), dtype)


def test_reference_ignores_keys_past_length():
    q, k_cache, v_cache, lengths = make_inputs(3, 2, 4, 64, 40, torch.float32)
    want = decode_attention_reference(q, k_cache, v_cache, lengths, 40, 0.125)
    got = decode_attention_reference(q, poisoned(k_cache, lengths), v_cache, lengths, 40, 0.125)
    assert torch.equal(got, want)


def test_reference_equals_decode_step_attention():
    """The drop-in for decode_step's masked matmul (lengths = input_pos + 1) gives the same numbers."""
    bsz, n_kv_heads, group, head_dim, kv_len = 4, 2, 4, 64, 48
    q, k_cache, v_cache, _ = make_inputs(bsz, n_kv_heads, group, head_dim, kv_len, torch.bfloat16)
    input_pos = torch.tensor([0, 47, 20, 5])
    scale = 1.0 / math.sqrt(head_dim)
    visible = torch.arange(kv_len).unsqueeze(0) <= input_pos.unsqueeze(1)
    neg = torch.zeros(visible.shape).masked_fill(~visible, float("-inf")).view(bsz, 1, 1, kv_len)
    keys, values = k_cache[:bsz, :, :kv_len], v_cache[:bsz, :, :kv_len]
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale + neg
    want = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)
    got = decode_attention(q, k_cache, v_cache, input_pos + 1, kv_len, scale)
    assert torch.equal(got, want)


def test_cpu_dispatches_to_reference():
    q, k_cache, v_cache, lengths = make_inputs(2, 2, 4, 64, 30, torch.float32)
    got = decode_attention(q, k_cache, v_cache, lengths, 30, 0.125)
    assert torch.equal(got, decode_attention_reference(q, k_cache, v_cache, lengths, 30, 0.125))


@pytest.mark.parametrize("bsz", [1, 2, 3, 8, 64, 256])
@pytest.mark.parametrize("n_kv_heads", [1, 8])
@pytest.mark.parametrize("kv_len", [1, 17, 64, 256, 1000, 4096, 32768])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_plan(bsz, n_kv_heads, kv_len, head_dim):
    block = block_n(head_dim)
    n_splits, chunk = split_plan(bsz, n_kv_heads, kv_len, block)
    assert chunk % block == 0 and 1 <= n_splits <= MAX_SPLITS
    assert (n_splits - 1) * chunk < kv_len <= n_splits * chunk  # no split starts past kv_len
    if bsz * n_kv_heads >= 512:
        assert n_splits == 1
    if bsz == 1 and kv_len >= 4096:
        assert n_splits == MAX_SPLITS  # batch 1, long context: spread over the GPU


def test_a_short_batch_1_bucket_is_read_as_one_block():
    assert one_block(1, 256, 64) and one_block(1, 17, 64) and one_block(1, 128, 128)
    assert not one_block(2, 256, 64)  # batch 64 was slower with it; the batches between are not timed
    assert not one_block(1, 512, 64) and not one_block(1, 256, 128)  # longer buckets keep their splits


@pytest.mark.parametrize("head_dim", [8, 96, 80])
def test_head_dim_must_be_a_power_of_two(head_dim):
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        check_head_dim(head_dim)


# ---------------------------------------------------------------------------------------------
# TRITON_INTERPRET=1: the kernels on CPU tensors


INTERPRETER_SHAPES = [(1, 8, 4), (3, 2, 8), (3, 1, 1), (64, 2, 4)]
# The interpreter runs a grid's programs one after another: 64 rows over hundreds of positions take minutes of
# CPU, past CI's budget (`large`: `make test-kernels-all`; every shape runs on the GPU below).
LARGE = pytest.mark.large
INTERPRETER_CASES = [pytest.param(shape, kv_len, marks=LARGE if shape[0] >= 64 and kv_len >= 256 else ())
                     for kv_len in (1, 17, 256, 1000) for shape in INTERPRETER_SHAPES]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("shape", "kv_len"), INTERPRETER_CASES)
def test_interpreter_matches_reference(interpreter_bf16_dot, dtype, head_dim, shape, kv_len):
    q, k_cache, v_cache, lengths = make_inputs(*shape, head_dim, kv_len, dtype)
    scale = head_dim ** -0.5
    want = decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, scale)
    k_bad, v_bad = poisoned(k_cache, lengths), poisoned(v_cache, lengths)
    got = decode_attention_triton(q, k_bad, v_bad, lengths, kv_len, scale)
    assert_close(got, want, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_len", [17, pytest.param(300, marks=LARGE)])
def test_interpreter_single_split_writes_the_output(interpreter_bf16_dot, dtype, kv_len):
    """64 rows x 8 KV heads fill the split-K grid's target alone: one split, which writes the output
    itself (no combine kernel)."""
    q, k_cache, v_cache, lengths = make_inputs(64, 8, 2, 64, kv_len, dtype)
    assert split_plan(64, 8, kv_len, block_n(64))[0] == 1
    scale = 64 ** -0.5
    want = decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, scale)
    got = decode_attention_triton(q, poisoned(k_cache, lengths), poisoned(v_cache, lengths), lengths, kv_len, scale)
    assert_close(got, want, dtype)


def make_rope_inputs(bsz: int, n_kv_heads: int, group: int, head_dim: int, kv_len: int, dtype: torch.dtype,
                     device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """qkv [B, (G + 2) Hkv hd] before the rotary embedding, rotary tables [kv_len + 9, hd] like the model's,
    caches and lengths as `make_inputs`."""
    _, k_cache, v_cache, lengths = make_inputs(bsz, n_kv_heads, group, head_dim, kv_len, dtype, device)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(bsz, (group + 2) * n_kv_heads * head_dim, generator=gen).to(device, dtype)
    angles = torch.outer(torch.arange(kv_len + 9).float(), 1e4 ** (-torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.cat((angles, angles), dim=-1)
    return qkv, angles.cos().to(device, dtype), angles.sin().to(device, dtype), k_cache, v_cache, lengths


def unfused_rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, lengths: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """What `model.decode_step` does without the fused kernel: rotate q and k, write k/v at lengths - 1
    (into the given caches), attend."""
    n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    bsz, group = qkv.shape[0], qkv.shape[1] // head_dim // n_kv_heads - 2
    pos = lengths - 1
    q, k, v = qkv.float().split([group * n_kv_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], -1)

    def rotate(x: torch.Tensor, heads: int) -> torch.Tensor:
        x = x.view(bsz, heads, head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos[pos].float().unsqueeze(1), sin[pos].float().unsqueeze(1)
        return (x * c + torch.cat((-x2, x1), dim=-1) * s).to(qkv.dtype)

    rows = torch.arange(bsz, device=qkv.device)
    k_cache[rows, :, pos] = rotate(k, n_kv_heads)
    v_cache[rows, :, pos] = v.view(bsz, n_kv_heads, head_dim).to(qkv.dtype)
    q = rotate(q, group * n_kv_heads).view(bsz, n_kv_heads, group, head_dim)
    return decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, scale)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "head_dim", "kv_len"), [
    ((1, 8, 4), 64, 17), ((3, 2, 8), 128, 256), ((3, 1, 1), 64, 1000), pytest.param((64, 8, 2), 64, 17, marks=LARGE),
    ((5, 2, 4), 64, 129),
])
@pytest.mark.parametrize("parts", [0, 1, 3])
def test_interpreter_rope_variant_rotates_writes_and_attends(interpreter_bf16_dot, dtype, shape, head_dim, kv_len,
                                                             parts):
    """The kernel takes the step's own token from qkv, not from the cache (the cache holds NaN there
    before the call), writes its rotated k and its v at lengths - 1, and leaves every other entry alone;
    single split (64 x 8) and several, the new position at a chunk's start among them (129). qkv comes
    whole ([B, N], parts 0) or as split-K partial products in float32 ([P, B, N]), which it sums."""
    qkv, cos, sin, k_cache, v_cache, lengths = make_rope_inputs(*shape, head_dim, kv_len, dtype)
    given = qkv
    if parts:
        given = torch.randn(parts, *qkv.shape, generator=torch.Generator().manual_seed(2))
        given[0] += qkv.float() - given.sum(0)
        qkv = given.sum(0).to(dtype)
    if kv_len == 129:
        lengths[1] = split_plan(shape[0], shape[1], kv_len, block_n(head_dim))[1] + 1  # new token opens split 1
    scale = head_dim ** -0.5
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want = unfused_rope_attention(qkv, cos, sin, k_want, v_want, lengths, kv_len, scale)
    stale = torch.arange(k_cache.shape[2]) >= (lengths - 1).unsqueeze(1)  # the new position and after
    k_got, v_got = (c.clone() for c in (k_cache, v_cache))
    for cache in (k_got, v_got):
        cache[: shape[0]].masked_fill_(stale.view(shape[0], 1, -1, 1), float("nan"))
    got = decode_attention_rope(given, cos, sin, k_got, v_got, lengths, kv_len, scale)
    assert_close(got, want, dtype)
    written = ~stale | (torch.arange(k_cache.shape[2]) == (lengths - 1).unsqueeze(1))
    for got_cache, want_cache in ((k_got, k_want), (v_got, v_want)):
        mask = written.view(shape[0], 1, -1, 1).expand_as(got_cache[: shape[0]])
        assert_close(got_cache[: shape[0]][mask], want_cache[: shape[0]][mask], dtype)
        assert torch.equal(got_cache[shape[0]:], want_cache[shape[0]:])  # rows past the batch untouched


def attend_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                input_pos: torch.Tensor, kv_len: int, pdl: bool = False) -> torch.Tensor:
    return decode_attention_rope(qkv * 1.0, cos, sin, k_cache, v_cache, input_pos + 1, kv_len,
                                 k_cache.shape[-1] ** -0.5, pdl=pdl)


@pytest.mark.interpreter
def test_interpreter_pdl_variant_compiled_writes_the_caches_and_attends(interpreter_bf16_dot):
    """The PDL variant is an opaque custom op (serving/engine/pdl.py): under torch.compile its fake
    implementation must give the real output's shape and dtype, and its cache writes must reach the
    caller's caches. The interpreter runs the kernels without the grid-dependency instructions."""
    torch._dynamo.reset()
    compiled = torch.compile(partial(attend_rope, pdl=True), backend="aot_eager", fullgraph=True, dynamic=True)
    scale = 64 ** -0.5
    for bsz, kv_len in ((1, 40), (3, 17)):
        qkv, cos, sin, k_cache, v_cache, lengths = make_rope_inputs(bsz, 2, 4, 64, kv_len, torch.float32)
        k_want, v_want = k_cache.clone(), v_cache.clone()
        want = unfused_rope_attention(qkv, cos, sin, k_want, v_want, lengths, kv_len, scale)
        assert_close(compiled(qkv, cos, sin, k_cache, v_cache, lengths - 1, kv_len), want, torch.float32)
        assert_close(k_cache, k_want, torch.float32)
        assert_close(v_cache, v_want, torch.float32)


# ---------------------------------------------------------------------------------------------
# CUDA

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", [(1, 8, 4), (3, 2, 8), (3, 1, 1), (64, 8, 4), (17, 8, 4)])
@pytest.mark.parametrize("kv_len", [1, 17, 256, 1000, 4096])
def test_cuda_matches_reference(dtype, head_dim, shape, kv_len):
    q, k_cache, v_cache, lengths = make_inputs(*shape, head_dim, kv_len, dtype, device="cuda")
    scale = head_dim ** -0.5
    want = decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, scale)
    got = decode_attention(q, poisoned(k_cache, lengths), poisoned(v_cache, lengths), lengths, kv_len, scale)
    assert_close(got, want, dtype)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
           kv_len: int) -> torch.Tensor:
    """The decode step's use: lengths from input_pos, then attention."""
    return decode_attention(q * 1.0, k_cache, v_cache, input_pos + 1, kv_len, q.shape[-1] ** -0.5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_under_torch_compile(dtype):
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=counter, fullgraph=True, dynamic=True)
    n_kv_heads, group, head_dim, max_batch, max_seq = 8, 4, 64, 64, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(max_batch, n_kv_heads, max_seq, head_dim, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(max_batch, n_kv_heads, max_seq, head_dim, device="cuda", generator=gen).to(dtype)
    for bsz in (1, 2, 8, 24, 64):
        for kv_len in (256, 512, 1024):
            q = torch.randn(bsz, n_kv_heads, group, head_dim, device="cuda", generator=gen).to(dtype)
            input_pos = torch.randint(0, kv_len, (bsz,), device="cuda", generator=gen)
            want = decode_attention_reference(q, k_cache, v_cache, input_pos + 1, kv_len, head_dim ** -0.5)
            assert_close(compiled(q, k_cache, v_cache, input_pos, kv_len), want, dtype)
    # batch 1 is specialised by dynamo; the other (batch, kv_len) share two graphs: one split (batch 64 x
    # 8 KV heads fill the grid, no combine kernel) or several
    assert counter.frame_count <= 3, f"{counter.frame_count} compiles"




@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_rope_variant_compiled_and_in_a_graph_writes_the_caches(dtype, pdl):
    """Under torch.compile the op's cache writes are functionalised: they must land in the caches the
    caller holds (not in a copy), and inside a CUDA graph on every replay; launched with programmatic
    dependent launch too (each replay's inputs are written by the kernels just before it)."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    torch._dynamo.reset()
    compiled = torch.compile(partial(attend_rope, pdl=pdl), fullgraph=True, dynamic=True)
    scale = 64 ** -0.5
    for bsz, kv_len in ((1, 256), (8, 512), (64, 256)):
        qkv, cos, sin, k_cache, v_cache, lengths = make_rope_inputs(bsz, 8, 4, 64, kv_len, dtype, device="cuda")
        k_want, v_want = k_cache.clone(), v_cache.clone()
        want = unfused_rope_attention(qkv, cos, sin, k_want, v_want, lengths, kv_len, scale)
        assert_close(compiled(qkv, cos, sin, k_cache, v_cache, lengths - 1, kv_len), want, dtype)
        assert_close(k_cache, k_want, dtype)
        assert_close(v_cache, v_want, dtype)
    qkv, cos, sin, k_cache, v_cache, lengths = make_rope_inputs(8, 8, 4, 64, 512, dtype, device="cuda")
    input_pos = lengths.clamp(max=500) - 1  # room for the three steps below inside the 512 bucket
    graph = torch.cuda.CUDAGraph()
    compiled(qkv, cos, sin, k_cache, v_cache, input_pos, 512)
    with torch.cuda.graph(graph):
        out = compiled(qkv, cos, sin, k_cache, v_cache, input_pos, 512)
    for step in range(3):
        qkv.normal_()
        input_pos.add_(1)  # the next position of every row
        k_want, v_want = k_cache.clone(), v_cache.clone()
        want = unfused_rope_attention(qkv, cos, sin, k_want, v_want, input_pos + 1, 512, scale)
        graph.replay()
        assert_close(out, want, dtype)
        assert_close(k_cache, k_want, dtype)
        assert_close(v_cache, v_want, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("use_compile", [False, True])
def test_cuda_graph_capture_and_replay(use_compile):
    torch._dynamo.reset()
    fn = torch.compile(attend, fullgraph=True, dynamic=True) if use_compile else attend
    dtype, bsz, n_kv_heads, group, head_dim, kv_len = torch.bfloat16, 8, 8, 4, 128, 512
    q, k_cache, v_cache, _ = make_inputs(bsz, n_kv_heads, group, head_dim, kv_len, dtype, device="cuda")
    input_pos = torch.zeros(bsz, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            fn(q, k_cache, v_cache, input_pos, kv_len)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = fn(q, k_cache, v_cache, input_pos, kv_len)
    for seed in range(3):
        new_q, _, _, lengths = make_inputs(bsz, n_kv_heads, group, head_dim, kv_len, dtype, "cuda", seed + 1)
        q.copy_(new_q)
        input_pos.copy_(lengths - 1)
        k_cache.add_(0.5)  # the cache changes between steps too
        graph.replay()
        want = decode_attention_reference(q, k_cache, v_cache, lengths, kv_len, head_dim ** -0.5)
        assert_close(out, want, dtype)


if __name__ == "__main__":
    import sys

    if "--sweep" in sys.argv:
        sweep_decode_attention(layers=16 if "--cold" in sys.argv else 1)
    else:
        bench_decode_attention()
        bench_decode_attention(length=4000, kv_len=4096, max_seq=4096)
