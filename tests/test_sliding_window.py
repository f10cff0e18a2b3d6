"""Sliding-window attention (Mistral's window on every layer; Gemma 3's local layers between global ones, each kind
with its own rope) through the served paths, against Hugging Face in float32 on the CPU.

The engines run with small blocks (16 positions) and a step budget of 16 tokens, so a prompt longer than that is
split into a first chunk from position 0 (the banded SDPA) and later chunks over the cache (the banded mask),
while other requests decode in the same steps (single-token rows through `paged_attention`, the window's mask),
and decode-only steps run through `cuda_graphs.DecodeGraphs` (eagerly on the CPU). Prompts and generations are
longer than the tiny checkpoints' window (`tasks.tiny_model.SLIDING_WINDOW`). The same engine with its windows
taken away no longer matches: the comparisons see the window.

On CUDA (`gpu`): the same engines on the GPU, decode steps under CUDA graphs and the Triton kernel's window mask,
against the CPU engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_rounding import hf_rounding, within_rounding
from transformers import AutoModelForCausalLM

from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
from serving.engine.errors import UnsupportedArchitectureError
from serving.engine.kv_cache import KVCacheConfig
from serving.engine.models.registry import model_args_of
from tasks.tiny_model import PAD_ID, SLIDING_WINDOW, make_tiny_model

ARCHS = ["mistral-window", "gemma3"]
LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=64, max_seq_len=96)
KV = KVCacheConfig(block_size=16, max_num_tokens=16)
PROMPTS = [list(range(5, 5 + n)) for n in (20, 45, 7, 31)]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=ARCHS)
def windowed(request, tmp_path_factory) -> tuple[str, Path, object, object]:
    """(arch, HF folder, HF model, engine runner) of one windowed tiny checkpoint."""
    arch = request.param
    root: Path = tmp_path_factory.mktemp(arch)
    hf_dir = make_tiny_model(root / "hf", arch=arch)
    info = build_engine(convert_checkpoint(hf_dir, root / "ckpt", dtype="float32"), root / "engine", limits=LIMITS,
                        kv_cache=KV)
    assert info.model.sliding_window == SLIDING_WINDOW < LIMITS.max_seq_len  # no longer refused by the build
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return arch, hf_dir, hf, load_engine(info.path, device="cpu")


def hf_greedy(hf, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=PAD_ID)
    return out[0, len(prompt):].tolist()


def test_chunked_prompts_and_decodes_past_the_window_give_hf_greedy_tokens(windowed):
    arch, _, hf, runner = windowed
    got = [g.token_ids for g in runner.generate(PROMPTS, max_new_tokens=NEW_TOKENS)]
    for i, prompt in enumerate(PROMPTS):
        want = hf_greedy(hf, prompt)
        assert got[i] == want, f"{arch} prompt {i} ({len(prompt)} tokens):\nhf=    {want}\nengine={got[i]}"
    assert all(len(set(g)) > NEW_TOKENS // 4 for g in got), f"degenerate (repeating) generations: {got}"


def test_prefill_and_reference_forward_equal_hf_and_the_window_matters(windowed):
    arch, _, hf, runner = windowed
    prompt = list(range(3, 3 + 60))
    want, rounding = hf_rounding(hf, prompt)
    with torch.no_grad():
        forward = runner.model.logits(runner.model(torch.tensor([prompt])))[0]
    got = runner.prefill_logits(prompt)
    err = (got - want).abs().max().item()
    print(f"{arch}: prefill logits max abs err {err:.2e} (HF float32 from float64: {rounding:.2e}), "
          f"reference forward {(forward - want).abs().max():.2e}")
    assert within_rounding(got, want, rounding) and within_rounding(forward, want, rounding)
    args = runner.model.args
    wide = LIMITS.max_seq_len  # windows that cover every position: the same layers and ropes, nothing masked
    runner.model.args = dataclasses.replace(args, sliding_window=wide, layer_windows=tuple(  # the steps read it
        None if w is None else wide for w in args.layer_windows))
    try:
        unwindowed = runner.prefill_logits(prompt)
    finally:
        runner.model.args = args
    assert within_rounding(unwindowed[:SLIDING_WINDOW], want[:SLIDING_WINDOW], rounding)
    assert (unwindowed[SLIDING_WINDOW:] - want[SLIDING_WINDOW:]).abs().max() > 1e-2


def test_gemma3_in_bfloat16_follows_hf_bfloat16(tmp_path):
    """Gemma's numerics in the model dtype as HF has them: norms in float32 times (1 + w), the embedding scale
    rounded to the dtype. (HF bf16 is tens of logits away from HF float32 on this peaked tiny model.)"""
    hf_dir = make_tiny_model(tmp_path / "hf", arch="gemma3")
    info = build_engine(convert_checkpoint(hf_dir, tmp_path / "ckpt", dtype="bfloat16"), tmp_path / "engine",
                        limits=dataclasses.replace(LIMITS, dtype="bfloat16"), kv_cache=KV)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    prompt = list(range(3, 3 + 40))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    got = load_engine(info.path, device="cpu").prefill_logits(prompt)
    err = (got - want).abs().max().item()
    print(f"gemma3 bf16: engine vs HF bf16 max abs err {err:.3e}, logit scale {want.abs().mean():.1f}")
    assert err < 0.25 and torch.equal(got.argmax(-1), want.argmax(-1))


def test_config_readers_give_each_layer_its_window_and_rope():
    base = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 4,
            "intermediate_size": 64, "max_position_embeddings": 256}
    mistral = model_args_of({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 8})
    assert [mistral.window(i) for i in range(4)] == [8] * 4 and not mistral.local_rope(0)
    qwen2 = model_args_of({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                           "sliding_window": 8, "max_window_layers": 2})
    assert [qwen2.window(i) for i in range(4)] == [None, None, 8, 8]  # transformers' rule: layers >= max_window_layers
    gemma = {**base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "sliding_window": 8,
             "head_dim": 16, "query_pre_attn_scalar": 64, "sliding_window_pattern": 2, "rope_theta": 1e6,
             "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    args = model_args_of(gemma)  # an older config: the pattern, rope_theta + rope_scaling + rope_local_base_freq
    assert args.layer_windows == (8, None, 8, None) and args.tie_word_embeddings
    assert (args.rope_theta, args.rope_type, args.rope_factor, args.local_rope_theta) == (1e6, "linear", 8.0, 1e4)
    assert args.softmax_scale == 64 ** -0.5 and args.local_rope(0) and not args.local_rope(1)
    for option, value, named in (("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
                                 ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
                                 ("hidden_activation", "relu", "hidden_activation='relu'"),
                                 ("layer_types", ["chunked_attention"] * 4, "['chunked_attention']")):
        with pytest.raises(UnsupportedArchitectureError, match=named.replace("[", r"\[")):
            model_args_of({**gemma, option: value})


def test_the_fp8_kv_peer_of_the_gate_keeps_the_window(windowed):
    """`tasks.validate.round_hf_kv_cache` (HF over e4m3-rounded K/V, the peer of an fp8-KV engine) under its own
    attention name still masks each sliding layer's window: transformers builds no mask for a name it does not
    know, which would have let every key through."""
    from tasks.validate import round_hf_kv_cache

    _, hf_dir, _, _ = windowed
    prompt = torch.tensor([list(range(3, 3 + 40))])
    logits = []
    for window in (SLIDING_WINDOW, LIMITS.max_seq_len):
        peer = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, sliding_window=window).eval()
        round_hf_kv_cache(peer, "fp8")
        with torch.no_grad():
            logits.append(peer(prompt).logits[0])
    assert torch.equal(logits[0][:SLIDING_WINDOW], logits[1][:SLIDING_WINDOW])
    assert (logits[0][SLIDING_WINDOW:] - logits[1][SLIDING_WINDOW:]).abs().max() > 1e-2


def test_blocks_out_of_every_layers_window_go_back_to_the_pool_but_the_row_key():
    from serving.engine.kv_cache import BlockAllocator
    from serving.engine.kv_cache_manager import KVCacheManager, RequestBlocks

    kv = KVCacheManager(BlockAllocator(10), block_size=4, window=6)
    seq = RequestBlocks()
    kv.admit(seq, 12)  # blocks 0-2
    kv.slide(seq, 12)  # a query at 12 sees keys 7..12: block 0 (0-3) is out, but it is the row key
    assert kv.free == 7 and seq.slid == 1
    assert kv.grow(seq, 20) and kv.free == 5
    kv.slide(seq, 20)  # keys 15..20: blocks 1 (4-7) and 2 (8-11) out
    assert kv.free == 7 and seq.table == [0, 1, 2, 3, 4] and seq.slid == 3
    kv.release(seq)  # the row key and blocks 3, 4; none twice
    assert kv.free == 10 and seq.table == []
    assert not KVCacheManager(BlockAllocator(4), block_size=4).window  # a model with a global layer: none slide


def test_a_windowed_engine_serves_in_the_blocks_of_its_windows(windowed):
    """Mistral's window on every layer: two requests of 80-odd positions each (6 blocks each when held whole) in a
    pool of 8 blocks run side by side without preemption, their blocks out of the window given back as they
    go; held whole (no window given to the manager), the same requests preempt. Tokens: HF's either way."""
    from serving.engine.scheduler import Scheduler, collect

    arch, _, hf, runner = windowed
    if runner.info.model.kv_window is None:
        pytest.skip(f"{arch} has global layers: every block stays read")
    prompts = [PROMPTS[0], PROMPTS[3]]
    new_tokens = LIMITS.max_seq_len - len(PROMPTS[3]) - 1
    small = load_engine(runner.info.path, device="cpu", config=dataclasses.replace(KV, num_blocks=8))
    want = [hf_greedy(hf, p, new_tokens) for p in prompts]
    preempted = []
    for window in (small.info.model.kv_window, None):
        sched = Scheduler(small)
        sched.kv.window = window
        got = collect(sched, prompts, max_tokens=new_tokens)
        assert [ids for ids, _ in got] == want
        assert small.allocator.free == small.num_blocks
        preempted.append(sched.stats.preempted)
    assert preempted[0] == 0 < preempted[1], preempted


