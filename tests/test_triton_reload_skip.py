"""One Triton model per engine version: ``serve_versions`` loads only the versions' models that are not
ready and unloads the others, so serving a candidate beside the live version never reloads the live one
(with one model for all versions, each change of the served set re-created every version), and a version
brings parameters of its own without touching the others'."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from triton_support import TritonServers, make_tiny_engine

from serving.triton import init_repository, stage_engine_version
from serving.triton.operations import serve_versions

NAME = "tiny"


def engine_loads(log: Path) -> list[str]:
    """The engine models Triton started loading, in order (``loading: tiny_v<N>:1``)."""
    return re.findall(rf'"loading: ({NAME}_v\d+):1"', log.read_text())


@pytest.mark.slow
def test_serving_versions_loads_each_model_once_and_never_the_live_one(tmp_path: Path) -> None:
    root = init_repository(tmp_path / "repo")
    for seed in (0, 1):
        stage_engine_version(root, NAME, make_tiny_engine(tmp_path, seed=seed), device_kind="cpu",
                             parameters={"stream_interval_ms": "5"})
    servers = TritonServers(tmp_path)
    try:
        proc = servers.start(root)
        control, log = proc.control(), proc.log_path
        serve_versions(control, root, NAME, [1], timeout_s=60)
        assert engine_loads(log) == ["tiny_v1"] and control.ready_versions("tiny_v1") == [1]
        serve_versions(control, root, NAME, [1], timeout_s=60)
        assert engine_loads(log) == ["tiny_v1"]  # ready already: nothing reloaded
        serve_versions(control, root, NAME, [1, 2], timeout_s=60)
        assert engine_loads(log) == ["tiny_v1", "tiny_v2"]  # the candidate only
        stage_engine_version(root, NAME, make_tiny_engine(tmp_path, seed=2), device_kind="cpu",
                             parameters={"stream_interval_ms": "9"})  # v3 brings a parameter of its own
        serve_versions(control, root, NAME, [2, 3], timeout_s=60)
        assert engine_loads(log) == ["tiny_v1", "tiny_v2", "tiny_v3"]
        assert not control.ready_versions("tiny_v1")  # no longer served: unloaded
        params = {v: control.model_config(f"tiny_v{v}")["parameters"]["stream_interval_ms"]["string_value"]
                  for v in (2, 3)}
        assert params == {2: "5", 3: "9"}
    finally:
        servers.stop_all()
