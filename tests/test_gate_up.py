"""The fused silu(gate) * up of the decode step's MLP (serving/engine/gate_up.py).

- CPU, every run: the fallback is the w13 product and SiLU * up; fit rules; bad shapes named.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the kernel on CPU tensors
  against the unfused product, rows 1..64, I not a multiple of the block, float32 and bf16.
- CUDA (`gpu`): configs at the Llama-1B and 8B shapes against the unfused product, and a bf16 engine's
  compiled decode step in CUDA graphs with the kernel against the same step without it.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from serving.engine import gate_up as gate_up_module
from serving.engine.gate_up import fits, gate_up
from serving.engine.skinny_gemm import GemmConfig, triton_available

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if triton_available() else "needs a CUDA GPU and the triton package"


def unfused(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """The step's own order: w13 product rounded to x.dtype, SiLU rounded, the product rounded."""
    gate, up = F.linear(x.float(), w13.float()).to(x.dtype).chunk(2, dim=-1)
    return F.silu(gate) * up


def test_the_fallback_is_the_w13_product_and_silu_times_up():
    gen = torch.Generator().manual_seed(0)
    x, w13 = torch.randn(3, 32, generator=gen), torch.randn(40, 32, generator=gen)
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    assert torch.equal(gate_up(x, w13), F.silu(gate) * up)


def test_fit_rules():
    assert fits(GemmConfig("dot", 64, 128, 1), 64, 4096)
    assert not fits(GemmConfig("dot", 64, 128, 2), 64, 4096)  # SiLU needs whole sums: no split-K
    assert not fits(GemmConfig("gemv", 8, 256, 1), 1, 4096)
    assert not fits(GemmConfig("dot", 64, 128, 1), 65, 4096)
    assert not fits(GemmConfig("dot", 64, 128, 1), 1, 4096 + 64)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_interpreter_kernel_matches_the_unfused_product(interpreter_bf16_dot, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    intermediate, k = 80, 256  # I not a multiple of any block
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w13 = (torch.randn(2 * intermediate, k, generator=gen) * 0.2).to(dtype)  # gate values reach +-6
    want = unfused(x, w13).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for config in (GemmConfig("dot", 32, 64, 1), GemmConfig("dot", 64, 128, 1), GemmConfig("dot", 16, 256, 1)):
        got = gate_up(x, w13, config=config)
        assert got.dtype == dtype and got.shape == (rows, intermediate)
        err = (got.float() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (config.key(), err)
    with pytest.raises(ValueError, match=r"w13 \[2I, K\].*\(81, 256\)"):
        gate_up_module.launch(x, w13[:81], GemmConfig("dot", 32, 64, 1))
    with pytest.raises(ValueError, match=r"dot:n32:k64:s2.*split 1"):
        gate_up_module.launch(x, w13, GemmConfig("dot", 32, 64, 2))


@pytest.mark.interpreter
def test_interpreter_pdl_variant_is_the_same_product_eagerly_and_compiled(interpreter_bf16_dot):
    """The PDL variant is an opaque custom op: its fake implementation must give the real output's shape
    and dtype under torch.compile. The interpreter runs the kernel without the grid-dependency
    instructions (`serving.engine.pdl.gdc`)."""
    gen = torch.Generator().manual_seed(4)
    x, w13 = torch.randn(5, 256, generator=gen), torch.randn(2 * 80, 256, generator=gen) * 0.2
    config = GemmConfig("dot", 32, 64, 1)
    want = gate_up(x, w13, config=config)
    torch._dynamo.reset()
    compiled = torch.compile(partial(gate_up, config=config, pdl=True), backend="aot_eager", fullgraph=True)
    for got in (gate_up(x, w13, config=config, pdl=True), compiled(x * 1.0, w13)):
        assert got.dtype == want.dtype and got.shape == want.shape == (5, 80)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize(("intermediate", "k"), [(8192, 2048), (14336, 4096)], ids=["llama-1b", "llama-8b"])
def test_cuda_kernel_matches_the_unfused_product(intermediate, k):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(2 * intermediate, k, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    for rows in (1, 17, 64):
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        want = unfused(x, w13).float()
        for config in (GemmConfig("dot", 64, 128, 1, 4, 3), GemmConfig("dot", 128, 64, 1, 8, 3)):
            err = (gate_up(x, w13, config=config).float() - want).abs().max().item()
            assert err <= 2e-2 * max(1.0, want.abs().max().item()), (rows, config.key(), err)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_cuda_decode_step_with_the_kernel_matches_the_unfused_step(tmp_path, monkeypatch, pdl):
    from engine_reference import decode_step_logits

    from serving.engine import EngineLimits, build_engine, convert_checkpoint, cuda_graphs, load_engine
    from serving.engine.linears import apply_options
    from serving.engine.options import with_tuned
    from tasks.tiny_model import make_tiny_model

    ckpt = convert_checkpoint(make_tiny_model(tmp_path / "hf"), tmp_path / "ckpt", dtype="bfloat16")
    info = build_engine(ckpt, tmp_path / "engine", limits=EngineLimits(dtype="bfloat16", max_batch_size=4,
                                                                      max_input_len=64, max_seq_len=128))
    a = info.model
    config = GemmConfig("dot", 32, 16, 1)
    runner = load_engine(info.path, device="cuda", overrides={"decode_gemm": "triton"})
    prompts = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 14, 15], [0, 100]]
    launched = []
    launch = gate_up_module.launch
    monkeypatch.setattr(gate_up_module, "launch", lambda *a, **kw: launched.append(kw) or launch(*a, **kw))
    real_step = cuda_graphs.paged_decode_logits
    monkeypatch.setattr(cuda_graphs, "paged_decode_logits", lambda *args, **kw: real_step(*args, **{**kw, "pdl": pdl}))
    logits = {}
    base = runner.model.options
    for fused in (False, True):
        table = {(rows, a.intermediate_size, a.dim): config for rows in (1, 64)} if fused else {}
        apply_options(runner.model, with_tuned(base, gate_up=table))
        logits[fused] = decode_step_logits(runner, prompts, [5, 9, 100])
    # the kernel ran; the decode step's launches (the last, one a layer) with PDL as asked (the prompts' mixed
    # step before them launches without)
    assert [kw.get("pdl", False) for kw in launched[-a.n_layers:]] == [pdl] * a.n_layers, launched
    err = (logits[True] - logits[False]).abs().max().item()
    print(f"fused gate/up vs unfused decode logits: max abs err {err:.4f}")
    assert err < 0.05 * max(logits[False].abs().max().item(), 1.0)