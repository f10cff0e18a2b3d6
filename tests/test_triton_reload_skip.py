"""``serve_versions`` reloads ``<name>_engine`` only when Triton does not serve that config already: a reload
re-creates every version (seconds to minutes per engine), so the finish of a first release, or a rollback
that finds the live version alone with its own settings, loads nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from triton_support import TritonServers, make_tiny_engine

from serving.triton import init_repository, stage_engine_version
from serving.triton.operations import holds, serve_versions

NAME = "tiny"


def test_holds_compares_only_what_is_wanted() -> None:
    loaded = {"a": 1, "b": {"c": [1, 2], "d": "x"}, "e": [{"k": 1, "extra": 0}]}
    assert holds(loaded, {"b": {"c": [1, 2]}, "e": [{"k": 1}]})
    assert not holds(loaded, {"b": {"c": [1]}})  # a list must match in length
    assert not holds(loaded, {"b": {"d": "y"}})
    assert not holds(loaded, {"missing": 1})
    assert not holds(loaded, {"e": {"k": 1}})


def engine_loads(log: Path) -> int:
    return log.read_text().count(f'"loading: {NAME}_engine:')


@pytest.mark.slow
def test_a_config_triton_serves_already_is_not_reloaded(tmp_path: Path) -> None:
    root = init_repository(tmp_path / "repo")
    for seed in (0, 1):
        stage_engine_version(root, NAME, make_tiny_engine(tmp_path, seed=seed), device_kind="cpu",
                             parameters={"stream_interval_ms": "5"})
    servers = TritonServers(tmp_path)
    try:
        proc = servers.start(root)
        control, log = proc.control(), proc.log_path
        serve_versions(control, root, NAME, [1], timeout_s=60)
        assert engine_loads(log) == 1 and control.ready_versions(f"{NAME}_engine") == [1]
        serve_versions(control, root, NAME, [1], timeout_s=60)
        assert engine_loads(log) == 1  # the same config: nothing reloaded
        serve_versions(control, root, NAME, [1, 2], timeout_s=60)
        assert engine_loads(log) == 3 and control.ready_versions(f"{NAME}_engine") == [1, 2]
        stage_engine_version(root, NAME, make_tiny_engine(tmp_path, seed=2), device_kind="cpu",
                             parameters={"stream_interval_ms": "9"})  # v3 brings a parameter of its own
        serve_versions(control, root, NAME, [1, 2], timeout_s=60)  # same versions, another parameter
        assert engine_loads(log) == 5
        assert control.model_config(f"{NAME}_engine")["parameters"]["stream_interval_ms"]["string_value"] == "9"
    finally:
        servers.stop_all()
