"""A restarted Triton (explicit model control) loads nothing by itself: ``load_served`` loads what the
repository serves, in order, and ``enginewright triton start`` / ``load`` do it for the embedded server and
for any server; ``--load-model=*`` cannot, once a crash left a folder at the top of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from triton_support import TritonServers, make_tiny_engine

from flows.cli import main
from serving.triton import infer_ids, init_repository, stage_engine_version, write_router
from serving.triton.errors import TritonStartError
from serving.triton.operations import served_models
from serving.triton.process import start_triton
from serving.triton.repository import STAGING_PREFIX, set_served_versions

NAME = "tiny"


def mid_release_repository(root: Path, work: Path) -> Path:
    """Versions 1 and 2 served, the router at 30/70, and a staging folder a crash left behind."""
    root = init_repository(root)
    for seed in (0, 1):
        stage_engine_version(root, NAME, make_tiny_engine(work, seed=seed), device_kind="cpu")
    set_served_versions(root, NAME, [1, 2])
    write_router(root, NAME, {1: 30, 2: 70})
    (root / f"{STAGING_PREFIX}{NAME}_v3-0123abcd").mkdir()
    return root


def test_served_models_in_load_order(tmp_path: Path) -> None:
    root = init_repository(tmp_path / "repo")
    for model in ("a_v3", "a_v9", "a_trtllm_v3", "a_trtllm_v9", "a_stream", "a", "b_v1", "b",
                  "old_engine", "old", "lonely"):
        (root / model).mkdir()
        (root / model / "config.pbtxt").write_text("")
    (root / ".engines-a.json").write_text('{"served": [3]}')  # a_v9: staged, not served
    (root / ".engines-b.json").write_text('{"served": [1]}')
    (root / "old_engine" / "enginewright.json").write_text('{"served": [2], "settings": {}}')  # the old layout
    assert served_models(root) == ["a_trtllm_v3", "a_v3", "a_stream", "a", "b_v1", "b", "old_engine", "old"]


@pytest.mark.slow
def test_a_restarted_server_serves_the_same_versions_again(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = mid_release_repository(tmp_path / "repo", tmp_path)
    with pytest.raises(TritonStartError, match="while starting"):
        start_triton(root, log_path=tmp_path / "load-all.log", load_models=("*",), ready_timeout_s=300)
    # Read the cause from the log, not the exit message: Triton 2.51 may segfault or be cut short on its way
    # out, before it prints "failed to load all models" (seen once on a loaded CI machine).
    assert f"Poll failed for model directory '{STAGING_PREFIX}{NAME}_v3-0123abcd'" in (tmp_path / "load-all.log").read_text()

    servers = TritonServers(tmp_path)
    try:
        proc = servers.start(root)
        assert [m for m in proc.control().repository_index() if m.state == "READY"] == []
        assert main(["triton", "load", "--repository", str(root), "--url", proc.http_url]) == 0
        assert f"loaded on {proc.http_url}: {NAME}_v1, {NAME}_v2, {NAME}" in capsys.readouterr().out
        assert proc.control().ready_versions(f"{NAME}_v1") == proc.control().ready_versions(f"{NAME}_v2") == [1]
        routed = {infer_ids(proc.http_url, NAME, [3, 4, 5], max_tokens=2, timeout_s=30).routed_version
                  for _ in range(24)}
        assert routed == {1, 2}
    finally:
        servers.stop_all()


@pytest.mark.slow
def test_triton_start_brings_the_embedded_server_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = mid_release_repository(tmp_path / "repo", tmp_path)
    try:
        assert main(["triton", "start", "--repository", str(root)]) == 0
        status = capsys.readouterr().out
        url = re.search(r"HTTP (http://127\.0\.0\.1:\d+)", status).group(1)
        assert infer_ids(url, NAME, [3, 4, 5], max_tokens=2, timeout_s=30).routed_version in (1, 2)
        assert main(["triton", "start", "--repository", str(root)]) == 0  # running: reused, not restarted
        assert url in capsys.readouterr().out
    finally:
        assert main(["triton", "stop", "--repository", str(root)]) == 0
    assert "stopped Triton pid" in capsys.readouterr().out


def test_triton_load_waits_for_the_server_and_names_the_settings(tmp_path: Path) -> None:
    from serving.triton.process import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit, match=rf"Triton at {url} \(--url\) was not live within 1 s \(--wait-s\)"):
        main(["triton", "load", "--url", url, "--repository", str(tmp_path), "--wait-s", "1"])
    with pytest.raises(SystemExit, match="needs --url"):
        main(["triton", "load", "--repository", str(tmp_path)])
