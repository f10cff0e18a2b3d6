"""Bad input ends with one paragraph naming the setting, exit code 2, and no state left behind."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from serving.triton.process import free_port

CLI = [sys.executable, "-m", "flows.cli"]


@dataclass(frozen=True)
class Done:
    returncode: int
    stdout: str
    stderr: str


def run_cli_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`enginewright` as a person runs it: its own process, exit code and stderr as the shell sees them."""
    env = {**os.environ, "PREFECT_HOME": str(cwd / "prefect-home")}
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, check=False, capture_output=True, text=True, timeout=300)


def run_cli(*args: str, cwd: Path) -> Done:
    """The same entry point (`flows.cli.main`) in this process: a process of its own costs seconds of imports
    (torch, Prefect, MLflow) on CI's two cores; one test keeps the real process (run_cli_process)."""
    from flows.cli import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ["PREFECT_HOME"] = str(cwd / "prefect-home")
    os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)  # main() sets its quiet defaults in the environment
    return Done(code, out.getvalue(), err.getvalue())


def write_spec(tmp: Path, **changes) -> Path:
    spec = {
        "source": {"checkpoint": str(tmp / "no-such-checkpoint")},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'state' / 'mlflow.db'}", "model_name": "tiny"},
        "artifacts": {"uri": (tmp / "state" / "artifacts").as_uri()},
        "work_dir": str(tmp / "state" / "work"),
    }
    spec.update(changes)
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def assert_one_paragraph(stderr: str) -> None:
    text = stderr.strip()
    assert text.startswith("enginewright: "), text
    assert "\n\n" not in text and "Traceback" not in text, text


def test_malformed_spec_names_the_field(tmp_path):
    spec = write_spec(tmp_path, engine={"max_batch_size": 0}, rollout={"steps": [{"set_weight": 50}]})
    done = run_cli_process("release", str(spec), cwd=tmp_path)
    assert done.returncode == 2
    assert_one_paragraph(done.stderr)
    assert "engine.max_batch_size" in done.stderr and "(got 0)" in done.stderr
    assert "the last set_weight step must be 100" in done.stderr

    spec = write_spec(tmp_path, engine={"max_input_len": 512, "max_seq_len": 256})
    done = run_cli("release", str(spec), cwd=tmp_path)
    assert "max_input_len (512) must be smaller than max_seq_len (256)" in done.stderr
    assert not (tmp_path / "state").exists()


def test_missing_checkpoint_names_the_setting(tmp_path):
    done = run_cli("release", str(write_spec(tmp_path)), cwd=tmp_path)
    assert done.returncode == 2
    assert_one_paragraph(done.stderr)
    assert "source.checkpoint" in done.stderr and "no-such-checkpoint" in done.stderr
    assert not (tmp_path / "state").exists()


def test_unreachable_triton_names_the_endpoint(tmp_path):
    repo = tmp_path / "repository"
    url = f"http://127.0.0.1:{free_port()}"
    spec = write_spec(tmp_path, triton={"endpoints": [{"url": url, "model_repository": str(repo)}]})
    done = run_cli("promote", str(spec), "--version", "1", cwd=tmp_path)
    assert done.returncode == 2
    assert_one_paragraph(done.stderr)
    assert url in done.stderr and "triton.endpoints[0].url" in done.stderr
    assert not repo.exists() and not (tmp_path / "state").exists()
