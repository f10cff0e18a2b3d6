"""The approval as a person writes it, and a wait that ends cleanly.

Against the embedded sqlite store (what `mlflow ui` serves): tag names in another case, the name set
after the decision, a rejection's sentence and the `candidate` alias; the link derived from the tracking
URI. Then a real `enginewright promote` subprocess waiting for approval gets SIGINT (sent to its process
group, as a terminal's Ctrl-C is) and SIGTERM: it exits within 5 s with one line, leaves no process of its
session behind, starts no Triton and changes nothing in MLflow.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from services import mlflow_embedded  # noqa: F401

from registry import model_registry as mr
from registry.approval import read_decision_from_tags, wait_for_approval
from registry.embedded import EmbeddedLocations
from tasks.approve import approval_link, await_decision
from tasks.errors import ApprovalRejected
from tasks.promote_spec import ApprovalSpec


def new_version(uri: str, model: str | None = None) -> tuple[str, str]:
    model = model or f"tiny-llama-{uuid.uuid4().hex[:8]}"
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    version = mr.register_engine_version(uri, model, fingerprint=fingerprint,
                                         source=f"s3://releases/{model}/{fingerprint}/manifest.json")
    mr.set_alias(uri, model, mr.ALIAS_CANDIDATE, version)
    return model, version


def test_link_is_derived_from_the_tracking_uri() -> None:
    spec = ApprovalSpec()
    local = approval_link(spec, "sqlite:///.state/mlflow.db", "tiny-llama", "3")
    assert local.url == "http://127.0.0.1:5000/#/models/tiny-llama/versions/3?workflowType=machine_learning"
    assert local.ui_command == "mlflow ui --backend-store-uri sqlite:///.state/mlflow.db --host 127.0.0.1 --port 5000"
    served = approval_link(spec, "http://10.0.0.5:8080/", "tiny-llama", "3")
    assert (served.url, served.ui_command) == ("http://10.0.0.5:8080/#/models/tiny-llama/versions/3?workflowType=machine_learning", None)
    chosen = approval_link(ApprovalSpec(ui_url="https://mlflow.example/"), "sqlite:///x.db", "m", "1")
    assert (chosen.url, chosen.ui_command) == ("https://mlflow.example/#/models/m/versions/1?workflowType=machine_learning", None)
    assert "open http://127.0.0.1:5000/#/models/tiny-llama/versions/3" in local.instructions("tiny-llama", "3")


def test_tag_names_are_read_in_any_case_with_a_warning(mlflow_embedded: EmbeddedLocations, caplog) -> None:  # noqa: F811
    uri = mlflow_embedded.tracking_uri
    model, version = new_version(uri)
    mr.set_version_tag(uri, model, version, "Approved_By", "alice")
    mr.set_version_tag(uri, model, version, "Approval", "Approved")
    with caplog.at_level(logging.WARNING, logger="registry.approval"):
        decision = wait_for_approval(model, version, tracking_uri=uri, timeout_s=0, poll_s=1)
    assert (decision.decision, decision.decided_by) == ("approved", "alice")
    assert "reading the version tag 'Approval' (as the MLflow UI shows it) as 'approval'" in caplog.text
    assert read_decision_from_tags(model, version, {"approval": "maybe"}) is None


def test_the_name_set_after_the_decision_is_read(mlflow_embedded: EmbeddedLocations, caplog) -> None:  # noqa: F811
    uri = mlflow_embedded.tracking_uri
    model, version = new_version(uri)
    mr.set_version_tag(uri, model, version, "approval", "approved")
    later = threading.Timer(2.0, mr.set_version_tag, args=(uri, model, version, "approved_by", "bob"))
    later.start()
    with caplog.at_level(logging.INFO, logger="registry.approval"):
        decision = wait_for_approval(model, version, tracking_uri=uri, timeout_s=0, poll_s=1, by_grace_s=8)
    later.join()
    assert decision.decided_by == "bob"
    assert f"model '{model}' version {version} approved by bob" in caplog.text
    assert "unknown" not in caplog.text


def test_a_rejection_says_what_stays_live_and_moves_candidate(mlflow_embedded: EmbeddedLocations) -> None:  # noqa: F811
    uri = mlflow_embedded.tracking_uri
    model, live = new_version(uri)
    mr.set_alias(uri, model, mr.ALIAS_PRODUCTION, live)
    _, version = new_version(uri, model)
    mr.set_version_tag(uri, model, version, "rejected_by", "carol")
    mr.set_version_tag(uri, model, version, "approval", "rejected")
    with pytest.raises(ApprovalRejected) as err:
        await_decision(ApprovalSpec(poll_s=0.2), tracking_uri=uri, model_name=model, version=version)
    message = str(err.value)
    assert message == (f"{model} version {version} was rejected in MLflow by carol: nothing was staged or changed "
                       f"in Triton; version {live} stays live (alias `production`); the alias `candidate` no longer "
                       f"points at version {version}")
    assert mr.get_version_by_alias(uri, model, mr.ALIAS_CANDIDATE) is None
    assert mr.get_version_by_alias(uri, model, mr.ALIAS_PRODUCTION) == live


# -- a waiting `enginewright promote`, interrupted ------------------------------------------------------


def _session_processes(sid: int) -> list[str]:
    """Processes of the session ``sid`` (the command and everything it started), as 'pid cmdline'."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: session id
            found.append(f"{entry.name} {cmd}")
    return found


