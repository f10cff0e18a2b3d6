"""A repository of the old layout (``<name>_engine``: one Triton model holding every engine version) is
moved to one model per version by `serving.triton.migrate.migrate_legacy` (what the next promote runs
first), on a real Triton serving it: no request fails, the router ends up on ``<name>_v<N>``, the old model
is unloaded and its folder gone, and a second call changes nothing. Also: the memory figures the fit check
reads are in this Triton's metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from triton_support import TritonServers, make_tiny_engine

from serving.triton.client import infer_ids
from serving.triton.metrics import scrape
from serving.triton.migrate import migrate_legacy
from serving.triton.model_configs import llm_config
from serving.triton.pbtxt import to_pbtxt
from serving.triton.repository import (
    MODELS_DIR,
    init_repository,
    list_versions,
    served_versions,
    write_router,
)
from tasks.fit import device_memory

pytestmark = pytest.mark.slow
NAME = "old"


def old_layout(root: Path, engine: Path) -> None:
    """``old_engine`` serving version 3 exactly as the layout before one model per version wrote it."""
    model = root / f"{NAME}_engine"
    settings = {"device_kind": "cpu", "max_queue_size": 64, "max_queue_delay_us": 2000, "instance_count": 1,
                "parameters": {"stream_interval_ms": "4"}}
    (model / "3").mkdir(parents=True)
    shutil.copy2(MODELS_DIR / "llm.py", model / "3" / "model.py")
    shutil.copytree(engine, model / "3" / "engine")
    (model / "3" / "version.json").write_text(json.dumps({"max_batch_size": 8, "settings": settings}))
    (model / "enginewright.json").write_text(json.dumps({"settings": settings, "next_version": 4, "served": [3]}))
    config = llm_config(model.name, versions=[3], max_batch_size=8, device_kind="KIND_CPU",
                        parameters=settings["parameters"])
    (model / "config.pbtxt").write_text(to_pbtxt(config))
    write_router(root, NAME, {3: 100}, target_model=model.name)


def test_an_old_layout_is_migrated_in_place_on_a_live_server(tmp_path: Path) -> None:
    root = init_repository(tmp_path / "repo")
    old_layout(root, make_tiny_engine(tmp_path))
    servers = TritonServers(tmp_path)
    try:
        proc = servers.start(root)
        control = proc.control()
        control.load_model(f"{NAME}_engine", timeout_s=60)
        control.load_model(NAME, timeout_s=60)
        before = infer_ids(proc.http_url, NAME, [3, 4, 5], max_tokens=3, timeout_s=30)
        assert before.routed_version == 3

        assert migrate_legacy(control, root, NAME, timeout_s=60) == [3]
        after = infer_ids(proc.http_url, NAME, [3, 4, 5], max_tokens=3, timeout_s=30)
        assert after.routed_version == 3 and after.output_ids == before.output_ids
        assert control.ready_versions(f"{NAME}_v3") == [1] and not control.ready_versions(f"{NAME}_engine")
        assert control.model_config(NAME)["parameters"]["target_model"]["string_value"] == f"{NAME}_v{{version}}"
        assert control.model_config(f"{NAME}_v3")["parameters"]["stream_interval_ms"]["string_value"] == "4"
        assert not (root / f"{NAME}_engine").exists()
        assert list_versions(root, NAME) == served_versions(root, NAME) == [3]
        assert sorted(p.name for p in root.iterdir()) == sorted([".engines-old.json", "old", "old_v3"])
        assert migrate_legacy(control, root, NAME, timeout_s=60) == []  # nothing left to do

        cpu = device_memory(scrape(proc.metrics_url), "cpu")  # what tasks.fit reads on a CPU endpoint
        assert len(cpu) == 1 and 0 < cpu[0].used_bytes < cpu[0].total_bytes
    finally:
        servers.stop_all()
