"""The skinny decode GEMMs (serving/engine/skinny_gemm.py).

- CPU, every run: config text round trip and fit rules, the tuned-table lookup, the F.linear fallback.
- TRITON_INTERPRET=1 with Triton importable (skipped otherwise, so in CI): both kernels on CPU tensors,
  every split, rows 1..64, N not a multiple of the block, float32 and bf16, bias.
- CUDA (`gpu`, the lead's H200 run): every tuned config at its own shape against F.linear, and a bf16
  engine's compiled decode step in CUDA graphs with the kernels against the same step with cuBLAS.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from serving.engine import skinny_gemm
from serving.engine.skinny_gemm import (
    MAX_ROWS,
    GemmConfig,
    config_for,
    skinny_linear,
    triton_available,
)
from serving.engine.tuned_tables import TUNED_DIR, TunedTables, key_of, read_file

H200 = read_file(TUNED_DIR / "NVIDIA_H200.json")
TUNED = H200.skinny

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton_available()
HAS_CUDA = torch.cuda.is_available() and triton_available() and not INTERPRET
CUDA_MISSING = "needs a CUDA GPU" if triton_available() else "needs a CUDA GPU and the triton package"


def test_config_text_round_trips_and_fit_rules():
    config = GemmConfig("dot", 64, 128, 4, 8, 5)
    assert GemmConfig.parse(config.key()) == config
    assert config.fits(64, 4096, 14336) and config.fits(1, 10, 512)
    assert not config.fits(65, 4096, 14336)  # more rows than the kernels take
    assert not config.fits(8, 4096, 4096 + 64)  # K must split into whole blocks
    assert not GemmConfig("gemv", 8, 256, 1).fits(2, 64, 256)  # the CUDA-core kernel is for one row
    for config in TUNED.values():
        assert GemmConfig.parse(config.key()) == config


def test_tuned_lookup_by_rows_bucket_and_fallback_to_f_linear():
    (rows, n, k), config = next(iter(TUNED.items()))
    assert config_for(rows, n, k, TUNED) == config
    assert config_for(MAX_ROWS + 1, n, k, TUNED) is None
    assert config_for(1, 3, 5, TUNED) is None
    x, w, b = torch.randn(3, 32), torch.randn(20, 32), torch.randn(20)
    assert torch.equal(skinny_linear(x, w, b, tables=H200), F.linear(x, w, b))  # CPU: no Triton kernel, F.linear


def test_config_lookup_traces_under_dynamo_fullgraph():
    """The compiled decode step looks its configs up while dynamo traces it: a lookup dynamo cannot
    trace (it once went through functools.cache) fails the compile on the GPU only, so check it here."""
    (rows, n, k), want = next(iter(TUNED.items()))

    def scaled(x: torch.Tensor) -> torch.Tensor:
        config = config_for(rows, n, k, TUNED)
        return x * config.split + config.block_n

    compiled = torch.compile(scaled, backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), float(want.split + want.block_n)))


@pytest.mark.parametrize(("tuned", "dtype", "want"), [
    (True, torch.bfloat16, "triton"), (True, torch.float16, "triton"), (True, torch.float32, "torch"),
    (False, torch.bfloat16, "torch"),
])
def test_auto_uses_the_kernels_only_where_the_device_has_tuned_tables(monkeypatch, tuned, dtype, want):
    """Tuned configs are the device's (serving/engine/tuned/): on a GPU without any, a config may need more
    shared memory than it has, so "auto" keeps cuBLAS there and an explicit "triton" is refused with the reason."""
    from serving.engine.errors import EngineLimitError
    from serving.engine.options import pick_decode_gemm

    monkeypatch.setattr(skinny_gemm, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    cuda = torch.device("cuda")
    tables = H200 if tuned else TunedTables()
    assert pick_decode_gemm("auto", cuda, dtype, tables) == want
    assert pick_decode_gemm("torch", cuda, dtype, tables) == "torch"
    assert pick_decode_gemm("auto", torch.device("cpu"), dtype, tables) == "torch"
    if not tuned:
        with pytest.raises(EngineLimitError, match=r"decode_gemm='triton'.*tuned kernel tables.*here: NVIDIA A100 "
                                                   r"\(compute capability 8\.0\)"):
            pick_decode_gemm("triton", cuda, torch.bfloat16, tables)
    with pytest.raises(EngineLimitError, match=r"decode_gemm='cublas': expected 'auto', 'triton' or 'torch'"):
        pick_decode_gemm("cublas", cuda, dtype, tables)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
def test_interpreter_kernels_match_f_linear(interpreter_bf16_dot, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 80, 512  # N not a multiple of any block
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    want = F.linear(x.float(), w.float(), bias.float())
    configs = [GemmConfig("dot", bn, bk, s) for bn, bk, s in ((32, 64, 1), (64, 128, 2), (16, 64, 8))]
    if rows == 1:
        configs += [GemmConfig("gemv", 8, 256, 1), GemmConfig("gemv", 16, 64, 4)]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for config in configs:
        got = skinny_linear(x, w, bias, config=config)
        assert got.dtype == dtype and got.shape == (rows, n)
        err = (got.float() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), (config.key(), err)


@pytest.mark.interpreter
@pytest.mark.parametrize("config", [GemmConfig("dot", 32, 64, 1), GemmConfig("dot", 16, 64, 4)], ids=GemmConfig.key)
def test_interpreter_pdl_variant_is_the_same_product_eagerly_and_compiled(interpreter_bf16_dot, config):
    """The PDL variant is an opaque custom op (serving/engine/pdl.py): its fake implementation must give
    the real output's shape and dtype under torch.compile. The interpreter runs the kernels without the
    grid-dependency instructions."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=gen)
    w = torch.randn(96, 256, generator=gen) * 0.05
    want = skinny_gemm.skinny_partials(x, w, config)
    torch._dynamo.reset()
    compiled = torch.compile(partial(skinny_gemm.skinny_partials, pdl=True), backend="aot_eager", fullgraph=True)
    for got in (skinny_gemm.skinny_partials(x, w, config, pdl=True), compiled(x * 1.0, w, config)):
        assert got.dtype == want.dtype and got.shape == want.shape == (config.split, 5, 96)
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def tuned_table(monkeypatch: pytest.MonkeyPatch, table: dict[tuple[int, int, int], str]) -> None:
    """Serve `table` as every device's tuned skinny configs (what the loader reads at option resolution)."""
    from serving.engine import options
    from serving.engine.gemm_config import parse_table

    monkeypatch.setattr(options, "tables_for", lambda device: TunedTables(source="test", skinny=parse_table(table)))