def test_a_step_without_the_local_rope_tables_is_refused(windowed):
    """A model whose windowed layers rotate by their own rope, stepped without those tables: an error naming the
    layer, never the global rope silently."""
    arch, _, _, runner = windowed
    if arch != "gemma3":
        pytest.skip("only Gemma 3 has a local rope")
    from serving.engine.step import build_step, paged_forward

    blocks = runner.allocator.take(1)
    try:
        step = build_step([([3, 4, 5], 0, blocks)], [0], KV.block_size, runner.device)
        with pytest.raises(ValueError, match="layer 0 of Gemma3ForCausalLM rotates by the local rope"):
            paged_forward(runner.model, step, runner.cache, runner.rope_cos, runner.rope_sin)
    finally:
        runner.allocator.give_back(blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_and_the_kernels_window_equal_the_cpu_engine(windowed):
    _, _, _, cpu = windowed
    gpu = load_engine(cpu.info.path, device="cuda")
    want = [g.token_ids for g in cpu.generate(PROMPTS, max_new_tokens=NEW_TOKENS)]
    assert [g.token_ids for g in gpu.generate(PROMPTS, max_new_tokens=NEW_TOKENS)] == want
    prompt = list(range(3, 63))
    want_logits = cpu.prefill_logits(prompt)
    # TF32 matmuls and the kernels' tf32 dots: about 1e-3 of the logits' scale (Gemma's reach 72, Mistral's 16)
    assert (want_logits - gpu.prefill_logits(prompt).cpu()).abs().max() < 1e-3 * want_logits.abs().max()
