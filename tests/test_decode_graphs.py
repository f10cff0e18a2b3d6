"""Which compile each decode graph captures, and that the load warm-up leaves serving nothing to compile
(serving/engine/cuda_graphs.py).

- CPU: the warm-up policy against every graph a serving engine can capture; the dynamo behaviour that
  policy rests on (a static step compiles once per KV length, the dynamic step once for batch 1 and once
  for the rest), with the engine's own step functions.
- CPU: the programmatic-dependent-launch switch names an inductor setting this torch has.
- CUDA (`gpu`): after `warm_up`, batch 1 and batch 3 at a second KV bucket capture without compiling;
  the step compiled with programmatic dependent launch computes what it computes without.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
from serving.engine.cuda_graphs import (
    _decode_step_single,
    batch_buckets,
    compile_options,
    compiled_parts,
    graphs_to_warm,
    single_row_static,
    tuned_single_row,
)
from serving.engine.model import ModelArgs, Transformer, decode_step_greedy
from tasks.tiny_model import make_tiny_model


def compile_of(bsz: int, kv_len: int, first_kv: int) -> tuple:
    """The compiled code a graph replays: the static batch-1 step per KV bucket, else the dynamic step's
    batch-1 or shared variant."""
    return ("static", kv_len) if single_row_static(bsz, kv_len, first_kv) else ("dynamic", bsz == 1)


@pytest.mark.parametrize("max_batch_size", [1, 8, 64])
@pytest.mark.parametrize("kv_buckets", [[256], [256, 512], [256, 512, 768, 1024, 1100]])
def test_the_warm_up_compiles_everything_serving_can_capture(max_batch_size, kv_buckets):
    buckets = batch_buckets(max_batch_size)
    warmed = {compile_of(b, kv, kv_buckets[0]) for b, kv in graphs_to_warm(buckets, kv_buckets, single_static=True)}
    reachable = {compile_of(b, kv, kv_buckets[0]) for b in buckets for kv in kv_buckets}
    assert reachable <= warmed, f"compiled while serving: {sorted(reachable - warmed, key=str)}"
    assert single_row_static(1, kv_buckets[0], kv_buckets[0]) and not single_row_static(2, kv_buckets[0], kv_buckets[0])
    if len(kv_buckets) > 1:
        assert not single_row_static(1, kv_buckets[1], kv_buckets[0])  # once per bucket would compile mid-serving


def meta_model(shape: str, gemm: str = "triton", gate_up: bool = True, tuned=None):
    from serving.bench.models import model_args
    from serving.engine.model import Transformer
    from serving.engine.options import EngineOptions
    from serving.engine.tuned_tables import TUNED_DIR, read_file

    with torch.device("meta"):
        model = Transformer(model_args(shape))
    model.options = EngineOptions(decode_gemm=gemm, decode_gate_up=gate_up,
                                  tuned=tuned or read_file(TUNED_DIR / "NVIDIA_H200.json"))
    return model


def test_a_model_whose_batch1_products_are_all_tuned_skips_the_static_compile(monkeypatch):
    """Llama-1B's batch-1 products all have tuned kernels (w13 through the gate/up kernel), so "auto"
    compiles its batch 1 dynamic; without the Triton GEMMs, the gate/up kernel or one table entry, static."""
    import dataclasses

    from serving.engine.tuned_tables import TUNED_DIR, read_file

    assert tuned_single_row(meta_model("llama-3.2-1b"))
    assert not tuned_single_row(meta_model("llama-3.2-1b", gemm="torch"))
    assert not tuned_single_row(meta_model("llama-3.2-1b", gate_up=False))  # no 1-row w13 in the skinny table
    assert not tuned_single_row(meta_model("tiny"))
    no_gate_up = dataclasses.replace(read_file(TUNED_DIR / "NVIDIA_H200.json"), gate_up={})
    assert not tuned_single_row(meta_model("llama-3.2-1b", tuned=no_gate_up))


@pytest.fixture(scope="module")
def float32_model(tmp_path_factory):
    """A tiny float32 engine of 4 slots and 512 positions, loaded on the CPU: its model."""
    tmp_path = tmp_path_factory.mktemp("float32")
    ckpt = convert_checkpoint(make_tiny_model(tmp_path / "hf"), tmp_path / "ckpt", dtype="float32")
    info = build_engine(ckpt, tmp_path / "engine", limits=EngineLimits(dtype="float32", max_batch_size=4,
                                                                     max_input_len=64, max_seq_len=512))
    return load_engine(info.path, device="cpu").model


def test_static_steps_compile_per_kv_length_and_dynamic_ones_do_not(float32_model):
    """What the policy rests on, with the step functions DecodeGraphs compiles (backend "eager": dynamo's
    guards and recompiles are the same as under inductor)."""
    model = float32_model
    compiled = {"static": torch.compile(_decode_step_single, dynamic=False, fullgraph=True, backend="eager"),
                "dynamic": torch.compile(decode_step_greedy, dynamic=True, fullgraph=True, backend="eager")}
    frames = {}
    for name, step in compiled.items():
        torch._dynamo.reset()
        counters.clear()
        for bsz in (1, 2):
            for kv_len in (128, 256, 384):
                step(model, torch.zeros(bsz, dtype=torch.long), torch.full((bsz,), 5), kv_len)
        frames[name] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert frames == {"static": 6, "dynamic": 2}


def test_the_dynamic_step_traces_batch_1_once(float32_model):
    """nn.Embedding's float `norm_type`, which dynamo traced as a tensor and then could not, restarted the step's
    first trace: one more trace of the whole step (and an AOTAutograd lookup that always missed) at every load."""
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")  # AOTAutograd runs the pass that failed on the float
    step = torch.compile(decode_step_greedy, dynamic=True, fullgraph=True, backend=backend)
    step(float32_model, torch.zeros(1, dtype=torch.long), torch.full((1,), 5), 128)
    torch._dynamo.reset()
    assert backend.frame_count == 1, f"{backend.frame_count} traces of one graph"


def test_the_step_compiled_by_layer_traces_one_layer_for_all_and_computes_the_plain_steps_logits():
    """The dynamic compile puts the step's start, one decode layer and the head under torch.compile on their
    own: dynamo traces eight graphs for a 6-layer model (the start's, the first layer's, with no residual from a
    layer before it, every other layer's and the head's, each at batch 1 and for the other batches), where a
    compile of the whole step traces every layer in each of its two, and the logits and tokens are the plain
    step's."""
    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=96, dim=32, n_layers=6, n_heads=4, n_kv_heads=2,
                     head_dim=8, intermediate_size=64, norm_eps=1e-5, max_position_embeddings=256)
    torch.manual_seed(0)
    model = Transformer(args).eval()
    model.setup_caches(4, 128)
    torch._dynamo.reset()
    counters.clear()
    step = partial(decode_step_greedy, parts=compiled_parts(None, backend="eager"))
    with torch.no_grad():
        for bsz in (1, 2, 3):
            tokens, pos = torch.arange(bsz) + 7, torch.arange(bsz) + 3
            logits, greedy = step(model, tokens, pos, 64)
            want_logits, want_greedy = decode_step_greedy(model, tokens, pos, 64)
            assert torch.equal(logits, want_logits) and torch.equal(greedy, want_greedy), f"batch {bsz}"
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 8


