"""No false refusal of another good checkpoint by the fixed evaluation: the tiny model's checkpoint with noise of
0.0005 x each matrix's std (a fine-tune that changed little) passes every part against production of its own
precision, and the noise fault of tests/test_gates_evidence.py (0.004 x std) is still refused.

- float32, the default spec: before greedy ties (`evaluation.greedy_tie_gap`) one such checkpoint in five was
  refused (greedy 0.128, interval [0.029, 0.226] against 0.20); the one here read 0.062 [-0.006, 0.131] and now
  reads 0.029.
- bfloat16: on this random model bf16 rounding alone changes ~5% of argmaxes and ~20% of greedy tokens beyond
  any tie (docs/gates.md), so a bf16 release of it declares its greedy budget (0.35; SmolLM2, a real model,
  passes the default); top-1 still refuses the fault.
The whole sweep (more checkpoints, SmolLM2, every tie gap): bench/evidence_sweep.py, figures in docs/gates.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from gate_faults import degrade

from serving.engine import build_engine, convert_checkpoint
from serving.engine.build import EngineLimits
from tasks.evaluation import evaluate_engines
from tasks.gate_specs import EvaluationSpec
from tasks.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

SPECS = {"float32": EvaluationSpec(), "bfloat16": EvaluationSpec(max_greedy_disagreement=0.35)}


def build(hf: Path, out: Path, dtype: str) -> Path:
    converted = convert_checkpoint(hf, out.with_name(out.name + "-ckpt"), dtype=dtype)
    limits = EngineLimits(dtype=dtype, max_batch_size=4, max_input_len=64, max_seq_len=128)
    return Path(build_engine(converted, out, limits=limits).path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("good-checkpoints")
    hf = make_tiny_model(root / "hf", seed=0)
    return {"root": root, "production": hf, "good": degrade(hf, root / "hf-good", relative_noise=0.0005, seed=1),
            "noisy": degrade(hf, root / "hf-noisy", relative_noise=0.004)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_another_good_checkpoint_passes_and_the_noise_fault_is_refused(checkpoints, dtype):
    root = checkpoints["root"]
    production = build(checkpoints["production"], root / f"{dtype}-production", dtype)
    good = build(checkpoints["good"], root / f"{dtype}-good", dtype)
    result = evaluate_engines(good, SPECS[dtype], production_dir=production, production_version="1")
    assert result.passed, [p.text for p in result.parts if p.failed]
    assert next(p for p in result.parts if p.name == "greedy").units == 48

    noisy = build(checkpoints["noisy"], root / f"{dtype}-noisy", dtype)
    refused = evaluate_engines(noisy, SPECS[dtype], production_dir=production, production_version="1")
    assert not refused.passed
    assert {p.name for p in refused.parts if p.failed} & {"top1", "greedy"}, [p.text for p in refused.parts]
