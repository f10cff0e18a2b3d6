"""Greedy tokens of the engine equal the golden tokens recorded from the retired static engine (float32, CPU).

`tests/golden/static_tokens.json` holds, for the tiny models of `tasks.tiny_model` (three architectures) and the
example model SmolLM2-135M-Instruct, the greedy continuations the static KV-cache engine (`runner.EngineRunner`
at commit aa3684c) gave for fixed prompts: single prompts, one long prompt and a batch of unequal lengths. The
engine of today (one runtime, paged KV cache) must reproduce them token for token.

Regenerate (only on purpose: the file is the reference the runtime is held to) with the engine whose tokens are
the reference, from the repository root:

    .venv/bin/python -m tests.test_golden_tokens
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from serving.engine import EngineLimits, build_engine, convert_checkpoint
from tasks.tiny_model import make_tiny_model

GOLDEN = Path(__file__).parent / "golden" / "static_tokens.json"
TINY_ARCHS = ("llama", "qwen2", "llama-tied")
TINY_LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=200, max_seq_len=256)
SMOLLM2_LIMITS = EngineLimits(dtype="float32", max_batch_size=4, max_input_len=300, max_seq_len=384)
MAX_NEW_TOKENS = 16


def prompt_sets(vocab: int, long_len: int) -> dict[str, list[list[int]]]:
    """Named prompt batches: one token, a short prompt, one long prompt, and four prompts of unequal lengths."""
    rnd = random.Random(47)
    draw = lambda n: [rnd.randrange(3, vocab) for _ in range(n)]  # ids past the special tokens
    return {
        "one_token": [[0]],
        "short": [[0, 5, 6, 7, 8]],
        "long": [draw(long_len)],
        "unequal_batch": [draw(3), draw(17), draw(1), draw(40)],
    }


def load_runner(engine_dir: Path) -> Any:
    """The engine as every consumer loads it."""
    from serving.engine.runner import load_engine

    return load_engine(engine_dir, device="cpu")


def tiny_engine(root: Path, arch: str) -> Path:
    ckpt = convert_checkpoint(make_tiny_model(root / f"hf-{arch}", arch=arch), root / f"ckpt-{arch}", dtype="float32")
    return build_engine(ckpt, root / f"engine-{arch}", limits=TINY_LIMITS).path


def smollm2_engine(root: Path, checkpoint: Path) -> Path:
    ckpt = convert_checkpoint(checkpoint, root / "ckpt-smollm2", dtype="float32")
    return build_engine(ckpt, root / "engine-smollm2", limits=SMOLLM2_LIMITS).path


def greedy(runner: Any, prompts: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    return {name: [g.token_ids for g in runner.generate(batch, max_new_tokens=MAX_NEW_TOKENS, logprobs=False)]
            for name, batch in prompts.items()}


def record(root: Path, smollm2_checkpoint: Path) -> dict[str, Any]:
    """Prompts and greedy tokens of every model, from the engine loaded here."""
    out: dict[str, Any] = {}
    for arch in TINY_ARCHS:
        prompts = prompt_sets(512, TINY_LIMITS.max_input_len)
        out[f"tiny-{arch}"] = {"prompts": prompts, "tokens": greedy(load_runner(tiny_engine(root, arch)), prompts)}
    prompts = prompt_sets(49152, SMOLLM2_LIMITS.max_input_len)
    out["smollm2"] = {"prompts": prompts, "tokens": greedy(load_runner(smollm2_engine(root, smollm2_checkpoint)),
                                                           prompts)}
    return out


def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def assert_tokens_equal(*, want: dict[str, list[list[int]]], got: dict[str, list[list[int]]], model: str) -> None:
    for name, rows in want.items():
        for i, (ref, new) in enumerate(zip(rows, got[name], strict=True)):
            if ref != new:
                at = next((k for k, (a, b) in enumerate(zip(ref, new)) if a != b), min(len(ref), len(new)))
                pytest.fail(f"{model} {name}[{i}] diverged at token {at}:\n  golden={ref}\n  engine={new}")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_reproduces_golden_static_tokens(arch, tmp_path):
    case = golden()[f"tiny-{arch}"]
    got = greedy(load_runner(tiny_engine(tmp_path, arch)), case["prompts"])
    assert_tokens_equal(want=case["tokens"], got=got, model=f"tiny-{arch}")


def test_smollm2_reproduces_golden_static_tokens(smollm2_checkpoint, tmp_path):
    case = golden()["smollm2"]
    got = greedy(load_runner(smollm2_engine(tmp_path, smollm2_checkpoint)), case["prompts"])
    assert_tokens_equal(want=case["tokens"], got=got, model="smollm2")


if __name__ == "__main__":
    import tempfile

    from tasks.example_model import make_example_model

    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.write_text(json.dumps(record(Path(tmp), make_example_model()), separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")
