"""Evidence sized to the budget, through the real release flow (real Prefect, an MLflow sqlite store, a file
artifact store) on the tiny model: a float32 release is published and made production (alias set, as promote
would), then candidates are released against it:
- an unchanged rebuild (another max_batch_size) passes every part of the fixed evaluation;
- a checkpoint with ~15% higher perplexity (its LM head scaled by 1.012: the same argmax, so the same greedy
  text) is refused by the perplexity part;
- a checkpoint whose greedy continuations differ from production's on about a quarter of the tokens (noise on
  its weights) is refused by the greedy part;
- an engine 15% slower than production (each generate call sleeps 0.176 of its own time) is refused by the A/B,
  whether its rounds end 'slower' or undecided.
Each refusal's message names the figure, its budget and the evidence; a refused release publishes nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from gate_faults import ProportionallySlowedRunner, degrade, scale_logits

from flows.release import ReleaseResult, release_flow
from flows.spec import ReleaseSpec, parse_spec
from registry import model_registry as mr
from tasks.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

MODEL = "tiny-evidence"


@dataclass(frozen=True)
class World:
    root: Path
    checkpoint: Path
    production_version: str

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"


def make_spec(root: Path, checkpoint: Path, *, max_batch_size: int = 4, perf: dict | None = None) -> ReleaseSpec:
    return parse_spec({
        "source": {"checkpoint": str(checkpoint)},
        "engine": {"dtype": "float32", "max_batch_size": max_batch_size, "max_input_len": 64, "max_seq_len": 128},
        "validation": {"max_new_tokens": 4, "prompts": ["The capital of France is"], "passages": ["Once upon a time."]},
        # the quality faults' releases keep the A/B out of the way (budget 0.5: an equal engine is within at once)
        "perf": perf or {"batch_size": 2, "input_len": 8, "output_len": 4, "iterations": 2, "max_slowdown": 0.5},
        "mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "model_name": MODEL},
        "artifacts": {"uri": (root / "artifacts").as_uri()},
        "approval": {"mode": "auto"},
        "work_dir": str(root / "work"),
    })


@pytest.fixture(scope="module")
def world(tmp_path_factory, prefect_harness) -> World:
    root = tmp_path_factory.mktemp("evidence")
    checkpoint = make_tiny_model(root / "hf", seed=0)
    state = release_flow(make_spec(root, checkpoint), return_state=True)
    assert state.is_completed(), state.message
    released: ReleaseResult = state.result()
    mr.set_alias(f"sqlite:///{root / 'mlflow.db'}", MODEL, mr.ALIAS_PRODUCTION, released.published.version)
    return World(root, checkpoint, released.published.version)


def versions(world: World) -> set[str]:
    from mlflow import MlflowClient

    return {v.version for v in MlflowClient(world.tracking_uri).search_model_versions(f"name = '{MODEL}'")}


def refused(world: World, spec: ReleaseSpec, gate: str) -> str:
    """Release `spec`, expect it refused at `gate` with nothing published; the Failed state's message."""
    before = versions(world)
    state = release_flow(spec, return_state=True)
    assert state.is_failed(), "published a fault"
    assert f"{gate} gate failed" in state.message and "Nothing was published" in state.message, state.message
    assert versions(world) == before
    return state.message


def test_an_unchanged_rebuild_passes_every_part_against_production(world):
    state = release_flow(make_spec(world.root, world.checkpoint, max_batch_size=2), return_state=True)
    assert state.is_completed(), state.message
    report = (state.result().report_dir / "evaluation.md").read_text()
    assert report.startswith("# Fixed evaluation against production: PASSED"), report
    for part in ("perplexity change | +0.00% | [+0.00%, +0.00%] | +5.00% | within | 16 (8)",
                 "greedy disagreement with production (8 tokens, 3 prompts a passage) | 0 | [0, 0] | 0.2 | within | 48 (32)",
                 "mean KL from production to candidate, nats/token | 0 | [0, 0] | 0.05 | within",
                 "cloze accuracy drop (points) | +0.0 pt | [+0.0 pt, +0.0 pt] | +20.0 pt | within | 36 (32)"):
        assert f"| {part}" in report, (part, report)


def test_a_checkpoint_with_15pct_higher_perplexity_is_refused_by_the_perplexity_part(world):
    sharper = scale_logits(world.checkpoint, world.root / "hf-sharper", factor=1.012)
    message = refused(world, make_spec(world.root, sharper), "evaluation")
    assert "fixed evaluation: perplexity change +1" in message, message
    assert f"against production version {world.production_version} (interval [+" in message
    assert "over 16 passages" in message and "evaluation.max_perplexity_increase +5.00%: beyond the budget" in message
    assert "greedy disagreement" not in message, "the same argmax: only the likelihood part can see it"


def test_a_checkpoint_whose_greedy_text_differs_on_a_quarter_of_the_tokens_is_refused(world):
    noisy = degrade(world.checkpoint, world.root / "hf-noisy", relative_noise=0.004)
    message = refused(world, make_spec(world.root, noisy), "evaluation")
    assert "fixed evaluation: greedy disagreement with production (8 tokens, 3 prompts a passage) 0." in message, message
    assert "evaluation.max_greedy_disagreement 0.200: " in message and "over 48 continuations" in message


def test_an_engine_15pct_slower_than_production_is_refused_by_the_ab(world, monkeypatch):
    import flows.release

    real = flows.release.load_gate_runner_task
    production_dir = world.root / "work" / "production"

    def slowed(engine_dir):
        runner = real(engine_dir)
        return runner if Path(engine_dir).is_relative_to(production_dir) else ProportionallySlowedRunner(runner, 0.15)

    monkeypatch.setattr(flows.release, "load_gate_runner_task", slowed)
    perf = {"batch_size": 2, "input_len": 8, "output_len": 8, "warmup": 1, "iterations": 4, "max_iterations": 16}
    message = refused(world, make_spec(world.root, world.checkpoint, max_batch_size=3, perf=perf), "performance")
    assert f"production version {world.production_version}'s in the same run" in message, message
    assert "ABBA rounds" in message and "1 - perf.max_slowdown = 0.90" in message and "interval [0." in message
