"""The LM head's kernel with the greedy tokens of its logits (serving/engine/lm_head.py and the GREEDY
option of the skinny GEMM's dot kernel).

- CPU, every run: the tile reduction of `greedy_from_tiles` is argmax's, ties included.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): the kernel on CPU tensors
  against F.linear and argmax, a tie across tiles, the last tile part empty, bad arguments named.
- CUDA (`gpu`): the kernel at the tuned Llama head configs in a CUDA graph against F.linear and argmax,
  and an engine's compiled decode step with the kernel against the same step without it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from serving.engine.lm_head import greedy_from_tiles
from serving.engine.model import ModelArgs, Transformer
from serving.engine.skinny_gemm import GemmConfig, skinny_linear, triton_available

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="needs triton and TRITON_INTERPRET=1")
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")


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
    bf16_logits, bf16_tokens = lm_head_greedy(x.bfloat16(), w.bfloat16(), config)
    assert bf16_logits.dtype == torch.bfloat16 and torch.equal(bf16_tokens, bf16_logits.argmax(-1))
    with pytest.raises(ValueError, match=r"greedy maxima need a 'dot' config, one K slice"):
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


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize(("rows", "dim"), [(64, 2048), (1, 2048), (64, 4096), (1, 4096)])
def test_cuda_head_kernel_at_the_tuned_llama_configs_replays_in_a_graph(rows, dim):
    from serving.engine.lm_head import lm_head_greedy
    from serving.engine.tuned_tables import TUNED_DIR, read_file

    gen = torch.Generator(device="cuda").manual_seed(rows)
    vocab = 128256
    x = torch.randn(rows, dim, device="cuda", generator=gen).to(torch.bfloat16)
    head = (torch.randn(vocab, dim, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    config = read_file(TUNED_DIR / "NVIDIA_H200.json").skinny[(rows, vocab, dim)]
    torch.cuda.synchronize()
    lm_head_greedy(x, head, config, pdl=True)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, tokens = lm_head_greedy(x, head, config, pdl=True)
    for replay in range(2):
        x.copy_(torch.randn(rows, dim, device="cuda", generator=gen).to(torch.bfloat16))
        want = F.linear(x, head)
        graph.replay()
        torch.cuda.synchronize()
        err = (logits.float() - want.float()).abs().max().item()
        assert err <= 2e-2 * want.float().abs().max().item(), (replay, err)
        assert torch.equal(tokens, logits.argmax(-1)), replay


@pytest.mark.gpu
@cuda_only
def test_cuda_compiled_step_with_the_head_kernel_decodes_as_without(monkeypatch):
    import dataclasses

    from serving.engine import lm_head
    from serving.engine.linears import apply_options
    from serving.engine.model import decode_step_greedy
    from serving.engine.options import EngineOptions, with_tuned

    model = tiny_model(torch.bfloat16).cuda()
    a = model.args
    options = with_tuned(EngineOptions(decode_attention="triton", decode_gemm="triton"),
                         skinny={(64, a.vocab_size, a.dim): GemmConfig("dot", 64, 32, 1)})
    ran = []
    real = lm_head.greedy_from_tiles
    monkeypatch.setattr(lm_head, "greedy_from_tiles", lambda *args: ran.append(1) or real(*args))
    tokens = torch.tensor([3, 50, 199, 7, 120], device="cuda")
    input_pos = torch.tensor([0, 4, 9, 17, 30], device="cuda")
    results = {}
    for greedy in (False, True):
        apply_options(model, dataclasses.replace(options, decode_lm_greedy=greedy))
        torch._dynamo.reset()
        step = torch.compile(decode_step_greedy, dynamic=True, fullgraph=True)
        with torch.no_grad():
            logits, next_tokens = step(model, tokens, input_pos, 32, pdl=True)
        results[greedy] = logits.clone(), next_tokens.clone()
    assert ran  # the head kernel's path ran
    (want, want_tokens), (got, got_tokens) = results[False], results[True]
    assert want.dtype == torch.float32 and got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    assert torch.equal(got_tokens, want_tokens)
