"""A release killed after its build step resumes: the re-run reuses conversion and build (cache hits,
keyed by the checkpoint's content, the engine settings and the toolchain) and ends with the same engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tasks.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow


def release_cmd(spec: Path) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "release", str(spec)]


def test_release_killed_after_build_resumes_from_the_cache(tmp_path):
    checkpoint = make_tiny_model(tmp_path / "hf", seed=3)
    work = tmp_path / "work"
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "source": {"checkpoint": str(checkpoint)},
        "engine": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128},
        "validation": {"max_new_tokens": 8},
        "perf": {"batch_size": 2, "input_len": 8, "output_len": 4, "iterations": 2},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "model_name": "tiny-resume"},
        "artifacts": {"uri": (tmp_path / "artifacts").as_uri()},
        "work_dir": str(work),
    }))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}

    first = subprocess.Popen(release_cmd(spec), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    deadline = time.monotonic() + 240
    while not list(work.glob("engines/[!.]*/engine.json")):
        assert first.poll() is None, first.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the build never finished"
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    built = json.loads(next(work.glob("engines/[!.]*/engine.json")).read_text())["fingerprint"]
    converted_at = next(work.glob("checkpoints/*/checkpoint.json")).stat().st_mtime_ns

    again = subprocess.run(release_cmd(spec), env=env, check=False, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "cache hits: convert, build" in again.stdout, again.stdout[-3000:]
    assert f"fingerprint {built}" in again.stdout
    assert next(work.glob("checkpoints/*/checkpoint.json")).stat().st_mtime_ns == converted_at
    assert len(list(work.glob("engines/*"))) == 1 and len(list(work.glob("checkpoints/*"))) == 1
