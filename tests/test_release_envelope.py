"""Faults the gates used to pass, seeded into the real release flow (Prefect, MLflow store, artifact store) on
a tiny model: each is refused by the gate meant for it, naming the figure, its budget and the evidence.

- only on long prompts: RoPE wrong past position 112 (the fixed passages reach 109 tokens, the old prompts 25);
- only in wide batches: rows past the fourth interfering (the old gates never batched more than six prompts);
- only in free-running decode: each decode step's top two swapped (within the top-N: "tolerated" before);
- recorded = loaded: a paged engine loaded with an fp8 KV cache its engine.json does not record;
- drift against production: a checkpoint without generation_config.json (served, it stops at nothing) and
  a changed chat template are refused; the same template change accepted in the spec passes, its diff on the
  version page.

The faults wrap the candidate's runner where the release loads it (`tasks.gate_runner.load_gate_runner`);
production's engine, fetched from the artifact store, loads untouched.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from gate_faults import decode_swaps_top2, rope_stuck_past, rows_interfering

import tasks.gate_runner
from flows.release import release_flow
from flows.spec import ReleaseSpec, parse_spec
from registry import model_registry as mr
from tasks.tiny_model import make_tiny_model

MODEL = "tiny-envelope"
TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
LONG_PROMPT = "[fixed texts from #0, 128 tokens]"  # tasks.envelope's label of the longest prompt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    hf = make_tiny_model(tmp_path_factory.mktemp("hf") / "tiny", seed=0)
    (hf / "chat_template.jinja").write_text(TEMPLATE)
    return hf


def make_spec(root: Path, checkpoint: Path, **overrides) -> ReleaseSpec:
    data = {
        "source": {"checkpoint": str(checkpoint)},
        "engine": {"dtype": "float32", "max_batch_size": 8, "max_input_len": 128, "max_seq_len": 160},
        "validation": {"max_new_tokens": 8, "prompts": ["The capital of France is", "Once upon a time", "def f(x):"]},
        "evaluation": {"enabled": False},  # the envelope's faults and drift are judged before it
        # the demo's looks (6 rounds, then 10): one round slowed by the machine's other work still passes
        "perf": {"batch_size": 2, "input_len": 8, "output_len": 4, "warmup": 0, "iterations": 2, "max_iterations": 10,
                 "max_slowdown": 0.5},
        "mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "model_name": MODEL},
        "artifacts": {"uri": (root / "artifacts").as_uri()},
        "approval": {"mode": "auto"},
        "work_dir": str(root / "work"),
    }
    data.update(overrides)
    return parse_spec(data)


def seed_fault(monkeypatch, fault) -> None:
    """The release's candidate runner (not production's, fetched under work_dir/production) loaded with `fault`."""
    real = tasks.gate_runner.load_gate_runner

    def load(engine_dir: Path):
        if "production" in Path(engine_dir).parts:
            return real(engine_dir)
        return fault(Path(engine_dir))

    monkeypatch.setattr(tasks.gate_runner, "load_gate_runner", load)


def refused(state, gate: str) -> str:
    assert state.is_failed(), "the fault was published"
    assert f"{gate} gate failed" in state.message and "Nothing was published" in state.message, state.message
    return state.message


@pytest.fixture(scope="module")
def production(tmp_path_factory, checkpoint, prefect_harness) -> Path:
    """A float32 release of the checkpoint published and given the alias `production`; returns the root the
    later releases share (its MLflow store and artifacts)."""
    root = tmp_path_factory.mktemp("envelope")
    spec = make_spec(root, checkpoint)
    state = release_flow(spec, return_state=True)
    assert state.is_completed(), state.message
    mr.set_alias(spec.mlflow.tracking_uri, MODEL, mr.ALIAS_PRODUCTION, state.result().published.version)
    return root


def test_a_fault_only_on_long_prompts_is_refused_by_validation(tmp_path, checkpoint, prefect_harness, monkeypatch):
    from serving.engine import load_engine

    seed_fault(monkeypatch, lambda d: rope_stuck_past(load_engine(d), 112))
    message = refused(release_flow(make_spec(tmp_path, checkpoint), return_state=True), "validation")
    assert "free-running decode" in message and LONG_PROMPT in message, message
    assert "budget 0" in message


def test_rows_interfering_in_a_wide_batch_are_refused(tmp_path, checkpoint, prefect_harness, monkeypatch):
    from serving.engine import load_engine

    seed_fault(monkeypatch, lambda d: rows_interfering(load_engine(d), 4))
    message = refused(release_flow(make_spec(tmp_path, checkpoint), return_state=True), "validation")
    assert "wide batch:" in message and "limits.max_batch_size=8" in message, message
    assert "float32: every row must equal its output alone" in message and "row 4 " in message
    assert "free-running decode" not in message  # each prompt alone is right


def test_a_fault_only_in_free_running_decode_is_refused(tmp_path, checkpoint, prefect_harness, monkeypatch):
    from serving.engine import load_engine

    seed_fault(monkeypatch, lambda d: decode_swaps_top2(load_engine(d)))
    state = release_flow(make_spec(tmp_path, checkpoint), return_state=True)
    message = refused(state, "validation")
    assert "free-running decode:" in message and "are not HF's argmax on the engine's own prefix" in message
    assert "diverged beyond the top-N" not in message and "KL" not in message, message  # the old figures pass
    report = next((tmp_path / "work" / "reports").rglob("validation.md")).read_text()
    assert "| tolerated |" in report  # what the top-N rule alone let through


def test_an_fp8_kv_cache_the_record_does_not_show_is_refused(tmp_path, checkpoint, prefect_harness, monkeypatch):
    from serving.engine import read_engine_info
    from serving.engine.runner import load_engine

    def fp8_behind_the_record(engine_dir: Path):
        config = read_engine_info(engine_dir).kv_cache
        return load_engine(engine_dir, config=dataclasses.replace(config, kv_cache_dtype="fp8"), device="cpu")

    seed_fault(monkeypatch, fp8_behind_the_record)
    paged = {"block_size": 16, "num_blocks": 96, "max_num_tokens": 256}
    spec = make_spec(tmp_path, checkpoint, engine={"dtype": "float32", "max_batch_size": 8, "max_input_len": 128,
                                                  "max_seq_len": 160, "kv_cache": paged})
    message = refused(release_flow(spec, return_state=True), "validation")
    assert ("the runner loaded kv_cache_dtype 'float8_e4m3fn', the engine record (engine.json, "
            "engine.kv_cache.kv_cache_dtype) says 'float32'") in message, message
    assert "the gate's budget is precision 'float32' (from engine.json), what the runner loaded is " \
           "'float32+fp8-kv'" in message


def test_a_checkpoint_without_generation_config_is_refused_against_production(production, checkpoint, tmp_path,
                                                                             prefect_harness):
    lost = shutil.copytree(checkpoint, tmp_path / "no-generation-config")
    (lost / "generation_config.json").unlink()
    message = refused(release_flow(make_spec(production, lost), return_state=True), "served configuration")
    assert "stop_ids lost against production version 1: production [1], candidate (none)" in message, message
    assert "the checkpoint's config.json names [1]" in message and "served.accept.stop_ids" in message


def test_a_changed_chat_template_is_refused_unless_accepted_and_then_shown(production, checkpoint, tmp_path,
                                                                          prefect_harness):
    from registry._client import mlflow_client

    changed = shutil.copytree(checkpoint, tmp_path / "new-template")
    (changed / "chat_template.jinja").write_text(TEMPLATE.replace("assistant:", "<|assistant|>"))
    message = refused(release_flow(make_spec(production, changed), return_state=True), "served configuration")
    assert "chat_template changed against production version 1" in message
    assert "served.accept.chat_template" in message, message

    why = "the assistant turn starts with its special marker"
    spec = make_spec(production, changed, served={"accept": {"chat_template": why}})
    state = release_flow(spec, return_state=True)
    assert state.is_completed(), state.message
    page = mlflow_client(spec.mlflow.tracking_uri).get_model_version(
        MODEL, state.result().published.version).description
    assert "### Served configuration vs production" in page
    assert "| chat_template | " in page and f"accepted: {why} |" in page, page
    assert "-{% endfor %}assistant:" in page and "+{% endfor %}<|assistant|>" in page
    assert "| validation | generated tokens not HF's argmax (free-running decode) | 0 of " in page
    assert "| validation | loaded = engine.json (dtypes, quantization, KV cache) | yes |" in page
