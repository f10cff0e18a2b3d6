"""The torch engine against Hugging Face transformers (the reference), float32 on CPU.

Tiny random models from `tasks.tiny_model` with a large init spread: top-1 margins are far above
float32 error, so greedy comparisons are well defined.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_rounding import hf_rounding, within_rounding
from transformers import AutoModelForCausalLM

from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
from tasks.tiny_model import PAD_ID, make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "llama3-rope", "llama-tied", "qwen3", "phi3", "mixtral", "qwen3-moe",
         "mistral-window", "gemma3"]
LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=200, max_seq_len=256)
PROMPTS = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [0, 100], [0, 42, 283, 78, 81, 265]]


@pytest.fixture(scope="module", params=ARCHS)
def models(request, tmp_path_factory) -> tuple[str, object, object]:
    """(arch, HF reference model, engine runner) for one tiny architecture."""
    arch = request.param
    root: Path = tmp_path_factory.mktemp(arch)
    hf_dir = make_tiny_model(root / "hf", arch=arch, seed=ARCHS.index(arch))
    ckpt = convert_checkpoint(hf_dir, root / "ckpt", dtype="float32")
    info = build_engine(ckpt, root / "engine", limits=LIMITS)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return arch, hf, load_engine(info.path, device="cpu")


def hf_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF greedy `generate` on a left-padded batch; never stops early (eos disabled)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=PAD_ID)
    return out[:, width:].tolist()


def test_prefill_logits_match_hf(models):
    arch, hf, runner = models
    prompt = list(range(3, 3 + 180))  # past the llama3 original context (64) so every rope band matters
    ref, rounding = hf_rounding(hf, prompt)
    got = runner.prefill_logits(prompt)
    err = (ref - got).abs()
    print(f"{arch}: logits max abs err {err.max().item():.3e} (HF float32 from float64: {rounding:.3e}), "
          f"mean {err.mean().item():.3e}, logit scale {ref.abs().mean().item():.2f}")
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert within_rounding(got, ref, rounding)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_batch_matches_hf_generate_and_single_prompts(models):
    arch, hf, runner = models
    n = 24
    ref = hf_greedy(hf, PROMPTS, n)
    gens = runner.generate(PROMPTS, max_new_tokens=n)
    got = [g.token_ids for g in gens]
    for i, (r, g) in enumerate(zip(ref, got)):
        assert r == g, f"{arch} prompt {i}: hf={r}\nengine={g}"
    assert all(g.finish_reason == "length" and len(g.logprobs) == n for g in gens)
    alone = [runner.generate([p], max_new_tokens=n)[0].token_ids for p in PROMPTS]
    assert alone == got
    assert len({tuple(g) for g in got}) == len(got), "distinct prompts should give distinct continuations"
    assert all(len(set(g)) > n // 4 for g in got), f"degenerate (repeating) generations: {got}"


def test_logprobs_are_raw_model_logprobs(models):
    _, _, runner = models
    prompt = PROMPTS[1]
    gen = runner.generate([prompt], max_new_tokens=6, top_logprobs=3)[0]
    logits = runner.prefill_logits(prompt + gen.token_ids[:-1])  # teacher-forced over the generation
    lp = torch.log_softmax(logits[len(prompt) - 1:], dim=-1)  # [6, V]
    expected = lp.gather(-1, torch.tensor(gen.token_ids).unsqueeze(-1)).squeeze(-1)
    # (rtol: a mixture of experts multiplies each expert's tokens as one GEMM whose row count differs between the
    # decode steps and the teacher-forced prefill, so float32 rounding differs a little more than a dense model's)
    assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=1e-4)
    for t, top in enumerate(gen.top_logprobs):
        assert len(top) == 3 and gen.token_ids[t] == max(top, key=top.get)  # greedy = top-1
        assert max(top.values()) == pytest.approx(gen.logprobs[t], abs=1e-5)
