"""The torch engine on CUDA: equals the CPU engine (float32, decode steps under CUDA graphs; the mixtures of experts
through the grouped expert kernels there, the loop over experts on the CPU), bf16 agrees with
HF bf16, the scheduler on CUDA.

Runs only where CUDA is present (the lead's H200 run); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from serving.engine import EngineLimits, build_engine, convert_checkpoint, load_engine
from tasks.tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPTS = [[0, 5, 6, 7], [0, 9, 10, 11, 12, 13, 14, 15], [0, 100]]


def engine(tmp_path, dtype: str, arch: str = "llama"):
    hf = make_tiny_model(tmp_path / f"hf-{arch}", arch=arch)
    ckpt = convert_checkpoint(hf, tmp_path / f"ckpt-{dtype}", dtype=dtype)
    limits = EngineLimits(dtype=dtype, max_batch_size=4, max_input_len=64, max_seq_len=128)
    return hf, build_engine(ckpt, tmp_path / f"engine-{dtype}", limits=limits)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "mixtral", "qwen3-moe"])
def test_cuda_matches_cpu_float32(tmp_path, arch):
    _, info = engine(tmp_path, "float32", arch)
    cpu, gpu = load_engine(info.path, device="cpu"), load_engine(info.path, device="cuda")
    assert gpu.device.type == "cuda" and info.toolchain["compute_capability"] != "cpu"
    prompt = list(range(3, 100))
    err = (cpu.prefill_logits(prompt) - gpu.prefill_logits(prompt)).abs()
    print(f"{arch} cuda vs cpu float32 logits: max {err.max():.2e} mean {err.mean():.2e}")
    assert err.max() < 1e-2  # TF32 matmuls may be on
    a = [g.token_ids for g in cpu.generate(PROMPTS, max_new_tokens=16)]
    b = [g.token_ids for g in gpu.generate(PROMPTS, max_new_tokens=16)]
    assert a == b


def test_bf16_close_to_hf_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir, info = engine(tmp_path, "bfloat16")
    runner = load_engine(info.path, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda().eval()
    prompt = list(range(3, 100))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
    got = runner.prefill_logits(prompt)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    print(f"bf16: max abs err {(ref - got).abs().max():.3f}, top-1 agreement {agree:.3f}")
    assert agree > 0.95


def test_scheduler_on_cuda_equals_generate(tmp_path):
    """In-flight batching on CUDA (graphs, tokens one step ahead of the host, pinned copies + events):
    more requests than slots, a stop token mid-flight, max_tokens=1; float32 so tokens compare exactly."""
    from serving.engine.scheduler import Scheduler, collect

    _, info = engine(tmp_path, "float32")
    runner = load_engine(info.path, device="cuda")
    prompts = PROMPTS + [[0, 42, 283], [0, 7], [0, 1, 2, 3, 4, 5]]
    max_tokens = [12, 9, 1, 16, 7, 10]
    ref = [g.token_ids for g in runner.generate(prompts, max_new_tokens=16)]
    stop = ref[0][4]
    got = collect(Scheduler(runner), prompts, max_tokens=max_tokens, stop_token_ids=[stop])
    for full, n, (ids, reason) in zip(ref, max_tokens, got):
        full = full[:n]
        want = full[: full.index(stop) + 1] if stop in full else full
        assert ids == want and reason == ("stop" if stop in full else "length")
