"""lm-evaluation-harness (`lm_eval --model local-completions`) against `enginewright serve` on the tiny float32
model, beside lm-eval's own `hf` backend: a multiple-choice likelihood task and a generation task in lm-eval's own
format over local files score the same, item by item (the full run on the example model: docs/serving-clients.md)."""

from __future__ import annotations

import pytest

from serving.bench.lm_eval_check import check

pytestmark = pytest.mark.slow


def test_lm_eval_scores_served_as_its_hf_backend_does(tmp_path):
    from tasks.tiny_model import make_tiny_model

    checkpoint = make_tiny_model(tmp_path / "hf")
    report = check(checkpoint, tmp_path / "run", mc_items=12, gen_items=4)
    for task, row in report["tasks"].items():
        assert row["difference_points"] == 0, (task, row)
        assert row["max_loglikelihood_difference"] < 1e-3, (task, row)
        assert row["differing_generations"] == 0, (task, row)
    assert report["passed"]
