"""Gemma 3's layer parts on the engine's fused kernels, against the torch ops of its modules (`models.gemma3`):
its `(1 + w)` RMSNorm (`row_norm`'s `unit_offset`), that norm of a layer's output fused with the residual add and
the next norm (`row_norm.add_rms_norm`'s `delta_weight`), its q/k head norms (`head_norm`'s `unit_offset`), and
GELU-tanh * up (`silu_mul`'s `gelu_tanh`).

- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the kernels on CPU tensors in float16
  (the interpreter's float32 -> bfloat16 cast does not round to nearest; bf16 is checked on the GPU).
- CUDA (`gpu`): the modules on bf16 GPU tensors, which dispatch eager calls to the kernels, and a whole layer's
  serving step on them against its torch ops.
- CPU: the modules' own fallbacks (`GemmaRMSNorm.add_normed`: the output norm, then the add and the norm).
The norm kernels compute Gemma's norm as HF does (the row in float32, times rsqrt, times `1 + w` in float32,
rounded once); only the sum's order and the rsqrt differ, so a value may land a step of the dtype away. The
GELU kernel's float32 result may differ from torch's last bit (CPU torch's vectorized tanh is the less exact of
the two: the kernel's activation equals the float64 GELU rounded to the dtype).
"""

from __future__ import annotations

import math
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from serving.engine import head_norm, row_norm, silu_mul
from serving.engine.model import ModelArgs, StepContext
from serving.engine.models.gemma3 import GeluFeedForward, GemmaBlock, GemmaRMSNorm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and row_norm.triton is not None
HAS_CUDA = torch.cuda.is_available() and row_norm.triton is not None and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if row_norm.triton is not None else "needs a CUDA GPU and the triton package"
ROWS = ((3, 256), (2, 5, 96), (4, 3000))  # rows x hidden (96, 3000: a masked tail)
HEADS = ((5, 4, 2, 32), (2, 3, 3, 80))  # tokens, H, Hkv, head_dim (80: a masked tail)


def torch_ops(fn, *args, **kwargs):
    """`fn` through the modules' torch ops (the path compiled code takes)."""
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        return fn(*args, **kwargs)


def check_close(out: torch.Tensor, ref: torch.Tensor, *, equal_share: float = 0.97, atol: float = 1e-6) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ref.float().abs() * 2.0**-6 + atol).all()), float(diff.max())
    assert float((diff == 0).float().mean()) > equal_share


def gemma_norm(dim: int, device: str, dtype: torch.dtype, seed: int) -> GemmaRMSNorm:
    torch.manual_seed(seed)
    norm = GemmaRMSNorm(dim, eps=1e-6).to(device=device, dtype=dtype)
    norm.weight.data = (0.5 * torch.randn(dim, device=device)).to(dtype)  # checkpoints' w: around 0, not 1
    return norm