def tiny_bf16_engine(tmp_path):
    """A tiny bf16 engine of 4 slots, 64-token prompts and 512 positions (two KV buckets); its path."""
    ckpt = convert_checkpoint(make_tiny_model(tmp_path / "hf"), tmp_path / "ckpt", dtype="bfloat16")
    return build_engine(ckpt, tmp_path / "engine", limits=EngineLimits(dtype="bfloat16", max_batch_size=4,
                                                                     max_input_len=64, max_seq_len=512)).path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_after_the_warm_up_a_longer_context_compiles_nothing(tmp_path):
    runner = load_engine(tiny_bf16_engine(tmp_path), device="cuda")
    runner.compile_decode()
    assert runner.graphs.kv_buckets() == [256, 512]
    runner.graphs.warm_up()
    counters.clear()
    for bsz in (1, 3):
        runner.prefill([[0, 5, 6, 7]] * bsz, range(bsz))
        runner.decode(torch.full((bsz,), 5, device="cuda"), torch.full((bsz,), 300, device="cuda"), 301)
    assert counters["stats"]["unique_graphs"] == 0
    assert {(1, 512), (4, 512)} <= set(runner.graphs.graphs)


def test_pdl_is_an_inductor_setting_this_torch_has():
    assert compile_options(False) == {}
    with torch._inductor.config.patch(compile_options(True)):  # an unknown name raises AttributeError
        assert torch._inductor.config.triton.enable_pdl is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_step_with_pdl_decodes_as_without(tmp_path):
    path = tiny_bf16_engine(tmp_path)
    logits = []
    for pdl in (False, True):
        torch._dynamo.reset()
        runner = load_engine(path, device="cuda")
        runner.compile_decode(pdl=pdl)
        for bsz in (1, 3):
            runner.prefill([[0, 5, 6, 7]] * bsz, range(bsz))
            step = runner.decode(torch.full((bsz,), 5, device="cuda"), torch.full((bsz,), 4, device="cuda"), 5)
            logits.append(step.float().cpu().clone())
    for plain, with_pdl in zip(logits[:2], logits[2:]):  # coordinate-descent tuning may pick other tiles
        err = (plain - with_pdl).abs().max().item()
        assert err < 0.02 * max(plain.abs().max().item(), 1.0), f"max abs error {err}"
