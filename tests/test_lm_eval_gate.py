"""Standard evals as a gate (tasks/lm_eval_gate.py): the paired verdict, the shipped local task, and the real
gate on the example model (SmolLM2-135M-Instruct, float32, CPU) through Triton and the OpenAI front with
lm-evaluation-harness's own `local-completions` client (24 items, to keep CI's time): a rebuild of production's checkpoint passes with every
item answered alike; a degraded checkpoint (noise on its weights, as a regressed fine-tune) is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from gate_faults import degrade

from tasks.gate_specs import LmEvalGateSpec, LmEvalTaskSpec
from tasks.lm_eval_gate import (
    SHIPPED_TASKS,
    LmEvalResult,
    lm_eval_gate,
    local_task_folder,
    paired_verdict,
    render_report,
    score_items,
    served_engines,
    task_manager,
)

TASK = LmEvalTaskSpec(name="enginewright_capitals", limit=24, max_drop=0.05)


def limits():
    from serving.engine import EngineLimits

    return EngineLimits(dtype="float32", max_batch_size=4, max_input_len=128, max_seq_len=192)


def test_a_paired_verdict_fails_only_a_significant_drop_past_the_budget():
    same = paired_verdict(TASK, {i: float(i % 2) for i in range(40)}, {i: float(i % 2) for i in range(40)}, alpha=0.05)
    assert same.passed and same.difference == 0 and same.interval == (0.0, 0.0) and same.p_value == 1.0
    dropped = paired_verdict(TASK, {i: 0.0 for i in range(40)}, {i: float(i < 30) for i in range(40)}, alpha=0.05)
    assert not dropped.passed and dropped.difference == pytest.approx(-0.75) and dropped.p_value < 1e-6
    assert "drop of 0.750 > budget 0.05" in dropped.failure()
    one_item = paired_verdict(TASK, {i: float(i > 0) for i in range(40)}, {i: 1.0 for i in range(40)}, alpha=0.05)
    assert one_item.passed, "one item of 40 is within a 5-point budget"
    few = paired_verdict(TASK, {i: 0.0 for i in range(2)}, {i: 1.0 for i in range(2)}, alpha=0.05)
    assert few.items == 2 and few.difference == -1.0


def test_the_shipped_task_reads_its_data_beside_the_yaml(tmp_path):
    folder = local_task_folder(SHIPPED_TASKS, tmp_path / "tasks")
    config = yaml.safe_load((folder / "enginewright_capitals" / "enginewright_capitals.yaml").read_text())
    data = Path(config["dataset_kwargs"]["data_files"]["test"])
    assert data.is_absolute() and data.is_file() and len(data.read_text().splitlines()) == 80


def test_a_local_task_is_found_without_indexing_lm_evals_own_and_a_hub_task_with_them(tmp_path):
    pytest.importorskip("lm_eval")
    folder = local_task_folder(SHIPPED_TASKS, tmp_path / "tasks")
    assert task_manager(folder, "enginewright_capitals").all_tasks == ["enginewright_capitals"]
    assert "arc_easy" in task_manager(folder, "arc_easy").all_tasks  # named by a spec, found among lm-eval's


def test_no_task_or_no_production_is_skipped_and_said(tmp_path):
    assert "no lm-eval task" in lm_eval_gate(tmp_path, LmEvalGateSpec(), production_dir=None, work=tmp_path).skipped
    skipped = lm_eval_gate(tmp_path, LmEvalGateSpec(tasks=[TASK]), production_dir=None, skipped="first release",
                           work=tmp_path)
    assert skipped.passed and render_report(skipped).startswith("# Standard evals (lm-evaluation-harness): SKIPPED")


def build(checkpoint: Path, work: Path) -> Path:
    from serving.engine import build_engine, convert_checkpoint

    ckpt = convert_checkpoint(checkpoint, work / "ckpt", dtype="float32")
    build_engine(ckpt, work / "engine", limits=limits())
    return work / "engine"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_gate_passes_a_rebuild_and_refuses_a_degraded_checkpoint(smollm2_checkpoint, tmp_path_factory):
    """The three engines served at once, production scored once (what `lm_eval_gate` does for one candidate)."""
    pytest.importorskip("lm_eval")
    from serving.engine import build_engine

    production = build(smollm2_checkpoint, tmp_path_factory.mktemp("production"))
    rebuild = build_engine(production.parent / "ckpt", tmp_path_factory.mktemp("rebuild") / "engine",
                           limits=limits()).path
    worse = degrade(smollm2_checkpoint, tmp_path_factory.mktemp("degraded") / "smollm2", relative_noise=0.2)
    degraded = build(worse, tmp_path_factory.mktemp("degraded-engine"))
    engines = {"production": production, "rebuild": rebuild, "degraded": degraded}
    include = local_task_folder(SHIPPED_TASKS, tmp_path_factory.mktemp("tasks"))
    # no warm-up prefills at load: three engines' cold batches are CPU this test does not judge
    with served_engines(engines, tmp_path_factory.mktemp("gate") / "serving", parameters={"warmup": "false"}) as served:
        scores = {name: score_items(served, name, TASK, include, concurrency=4) for name in engines}

    passed = LmEvalResult([paired_verdict(TASK, scores["rebuild"], scores["production"], alpha=0.05)],
                          production_version="1")
    (verdict,) = passed.verdicts
    assert passed.passed and verdict.items == TASK.limit and verdict.difference == 0, render_report(passed)
    assert verdict.production >= 0.3, f"the example model knows capitals: {render_report(passed)}"

    refused = LmEvalResult([paired_verdict(TASK, scores["degraded"], scores["production"], alpha=0.05)],
                           production_version="1")
    report = render_report(refused)
    assert not refused.passed and refused.verdicts[0].difference < -0.05, report
    assert report.startswith("# Standard evals (lm-evaluation-harness) against production: FAILED"), report
    assert "enginewright_capitals: exact_match" in refused.failures[0]