def _wait_for_line(proc: subprocess.Popen, text: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            seen.append(line)
            if text in line:
                return seen
        elif proc.poll() is not None:
            break
        else:
            time.sleep(0.05)
    raise AssertionError(f"no line with {text!r} within {timeout_s} s; output so far:\n{''.join(seen)}")


@pytest.fixture(scope="module")
def waiting_spec(tmp_path_factory) -> tuple[Path, str, str, Path]:
    tmp = tmp_path_factory.mktemp("interrupt")
    state = tmp / "state"
    uri = f"sqlite:///{state / 'mlflow.db'}"
    state.mkdir()
    model, version = new_version(uri)
    repository = state / "triton-repository"
    spec = {
        "source": {"checkpoint": str(tmp / "no-checkpoint-needed-to-wait")},
        "mlflow": {"tracking_uri": uri, "model_name": model},
        "artifacts": {"uri": (state / "artifacts").as_uri()},
        "approval": {"mode": "mlflow-tag", "timeout_s": 600, "poll_s": 0.5},
        "triton": {"model_repository": str(repository)},
        "work_dir": str(state / "work"),
    }
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, model, version, repository


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_waiting_promote_stops_cleanly(waiting_spec, signum: int) -> None:
    spec_path, model, version, repository = waiting_spec
    uri = yaml.safe_load(spec_path.read_text())["mlflow"]["tracking_uri"]
    before = mr.get_version(uri, model, version)
    cli = Path(sys.executable).parent / "enginewright"
    proc = subprocess.Popen([str(cli), "promote", str(spec_path), "--version", version], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=spec_path.parent)
    try:
        out = _wait_for_line(proc, "waiting up to", 120)
        assert f"open http://127.0.0.1:5000/#/models/{model}/versions/{version}" in out[-1]
        sent = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # Ctrl-C reaches the terminal's whole foreground group
        else:
            proc.send_signal(signum)
        proc.wait(timeout=5)
        took = time.monotonic() - sent
        left = _session_processes(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    assert took < 5 and proc.returncode == 128 + signum, (took, proc.returncode, err)
    assert err.strip().splitlines() == [
        (f"enginewright promote: {signal.Signals(signum).name} while waiting for the approval of {model} version "
         f"{version}: stopped; nothing was changed (no server was started, no tag or alias was written)")], err
    assert left == [], left
    assert not (repository.parent / f"{repository.name}.server.json").exists()  # no Triton was started
    after = mr.get_version(uri, model, version)
    assert (after.tags, after.aliases) == (before.tags, before.aliases)