def rows(shape: tuple[int, ...], device: str, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    torch.manual_seed(seed)
    return (scale * torch.randn(*shape, device=device)).to(dtype)


# -- the (1 + w) norm


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", ROWS)
def test_norm_kernel_computes_gemmas_norm_interpreted(shape: tuple[int, ...]) -> None:
    norm, x = gemma_norm(shape[-1], "cpu", torch.float16, 1), rows(shape, "cpu", torch.float16, 2)
    out = row_norm.rms_norm(x, norm.weight, norm.eps, unit_offset=True)
    check_close(out, norm(x))
    plain = row_norm.rms_norm(x, norm.weight, norm.eps)
    assert not torch.allclose(plain.float(), out.float(), atol=0.1), "without the offset: another norm"


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", ROWS)
@pytest.mark.parametrize("pdl", (False, True))
def test_output_norm_add_and_next_norm_in_one_kernel_interpreted(shape: tuple[int, ...], pdl: bool) -> None:
    """add_rms_norm(x, delta, w, delta_weight=dw): delta through Gemma's norm by dw, rounded, added to x as torch
    adds, the sum normed by w: the CPU module's `add_normed`."""
    dim = shape[-1]
    norm, post = gemma_norm(dim, "cpu", torch.float16, 3), gemma_norm(dim, "cpu", torch.float16, 4)
    x, delta = rows(shape, "cpu", torch.float16, 5), rows(shape, "cpu", torch.float16, 6, scale=40.0)
    total, out = row_norm.add_rms_norm(x, delta, norm.weight, norm.eps, pdl=pdl, unit_offset=True,
                                       delta_weight=post.weight)
    normed_delta = row_norm.rms_norm(delta, post.weight, post.eps, unit_offset=True)
    assert torch.equal(total, x + normed_delta), "the residual sum of the normed delta, rounded once"
    ref_total, ref_out = norm.add_normed(x, delta, post)
    check_close(total, ref_total)
    check_close(out, norm(total))
    check_close(out, ref_out, equal_share=0.9)  # a sum a step away moves its row's norm too


@pytest.mark.interpreter
@pytest.mark.parametrize("fused", (False, True))
def test_gemma_norms_rows_scaled_to_e4m3_equal_the_token_scaling_kernels_interpreted(fused: bool) -> None:
    from serving.engine import fp8_tokens
    from serving.engine.prescaled import E4M3_MAX, prescaled_rows

    norm, post = gemma_norm(96, "cpu", torch.float16, 7), gemma_norm(96, "cpu", torch.float16, 8)
    x, delta = rows((6, 96), "cpu", torch.float16, 9), rows((6, 96), "cpu", torch.float16, 10)
    if fused:
        plain, out = (row_norm.add_rms_norm(x, delta, norm.weight, norm.eps, unit_offset=True, e4m3=e4m3,
                                            delta_weight=post.weight)[1] for e4m3 in (False, True))
    else:
        plain, out = (row_norm.rms_norm(x, norm.weight, norm.eps, unit_offset=True, e4m3=e4m3)
                      for e4m3 in (False, True))
    assert torch.equal(out, plain)
    q, scale = prescaled_rows(out, 6)
    want_q, want_scale = fp8_tokens.tokens_e4m3(out, E4M3_MAX)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_add_normed_on_the_cpu_is_the_output_norm_the_add_then_the_norm() -> None:
    norm, post = gemma_norm(64, "cpu", torch.float32, 11), gemma_norm(64, "cpu", torch.float32, 12)
    x, delta = rows((3, 64), "cpu", torch.float32, 13), rows((3, 64), "cpu", torch.float32, 14)
    total, out = norm.add_normed(x, delta, post)
    assert torch.equal(total, x + post(delta)) and torch.equal(out, norm(x + post(delta)))


# -- the q/k head norms


def head_case(shape: tuple[int, int, int, int], device: str, dtype: torch.dtype
              ) -> tuple[GemmaRMSNorm, GemmaRMSNorm, torch.Tensor]:
    tokens, n_heads, n_kv_heads, head_dim = shape
    q_norm, k_norm = (gemma_norm(head_dim, device, dtype, sum(shape) + i) for i in range(2))
    return q_norm, k_norm, rows((tokens, (n_heads + 2 * n_kv_heads) * head_dim), device, dtype, sum(shape))


def head_torch_ops(q_norm: GemmaRMSNorm, k_norm: GemmaRMSNorm, qkv: torch.Tensor, n_heads: int, n_kv_heads: int
                   ) -> torch.Tensor:
    d = q_norm.weight.shape[0]
    q, k, v = qkv.split([n_heads * d, n_kv_heads * d, n_kv_heads * d], dim=-1)
    q, k = (torch_ops(q_norm, q.unflatten(-1, (n_heads, d))), torch_ops(k_norm, k.unflatten(-1, (n_kv_heads, d))))
    return torch.cat([q.flatten(-2), k.flatten(-2), v], dim=-1)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", HEADS)
def test_head_norm_kernel_computes_gemmas_head_norms_interpreted(shape: tuple[int, int, int, int]) -> None:
    _, n_heads, n_kv_heads, head_dim = shape
    q_norm, k_norm, qkv = head_case(shape, "cpu", torch.float16)
    ref = head_torch_ops(q_norm, k_norm, qkv, n_heads, n_kv_heads)
    out = head_norm.norm_heads_(qkv, q_norm.weight, k_norm.weight, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                eps=q_norm.eps, unit_offset=True)
    assert torch.equal(out[:, (n_heads + n_kv_heads) * head_dim:], ref[:, (n_heads + n_kv_heads) * head_dim:])
    check_close(out, ref)


# -- GELU-tanh * up


def exact_gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU-tanh of gate in float64, rounded to the dtype, times up, rounded (the kernel's roundings)."""
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.double()
    act = (0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))).to(gate.dtype)
    return (act.double() * up.double()).to(gate.dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", ((3, 2 * 1500), (2, 4, 2 * 2048)))  # a masked tail; two BLOCKs a row
def test_gelu_kernel_matches_gelu_tanh_times_up_interpreted(shape: tuple[int, ...]) -> None:
    x = rows(shape, "cpu", torch.float16, sum(shape))
    out = silu_mul.silu_mul(x, shape[-1] // 2, gelu_tanh=True)
    check_close(out, exact_gelu_mul(x), equal_share=0.99)  # equal everywhere on the interpreter
    gate, up = x.chunk(2, dim=-1)
    # CPU torch's half GELU flushes the far negative tail (gate < -5: |GELU| < 2e-6) to zero
    check_close(out, F.gelu(gate, approximate="tanh") * up, equal_share=0.9, atol=1e-4)
    silu = silu_mul.silu_mul(x, shape[-1] // 2)
    assert float((silu != out).float().mean()) > 0.5, "SiLU's kernel is another activation"


@pytest.mark.interpreter
def test_gelu_rows_scaled_to_e4m3_equal_the_token_scaling_kernels_interpreted() -> None:
    from serving.engine import fp8_tokens
    from serving.engine.prescaled import E4M3_MAX, prescaled_rows

    x = rows((5, 2 * 2600), "cpu", torch.float16, 15)
    out = silu_mul.silu_mul_e4m3(x, 2600, gelu_tanh=True)
    assert torch.equal(out, silu_mul.silu_mul(x, 2600, gelu_tanh=True))
    q, scale = prescaled_rows(out, 5)
    want_q, want_scale = fp8_tokens.tokens_e4m3(out, E4M3_MAX)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_gelu_on_the_cpu_is_the_torch_ops() -> None:
    x = rows((3, 2 * 64), "cpu", torch.float32, 16)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_mul.gated(x, 64, gelu_tanh=True), F.gelu(gate, approximate="tanh") * up)


# -- the modules on the GPU


def gemma_args(n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 64) -> ModelArgs:
    return ModelArgs(architecture="Gemma3ForCausalLM", vocab_size=64, dim=256, n_layers=1, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, head_dim=head_dim, intermediate_size=512, norm_eps=1e-6,
                     max_position_embeddings=64)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("shape", ((5, 3840), (64, 3840), (8192, 2048)))  # Gemma-3-12B's hidden size
def test_gemma_norms_run_the_kernels_on_the_gpu(shape: tuple[int, ...]) -> None:
    norm, post = gemma_norm(shape[-1], "cuda", torch.bfloat16, 17), gemma_norm(shape[-1], "cuda", torch.bfloat16, 18)
    x, delta = rows(shape, "cuda", torch.bfloat16, 19), rows(shape, "cuda", torch.bfloat16, 20, scale=40.0)
    with mock.patch.object(row_norm, "rms_norm", wraps=row_norm.rms_norm) as kernel:
        out = norm(x)
    assert kernel.called
    check_close(out, torch_ops(norm, x))
    with mock.patch.object(row_norm, "add_rms_norm", wraps=row_norm.add_rms_norm) as kernel:
        total, out = norm.add_normed(x, delta, post)
    assert kernel.call_count == 1, "the output norm, the add and the next norm: one kernel"
    assert torch.equal(total, x + post(delta)), "the sum of the output norm's own kernel result"
    check_close(out, torch_ops(norm, total))
    # the sum's addends, not the sum, against the torch ops: where x cancels post(delta) (16M rows of it) one ulp of
    # post(delta) is far more than 2^-6 of the sum
    check_close(post(delta), torch_ops(post, delta))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("tokens", (1, 64, 3000))
def test_gelu_feed_forward_runs_the_kernel_on_the_gpu(tokens: int) -> None:
    torch.manual_seed(tokens)
    ff = GeluFeedForward(gemma_args()).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    with mock.patch.object(silu_mul, "silu_mul", wraps=silu_mul.silu_mul) as kernel:
        out = ff.gated(x)
    assert kernel.called
    gate, up = F.linear(x, ff.w13.weight).chunk(2, dim=-1)
    check_close(out, F.gelu(gate, approximate="tanh") * up)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("tokens", (1, 64))
@pytest.mark.parametrize("head_dim", (64, 256))  # 256: Gemma 3's heads
def test_gemma_layer_step_on_the_kernels_equals_its_torch_ops_on_the_gpu(tokens: int, head_dim: int) -> None:
    """A `GemmaBlock` in a serving step (its attention mocked to the q columns: the kernels around it are what is
    checked) and the residual add into the next layer's norm: the fused kernels against the modules' torch ops."""
    torch.manual_seed(tokens)
    args = gemma_args(head_dim=head_dim)
    block = GemmaBlock(args).to("cuda", torch.bfloat16)
    next_norm = GemmaRMSNorm(args.dim, args.norm_eps).to("cuda", torch.bfloat16)
    for norm in (block.attention_norm, block.ffn_norm, block.post_attention_norm, block.post_ffn_norm,
                 block.attention.q_norm, block.attention.k_norm, next_norm):
        norm.weight.data = 0.5 * torch.randn_like(norm.weight)
    ctx = StepContext(reference=True, pdl=False, qkv_e4m3=False, w13_e4m3=False)
    x = torch.randn(tokens, args.dim, device="cuda", dtype=torch.bfloat16)

    def layer(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with mock.patch.object(ctx, "attend", side_effect=lambda _, qkv: qkv[:, :args.q_size]):
            x, ff = block.step(0, x, block.attention_norm(x), ctx)
            return block.add_mlp_output(x, ff, next_norm, ctx)

    with mock.patch.object(row_norm, "add_rms_norm", wraps=row_norm.add_rms_norm) as fused, \
            mock.patch.object(head_norm, "norm_heads_", wraps=head_norm.norm_heads_) as heads, \
            mock.patch.object(silu_mul, "silu_mul", wraps=silu_mul.silu_mul) as gelu:
        x_out, h_out = layer(x)
    assert fused.call_count == 2 and heads.call_count == 1 and gelu.call_count == 1
    want_x, want_h = torch_ops(layer, x)
    for out, want in ((x_out, want_x), (h_out, want_h)):  # bf16 steps compound through the layer
        assert float((out.float() - want.float()).abs().max()) <= 0.05 * float(want.float().abs().max())
