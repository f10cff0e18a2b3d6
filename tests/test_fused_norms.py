"""The decode step's norms folded into its GEMMs, and the LM head's greedy tokens (serving/engine/
row_norm.py, residual.py, lm_head.py and the NORM / GREEDY options of the skinny and gate/up kernels).

- CPU, every run: `RowNorm.apply` from tiled sums of squares is `model.RMSNorm`; the tile reduction of
  `greedy_from_tiles` is argmax's, ties included.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): each kernel on CPU tensors
  against its unfused torch form (float32 bit for bit where the order of operations is the same), every
  split, N not a multiple of the block, bad arguments named; and a float32 model's decode step with the
  folded layers and the greedy head against the unfolded step.
- CUDA (`gpu`): the kernels at the Llama-1B batch-64 configs, replayed in a CUDA graph (the arrival
  counters must come back to zero each time), and an engine's compiled decode step with and without the
  fold and the greedy head.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from serving.engine.lm_head import greedy_from_tiles
from serving.engine.model import ModelArgs, RMSNorm, Transformer
from serving.engine.row_norm import RowNorm
from serving.engine.skinny_gemm import GemmConfig, skinny_linear, triton_available

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="needs triton and TRITON_INTERPRET=1")
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")


def tiled_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tiles: int) -> RowNorm:
    """The RowNorm of x with its sums of squares in `tiles` column tiles, as a residual GEMM leaves them."""
    squares = x.float().pow(2).view(x.shape[0], tiles, -1)
    return RowNorm(squares.sum(-1), weight, eps)


def test_a_row_norm_from_tiled_sums_of_squares_is_the_models_rmsnorm():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    norm = RMSNorm(64, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    want = norm(x)
    for tiles in (1, 4, 16):
        got = tiled_norm(x, norm.weight.detach(), 1e-5, tiles).apply(x)
        assert got.dtype == want.dtype
        assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()
    with pytest.raises(ValueError, match=r"RowNorm.weight must be \[64\] of torch.bfloat16"):
        RowNorm(torch.zeros(5, 1), torch.ones(64), 1e-5).check(x)
    with pytest.raises(ValueError, match=r"RowNorm.sumsq must be float32 \[M=5, T\]"):
        RowNorm(torch.zeros(4, 1), norm.weight.detach(), 1e-5).check(x)


def test_greedy_from_tiles_is_argmax_with_ties_to_the_lowest_column():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0, 0.0, 5.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    tiles = logits.view(3, 3, 2)
    maxima, where = tiles.max(-1)
    columns = (where + torch.arange(3) * 2).int()
    assert torch.equal(greedy_from_tiles(maxima, columns), logits.argmax(-1))
    assert greedy_from_tiles(maxima, columns).tolist() == [1, 0, 5]


def random_pair(rows: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen).to(dtype), (torch.randn(n, k, generator=gen) * 0.1).to(dtype)


@interpreter_only
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_interpreter_linear_residual_is_the_unfused_add_bit_for_bit(interpreter_bf16_dot, split, rows):
    from serving.engine.residual import launch, linear_residual

    n, k = 40, 256  # N not a multiple of the block
    x, w = random_pair(rows, n, k, torch.float32, split * rows)
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(1))
    config = GemmConfig("dot", 16, 32, split)
    counters = torch.zeros(8, dtype=torch.int32)
    out, sumsq = linear_residual(x, w, residual, config, counters)
    want = residual + skinny_linear(x, w, config=config)
    assert torch.equal(out, want)
    padded = F.pad(want, (0, 48 - n)).view(rows, 3, 16)
    assert torch.allclose(sumsq, padded.pow(2).sum(-1), rtol=1e-6)
    assert not counters.any()  # each tile's last slice set its counter back
    with pytest.raises(ValueError, match=r"needs 3 int32 counters, got 2"):
        launch(x, w, residual, config, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"residual \[M, N\] of one dtype.*\(\d+, 3\)"):
        launch(x, w, residual[:, :3], config, counters)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreter_norm_is_applied_as_the_kernels_load_x(interpreter_bf16_dot, dtype):
    from serving.engine.gate_up import gate_up, gate_up_norm
    from serving.engine.skinny_gemm import norm_linear_parts

    rows, k = 6, 128
    x, w = random_pair(rows, 48, k, dtype, 3)
    norm = tiled_norm(x, (torch.rand(k, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype), 1e-5, 4)
    normed = norm.apply(x)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for config in (GemmConfig("dot", 16, 32, 1), GemmConfig("dot", 32, 16, 2)):
        got = norm_linear_parts(x, norm, w, config).float().sum(0)
        want = skinny_linear(normed, w, config=config).float()
        assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item()), config.key()
    w13 = torch.cat([w, w.flip(0)])
    config = GemmConfig("dot", 16, 32, 1)
    got, want = gate_up_norm(x, norm, w13, config).float(), gate_up(normed, w13, config=config).float()
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@interpreter_only
@pytest.mark.parametrize("rows", [1, 7])
def test_interpreter_lm_head_writes_the_logits_and_their_greedy_tokens(interpreter_bf16_dot, rows):
    from serving.engine.lm_head import lm_head_greedy
    from serving.engine.skinny_gemm import launch

    vocab, k = 200, 64  # the last tile half empty
    x, w = random_pair(rows, vocab, k, torch.float32, rows)
    w[150] = w[37]  # a tie across tiles: argmax's lowest column wins
    x[0] = w[37] * 10
    config = GemmConfig("dot", 64, 32, 1)
    logits, tokens = lm_head_greedy(x, w, config)
    assert torch.equal(logits, skinny_linear(x, w, config=config))
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[0].item() == 37
    norm = tiled_norm(x, torch.rand(k, generator=torch.Generator().manual_seed(5)) + 0.5, 1e-5, 2)
    logits, tokens = lm_head_greedy(x, w, config, norm=norm)
    want = skinny_linear(norm.apply(x), w, config=config)
    assert (logits - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(tokens, logits.argmax(-1))
    with pytest.raises(ValueError, match=r"greedy maxima need one K slice"):
        launch(x, w, GemmConfig("dot", 64, 32, 2), greedy=(torch.empty(rows, 4), torch.empty(rows, 4)))


def tiny_model(dtype: torch.dtype = torch.float32) -> Transformer:
    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=200, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, intermediate_size=128, norm_eps=1e-5, max_position_embeddings=64,
                     tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        for layer in model.layers:
            for norm in (layer.attention_norm, layer.ffn_norm):
                norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
    model = model.to(dtype)
    model.setup_caches(8, 32)
    for layer in model.layers:
        layer.attention.kv_cache.k_cache.normal_()
        layer.attention.kv_cache.v_cache.normal_()
    return model


@interpreter_only
def test_interpreter_folded_decode_step_matches_the_unfolded_step(interpreter_bf16_dot):
    from serving.engine.lm_head import lm_head_greedy
    from serving.engine.model import FoldPlan, _folded_layers, decode_step

    model = tiny_model()
    tokens, input_pos = torch.tensor([3, 50, 199, 7, 120]), torch.tensor([0, 4, 9, 17, 30])
    with torch.no_grad():
        want = decode_step(model, tokens, input_pos, 32, gemm="torch")  # matmul attention, F.linear
        plan = FoldPlan(wqkv=GemmConfig("dot", 32, 16, 2), wo=GemmConfig("dot", 16, 16, 2),
                        gate_up=GemmConfig("dot", 32, 16, 1), w2=GemmConfig("dot", 16, 32, 4))
        hidden, norm = _folded_layers(model, model.tok_embeddings(tokens), plan, input_pos + 1, 32, pdl=False)
        logits, greedy = lm_head_greedy(hidden, model.tok_embeddings.weight, GemmConfig("dot", 64, 32, 1), norm=norm)
    assert not model.fold_counters.any()
    err = (logits - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), err
    assert torch.equal(greedy, want.argmax(-1))


@pytest.mark.gpu
@cuda_only
def test_cuda_folded_kernels_at_the_llama_1b_configs_replay_in_a_graph():
    from serving.engine.gate_up import TUNED_GATE_UP_CONFIGS, gate_up, gate_up_norm
    from serving.engine.lm_head import lm_head_greedy
    from serving.engine.residual import linear_residual
    from serving.engine.skinny_gemm import TUNED_CONFIGS, norm_linear_parts

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, dim, inner, vocab = 64, 2048, 8192, 128256

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    residual, y = rand(rows, dim), rand(rows, inner)
    w2, wqkv, head = rand(dim, inner, scale=0.02), rand(3072, dim, scale=0.02), rand(vocab, dim, scale=0.02)
    w13 = rand(2 * inner, dim, scale=0.02)
    g = (torch.rand(dim, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    counters = torch.zeros(dim, dtype=torch.int32, device="cuda")
    config_w2, config_qkv = TUNED_CONFIGS[(64, dim, inner)], TUNED_CONFIGS[(64, 3072, dim)]
    config_gu, config_head = TUNED_GATE_UP_CONFIGS[(64, inner, dim)], TUNED_CONFIGS[(64, vocab, dim)]

    def step() -> tuple[torch.Tensor, ...]:
        out, sumsq = linear_residual(y, w2, residual, config_w2, counters, pdl=True)
        norm = RowNorm(sumsq, g, 1e-5)
        qkv = norm_linear_parts(out, norm, wqkv, config_qkv, pdl=True)
        mlp = gate_up_norm(out, norm, w13, config_gu, pdl=True)
        logits, tokens = lm_head_greedy(out, head, config_head, norm=norm, pdl=True)
        return out, qkv, mlp, logits, tokens

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    out_want = residual + skinny_linear(y, w2, config=config_w2)
    normed = RMSNorm(dim, 1e-5).cuda().to(torch.bfloat16)
    with torch.no_grad():
        normed.weight.copy_(g)
        h = normed(out_want)
    wants = (out_want, F.linear(h, wqkv), gate_up(h, w13, config=config_gu), F.linear(h, head))
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any(), replay
        out, qkv, mlp, logits, tokens = captured
        assert torch.equal(out, eager[0]) and torch.equal(out, out_want), replay
        for got, want in zip((qkv.float().sum(0), mlp, logits), wants[1:], strict=True):
            err = (got.float() - want.float()).abs().max().item()
            assert err <= 2e-2 * max(1.0, want.float().abs().max().item()), (replay, err)
        assert torch.equal(tokens, logits.argmax(-1)), replay


@pytest.mark.gpu
@cuda_only
def test_cuda_compiled_folded_step_decodes_as_the_unfolded_one(tmp_path, monkeypatch):
    from serving.engine import gate_up as gate_up_module
    from serving.engine import residual as residual_module
    from serving.engine import skinny_gemm

    model = tiny_model(torch.bfloat16).cuda()
    model.decode_attention_impl, model.decode_gemm_impl = "triton", "triton"
    a = model.args
    table = {(64, a.qkv_size, a.dim): GemmConfig("dot", 32, 16, 2), (64, a.dim, a.q_size): GemmConfig("dot", 16, 16, 2),
             (64, a.dim, a.intermediate_size): GemmConfig("dot", 16, 32, 4),
             (64, a.vocab_size, a.dim): GemmConfig("dot", 64, 32, 1)}
    monkeypatch.setattr(skinny_gemm, "TUNED_CONFIGS", table)
    monkeypatch.setattr(gate_up_module, "TUNED_GATE_UP_CONFIGS", {(64, a.intermediate_size, a.dim): GemmConfig("dot", 32, 16, 1)})
    folded = []
    real = residual_module.launch
    monkeypatch.setattr(residual_module, "launch", lambda *args, **kw: folded.append(1) or real(*args, **kw))
    from serving.engine.model import decode_step_greedy

    tokens = torch.tensor([3, 50, 199, 7, 120], device="cuda")
    input_pos = torch.tensor([0, 4, 9, 17, 30], device="cuda")
    results = {}
    for fold in (False, True):
        model.decode_fold_norms = model.decode_lm_greedy = fold
        torch._dynamo.reset()
        step = torch.compile(decode_step_greedy, dynamic=True, fullgraph=True)
        with torch.no_grad():
            logits, greedy = step(model, tokens, input_pos, 32, pdl=True)
        results[fold] = logits.float().clone(), greedy.clone()
    assert folded  # the folded kernels ran
    (want, want_tokens), (got, got_tokens) = results[False], results[True]
    err = (got - want).abs().max().item()
    print(f"folded vs unfolded compiled decode logits: max abs err {err:.4f}")
    assert err < 0.05 * max(want.abs().max().item(), 1.0)
    assert torch.equal(got_tokens, want_tokens)