def test_a_given_table_is_what_the_loader_resolves(monkeypatch):
    from serving.engine.options import resolve_options

    tuned_table(monkeypatch, {(1, 3, 64): "gemv:n16:k16:s2:w4:st3"})
    tables = resolve_options(torch.device("cpu")).tuned
    assert config_for(1, 3, 64, tables.skinny) == GemmConfig("gemv", 16, 16, 2)
    assert config_for(*next(iter(TUNED)), tables.skinny) is None
    assert key_of((1, 3, 64)) == "1x3x64"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
@pytest.mark.parametrize("key", sorted(TUNED), ids=lambda k: f"rows{k[0]}-n{k[1]}-k{k[2]}")
def test_cuda_tuned_configs_match_f_linear(key):
    rows_bucket, n, k = key
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    for rows in ((1,) if rows_bucket == 1 else (2, 17, 64)):
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        got = skinny_linear(x, w, tables=H200)
        want = F.linear(x.float(), w.float())
        err = (got.float() - want).abs().max().item()
        assert err <= 2e-2 * max(1.0, want.abs().max().item()), (key, rows, err)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_cuda_decode_step_with_kernels_matches_cublas(tmp_path, monkeypatch):
    """A bf16 tiny engine whose shapes are put in the table (split-K configs) decodes, in the decode-only step
    (`cuda_graphs.paged_decode_logits`), the logits of the same step with cuBLAS within bf16 rounding, and its
    CUDA graphs the same first greedy tokens."""
    from engine_reference import decode_step_logits

    from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
    from tasks.tiny_model import make_tiny_model

    ckpt = convert_checkpoint(make_tiny_model(tmp_path / "hf"), tmp_path / "ckpt", dtype="bfloat16")
    info = build_engine(ckpt, tmp_path / "engine", limits=EngineLimits(dtype="bfloat16", max_batch_size=4,
                                                                      max_input_len=64, max_seq_len=128))
    a = info.model
    shapes = {(a.qkv_size, a.dim), (a.dim, a.q_size), (2 * a.intermediate_size, a.dim), (a.dim, a.intermediate_size),
              (a.vocab_size, a.dim)}
    assert all(k % 32 == 0 for _, k in shapes)  # dim 64, 4 x 16 heads, MLP 128
    table = {}
    for n, k in shapes:
        table[(1, n, k)] = GemmConfig("gemv", 16, 16, 2).key()
        table[(MAX_ROWS, n, k)] = GemmConfig("dot", 32, 16, 2).key()
    tuned_table(monkeypatch, table)
    runners = {gemm: load_engine(info.path, device="cuda", overrides={"decode_gemm": gemm}) for gemm in ("triton", "torch")}
    assert runners["triton"].model.options.decode_gemm == "triton"
    launched = []
    real_launch = skinny_gemm.launch
    monkeypatch.setattr(skinny_gemm, "launch", lambda *args, **kw: launched.append(args[2]) or real_launch(*args, **kw))
    prompts = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 14, 15], [0, 100]]
    for bsz in (1, 3):
        logits = {gemm: decode_step_logits(runner, prompts[:bsz], [5, 9, 100][:bsz])
                  for gemm, runner in runners.items()}
        err = (logits["triton"] - logits["torch"]).abs().max().item()
        print(f"skinny vs cuBLAS decode logits, batch {bsz}: max abs err {err:.4f}")
        assert err < 0.05 * max(logits["torch"].abs().max().item(), 1.0)
        greedy = [[g.token_ids for g in r.generate(prompts, max_new_tokens=8, logprobs=False)] for r in runners.values()]
        assert greedy[0][0][:2] == greedy[1][0][:2]
    assert launched  # the kernels ran: not two cuBLAS runs compared with each other


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=CUDA_MISSING)
def test_cuda_pdl_kernels_in_a_graph_wait_for_the_kernel_before():
    """GEMM kernels back to back in a CUDA graph, each reading what the one before wrote, launched with
    programmatic dependent launch: on every replay, bit for bit the products of launching them plainly.
    A kernel that read its input before its wait would see the previous replay's values."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2048, 2048, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
    config = GemmConfig("dot", 64, 128, 1)  # one K slice: each product is the next one's input as it is
    x = torch.zeros(64, 2048, device="cuda", dtype=torch.bfloat16)

    def chain(pdl: bool) -> torch.Tensor:
        y = x
        for _ in range(4):
            y = skinny_gemm.skinny_partials(y, w, config, pdl=pdl)[0]
        return y

    chain(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for seed in range(3):
        x.copy_(torch.randn(64, 2048, device="cuda", generator=gen.manual_seed(seed)))
        graph.replay()
        want = chain(False)
        assert want.abs().max() > 0.1
        assert torch.equal(out, want), (out.float() - want.float()).abs().max()
