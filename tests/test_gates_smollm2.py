"""The quality gates on the real example model (SmolLM2-135M-Instruct, on the CPU), called directly: another
tokenizer in the engine folder is refused; a quantized engine (fp8, int8 weight-only) is judged against HF with
the same weights quantized: it passes, swapped heads or scales 10% off are refused. Each report names the
measure and its limit.

The verdicts on clean float32 and bfloat16 engines, weights rounded to int8, swapped heads, a dropped layer and
a checkpoint that regressed against production are proven through the whole release flow (Prefect, MLflow,
Triton) by tests/test_release_smollm2.py. One HF float32 reference (two prompts, three passages: the spec's
own fields trim them) judges every engine here."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from gate_faults import edited_runner, misscale, swap_heads, swap_tokenizer_ids

from serving.engine import build_engine, convert_checkpoint, load_engine
from serving.engine.build import EngineLimits
from tasks.evaluation import load_evaluation
from tasks.validate import ReferenceRun, ValidationSpec, reference_run, validate_engine

pytestmark = pytest.mark.slow

LIMITS = EngineLimits(dtype="float32", max_batch_size=2, max_input_len=128, max_seq_len=192)
SPEC = ValidationSpec(prompts=["The capital of France is", "def fibonacci(n):"], max_new_tokens=8,
                      passages=list(load_evaluation().passages[:3]))


@dataclass(frozen=True)
class Smol:
    hf: Path
    engine: Path
    runner: object
    reference: ReferenceRun
    work: Path


@pytest.fixture(scope="module")
def smol(smollm2_checkpoint, tmp_path_factory) -> Smol:
    work = tmp_path_factory.mktemp("gates-smollm2")
    checkpoint = convert_checkpoint(smollm2_checkpoint, work / "ckpt", dtype="float32")
    engine = Path(build_engine(checkpoint, work / "engine", limits=LIMITS).path)
    shutil.rmtree(checkpoint)  # the engine folder holds its own copy of every file
    reference = reference_run(smollm2_checkpoint, SPEC, "float32", max_seq_len=LIMITS.max_seq_len)
    return Smol(smollm2_checkpoint, engine, load_engine(engine), reference, work)


def test_another_tokenizer_in_the_engine_folder_is_refused(smol):
    folder = smol.work / "engine-tokenizer"
    shutil.copytree(smol.engine, folder, copy_function=os.link)  # weights shared; the tokenizer a copy of its own
    (folder / "tokenizer.json").unlink()
    shutil.copyfile(smol.engine / "tokenizer.json", folder / "tokenizer.json")
    swap_tokenizer_ids(folder)
    result = validate_engine(folder, smol.hf, SPEC, reference=smol.reference, runner=smol.runner)
    assert not result.passed
    assert any(f.startswith("tokenizer file tokenizer.json: engine folder ") and "!= checkpoint" in f
               for f in result.failures), result.failures
    assert any("texts tokenize differently as Triton serves them" in f for f in result.failures), result.failures


@pytest.mark.parametrize("method", ["fp8", "int8-weight-only"])
def test_a_quantized_engine_is_judged_against_a_quantized_peer(smol, method):
    """fp8's own cost on this model (KL ~0.026, top-1 disagreement ~0.1) is far beyond the float32 floors and
    near a swapped head's: the quantized peer carries that cost, so only what the engine adds counts."""
    from serving.engine.quantize import QuantInfo

    checkpoint = convert_checkpoint(smol.hf, smol.work / f"ckpt-{method}", dtype="float32",
                                    quantization=QuantInfo(method))
    engine = Path(build_engine(checkpoint, smol.work / f"engine-{method}", limits=LIMITS).path)
    shutil.rmtree(checkpoint)
    reference = reference_run(smol.hf, SPEC, f"float32+{method}", max_seq_len=LIMITS.max_seq_len, base=smol.reference)
    clean = validate_engine(engine, smol.hf, SPEC, reference=reference)
    assert clean.passed and clean.precision == f"float32+{method}", clean.failures
    assert clean.peer is not None and clean.peer.mean_kl > 1e-3  # the quantization's cost is the peer's
    swapped = validate_engine(engine, smol.hf, SPEC, reference=reference, runner=edited_runner(engine, swap_heads(0)))
    assert not swapped.passed
    assert any(f.startswith("mean per-token KL(reference || engine) ") for f in swapped.failures), swapped.failures
    misscaled = validate_engine(engine, smol.hf, SPEC, reference=reference, runner=edited_runner(engine, misscale(1.1)))
    assert not misscaled.passed and any(f.startswith("mean per-token KL(reference || engine) ")
                                        for f in misscaled.failures), misscaled.failures


def test_a_paged_engine_with_an_fp8_kv_cache_passes_its_budget_and_kv_stored_too_large_is_refused(smol):
    """The paged engine with e4m3 K/V (float32 base) judged as `float32+fp8-kv` against a peer over rounded
    K/V: it passes; the same engine whose K/V are written 25% too large (a wrong scale on write) is refused
    by the per-token KL, which reads the pool past each prompt's first block."""
    from unittest import mock

    from serving.engine import kv_cache
    from serving.engine.kv_cache import KVCacheConfig
    from serving.engine.runner import load_engine

    checkpoint = convert_checkpoint(smol.hf, smol.work / "ckpt-kv", dtype="float32")
    config = KVCacheConfig(block_size=16, num_blocks=24, max_num_tokens=256, kv_cache_dtype="fp8")
    engine = Path(build_engine(checkpoint, smol.work / "engine-fp8-kv", limits=LIMITS, kv_cache=config).path)
    shutil.rmtree(checkpoint)
    reference = reference_run(smol.hf, SPEC, "float32+fp8-kv", max_seq_len=LIMITS.max_seq_len, base=smol.reference)
    clean = validate_engine(engine, smol.hf, SPEC, reference=reference)
    print(f"fp8 KV on SmolLM2: KL {clean.engine.mean_kl:.4f}, peer {clean.peer.mean_kl:.4f}, limits {clean.thresholds}")
    assert clean.passed and clean.precision == "float32+fp8-kv", clean.failures
    store = kv_cache.to_kv_fp8
    with mock.patch.object(kv_cache, "to_kv_fp8", lambda x: store(x * 1.25)):
        wrong = validate_engine(engine, smol.hf, SPEC, reference=reference, runner=load_engine(engine))
    print(f"K/V written 25% too large: KL {wrong.engine.mean_kl:.4f}")
    assert not wrong.passed
    assert any(f.startswith("mean per-token KL(reference || engine) ") for f in wrong.failures), wrong.failures
