"""The quality gate (`tasks.validate.validate_engine`, called directly) on the tiny Gemma 3 checkpoint, float32:
the clean engine passes; an engine of seeded conversion bugs is refused: Gemma's norms scaling by `w` instead of
`1 + w` (every norm weight stored one lower: the same numbers), and a sliding window read wrong (twice the
checkpoint's, recorded in the engine). One HF float32 reference judges all three."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gate_faults import edited_runner

from serving.engine import build_engine, convert_checkpoint
from serving.engine.build import EngineLimits
from serving.engine.kv_cache import KVCacheConfig
from tasks.evaluation import load_evaluation
from tasks.tiny_model import SLIDING_WINDOW, make_tiny_model
from tasks.validate import ValidationSpec, reference_run, validate_engine

LIMITS = EngineLimits(dtype="float32", max_batch_size=2, max_input_len=64, max_seq_len=96)
KV = KVCacheConfig(block_size=16, max_num_tokens=32)
SPEC = ValidationSpec(prompts=["The quick brown fox jumps over the lazy dog. A small engine", "Once upon a time"],
                      max_new_tokens=16, passages=list(load_evaluation().passages[:2]))


def _engine(hf_dir: Path, work: Path, name: str) -> Path:
    checkpoint = convert_checkpoint(hf_dir, work / f"ckpt-{name}", dtype="float32")
    engine = Path(build_engine(checkpoint, work / f"engine-{name}", limits=LIMITS, kv_cache=KV).path)
    shutil.rmtree(checkpoint)
    return engine


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    work = tmp_path_factory.mktemp("gates-gemma3")
    hf_dir = make_tiny_model(work / "hf", arch="gemma3")
    engine = _engine(hf_dir, work, "clean")
    reference = reference_run(hf_dir, SPEC, "float32", max_seq_len=LIMITS.max_seq_len,
                              max_input_len=LIMITS.max_input_len)
    return hf_dir, engine, reference, work


def test_the_clean_gemma3_engine_passes(gemma):
    hf_dir, engine, reference, _ = gemma
    result = validate_engine(engine, hf_dir, SPEC, reference=reference)
    assert result.passed, result.failures
    assert max(map(len, reference.prompt_ids)) > SLIDING_WINDOW  # the envelope's long prompts pass the window


def _without_one_plus(tensors: dict[str, torch.Tensor], args: dict) -> None:
    """Every Gemma norm weight one lower: what a model scaling by `w` instead of `1 + w` computes."""
    for name in [n for n in tensors if n.endswith("norm.weight")]:
        tensors[name] = tensors[name] - 1.0


def test_gemma_norms_without_one_plus_are_refused(gemma):
    hf_dir, engine, reference, _ = gemma
    result = validate_engine(engine, hf_dir, SPEC, reference=reference,
                             runner=edited_runner(engine, _without_one_plus))
    assert not result.passed
    assert any(f.startswith("mean per-token KL(reference || engine) ") for f in result.failures), result.failures


def test_a_sliding_window_read_wrong_is_refused(gemma):
    hf_dir, _, reference, work = gemma
    wrong = work / "hf-wrong-window"  # the checkpoint converted as if its config said twice the window
    shutil.copytree(hf_dir, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "sliding_window": 2 * SLIDING_WINDOW}))
    engine = _engine(wrong, work, "wrong-window")
    result = validate_engine(engine, hf_dir, SPEC, reference=reference)
    assert not result.passed
    assert any(f.startswith("mean per-token KL(reference || engine) ") for f in result.failures), result.failures
