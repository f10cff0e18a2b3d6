"""Unit tests of serving.triton: pbtxt, configs (parsed with Triton's own schema), atomic staging,
request parsing and batching, router choice, and both models under a fake triton_python_backend_utils."""

from __future__ import annotations

import gc
import json
import os
import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import text_format
from triton_support import (
    COMPLETE_FINAL,
    STUB_QUEUE,
    FakeLimits,
    FakeRequest,
    FakeResponse,
    FakeRunner,
    FakeTensor,
    answers,
    make_fake_pb_utils,
)
from tritonclient.grpc import model_config_pb2

from serving.triton import repository as repo_mod
from serving.triton.errors import ConfigError, RepositoryError, TritonStartError
from serving.triton.install import locate_triton
from serving.triton.model_configs import check_weights, llm_config, router_config
from serving.triton.models import bls as bls_mod
from serving.triton.models import llm as llm_mod
from serving.triton.models import params as params_mod
from serving.triton.models import router as router_mod
from serving.triton.models.requests import BatchItem, RequestError, check_limits, parse_request, plan_batches
from serving.triton.models.routing import RouterStats, WeightsError, choose_version, parse_weights
from serving.triton.models.routing_file import ROUTING_FILE, ROUTING_PARAMETER
from serving.triton.models.text import EngineText
from serving.triton.pbtxt import to_pbtxt
from serving.triton.process import build_command, start_triton


def parse_pbtxt(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def fake_engine_dir(tmp_path: Path, name: str = "engine") -> Path:
    d = tmp_path / name
    (d / "sub").mkdir(parents=True)
    (d / "engine.json").write_text("{}")
    (d / "weights.pt").write_bytes(b"\0" * 1000)
    (d / "sub" / "x.bin").write_bytes(b"x")
    return d


class RecordingControl:
    """The Triton control calls a repository operation makes, in order, and what is loaded (beside the
    real-server rollout tests of the same paths, tests/test_rollout_*.py)."""

    def __init__(self, loaded: dict[str, dict] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.loaded: dict[str, dict] = dict(loaded or {})  # model -> config it runs with

    def load_model(self, name: str, *, config: dict | None = None, timeout_s: float = 0.0) -> None:
        self.calls.append(("load", name))
        self.loaded[name] = config or {}

    def unload_model(self, name: str, *, timeout_s: float = 0.0) -> None:
        self.calls.append(("unload", name))
        self.loaded.pop(name, None)

    def ready_versions(self, name: str) -> list[int]:
        return [1] if name in self.loaded else []

    def model_config(self, name: str) -> dict:
        from serving.triton.errors import TritonRequestError

        if name not in self.loaded:
            raise TritonRequestError(f"{name} is not loaded")
        return self.loaded[name]


def two_versions_served(tmp_path: Path, router: dict[int, int]) -> tuple[Path, RecordingControl]:
    root = repo_mod.init_repository(tmp_path / "repo")
    engine = fake_engine_dir(tmp_path)
    for _ in range(2):
        repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, device_kind="cpu")
    repo_mod.set_served_versions(root, "m", [1, 2])
    config = repo_mod.write_router(root, "m", router)
    return root, RecordingControl({"m_v1": {}, "m_v2": {}, "m": config})


@pytest.mark.parametrize("before", [{1: 0, 2: 100}, {1: 50, 2: 50}])
def test_converge_unloads_a_version_only_once_the_router_no_longer_picks_it(tmp_path: Path, before) -> None:
    """Already routed away from version 1 (a release's last step) or still routed to it: its model is
    unloaded only once the routing file gives it no weight, and nothing loads (the routers follow the
    file; the model of the version kept is never reloaded)."""
    from tasks import rollback
    from tasks.targets import Target

    root, control = two_versions_served(tmp_path, before)
    weights_at_unload = []
    unload = control.unload_model

    def recorded_unload(name: str, **kwargs: float) -> None:
        weights_at_unload.append(repo_mod.router_weights(root, "m"))
        unload(name, **kwargs)

    control.unload_model = recorded_unload  # type: ignore[method-assign]

    class RecordedTarget(Target):
        def control(self, **_: float) -> RecordingControl:  # type: ignore[override]
            return control

    rollback.converge(RecordedTarget("http://127.0.0.1:1", root, "test"), "m", 2, timeout_s=1.0)
    assert control.calls == [("unload", "m_v1")]
    assert weights_at_unload[0].get(1, 0) == 0
    assert repo_mod.router_weights(root, "m") == {2: 100}
    assert repo_mod.served_versions(root, "m") == [2] and repo_mod.list_versions(root, "m") == [2]
    control.calls.clear()
    load_id = repo_mod.router_routing(root, "m").load_id
    rollback.converge(RecordedTarget("http://127.0.0.1:1", root, "test"), "m", 2, timeout_s=1.0)
    assert control.calls == []  # converged already: nothing loads, not even the router
    assert repo_mod.router_routing(root, "m").load_id == load_id  # nor is the routing file rewritten


def test_serve_versions_loads_only_what_is_not_ready(tmp_path: Path) -> None:
    from serving.triton.operations import serve_versions

    root, control = two_versions_served(tmp_path, {1: 100})
    control.loaded.pop("m_v2")
    serve_versions(control, root, "m", [1, 2])
    assert control.calls == [("load", "m_v2")]  # the live m_v1 is left alone
    serve_versions(control, root, "m", [1])
    assert control.calls == [("load", "m_v2"), ("unload", "m_v2")]


# ---------------------------------------------------------------- pbtxt and configs


def test_pbtxt_scalars_enums_maps_and_lists() -> None:
    text = to_pbtxt({"name": 'a"b', "max_batch_size": 4, "input": [{"name": "x", "data_type": "TYPE_FP32",
                     "dims": [-1, 2], "optional": True}], "parameters": {"k": {"string_value": "v\n"}}})
    assert 'name: "a\\"b"' in text and "data_type: TYPE_FP32" in text and "dims: [-1, 2]" in text
    cfg = parse_pbtxt(text)
    assert cfg.name == 'a"b' and cfg.parameters["k"].string_value == "v\n"
    assert cfg.input[0].data_type == model_config_pb2.TYPE_FP32 and list(cfg.input[0].dims) == [-1, 2]


def test_pbtxt_rejects_bad_enum() -> None:
    with pytest.raises(ConfigError, match="data_type"):
        to_pbtxt({"input": [{"data_type": "TYPE FP32"}]})


def test_llm_config_parses_with_triton_schema() -> None:
    cfg = parse_pbtxt(to_pbtxt(llm_config("m_engine", versions=[2, 1], max_batch_size=8, device_kind="KIND_CPU",
                                          max_queue_size=5, max_queue_delay_us=100, parameters={"device": "cpu"})))
    assert cfg.backend == "python" and cfg.max_batch_size == 8
    assert list(cfg.version_policy.specific.versions) == [1, 2]
    assert not cfg.HasField("dynamic_batching")  # in flight: the engine queues, up to max_queue_size
    assert cfg.parameters["max_queue_size"].string_value == "5"
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    inputs = {i.name: i for i in cfg.input}
    assert inputs["input_ids"].allow_ragged_batch and inputs["input_ids"].optional
    assert inputs["text_input"].data_type == model_config_pb2.TYPE_STRING
    assert not inputs["max_tokens"].optional
    assert {o.name for o in cfg.output} == {"output_ids", "text_output", "finish_reason", "prompt_tokens",
                                        "output_logprobs"}
    assert cfg.parameters["device"].string_value == "cpu"


def test_static_llm_keeps_the_dynamic_batcher_and_in_flight_has_none() -> None:
    def config(parameters: dict[str, str]) -> model_config_pb2.ModelConfig:
        return parse_pbtxt(to_pbtxt(llm_config("m_v1", versions=[1], max_batch_size=8, device_kind="KIND_CPU",
                                               max_queue_size=7, max_queue_delay_us=300, parameters=parameters)))

    static = config({"in_flight": "false"})
    assert static.dynamic_batching.max_queue_delay_microseconds == 300
    assert static.dynamic_batching.default_queue_policy.max_queue_size == 7 and "max_queue_size" not in static.parameters
    for parameters in ({}, {"decoupled": "true"}, {"decoupled": "true", "in_flight": "false"}):
        cfg = config(parameters)
        assert not cfg.HasField("dynamic_batching") and cfg.parameters["max_queue_size"].string_value == "7"
    with pytest.raises(ConfigError, match="in_flight='maybe'"):
        config({"in_flight": "maybe"})
    assert config({"max_queue_size": "7"}).parameters["max_queue_size"].string_value == "7"  # re-rendered: the same
    with pytest.raises(ConfigError, match=r"parameter max_queue_size='3' is written from max_queue_size=7"):
        config({"max_queue_size": "3"})


def test_router_config_parses_and_validates() -> None:
    cfg = parse_pbtxt(to_pbtxt(router_config("m")))
    assert cfg.parameters["target_model"].string_value == "m_v{version}"
    assert cfg.parameters[ROUTING_PARAMETER].string_value == ROUTING_FILE and "weights" not in cfg.parameters
    assert {o.name for o in cfg.output} >= {"routed_version", "output_ids"}
    assert not {"stats", "stats_json"} & {t.name for t in [*cfg.input, *cfg.output]}  # counters stay internal
    assert all(i.optional for i in cfg.input if i.name != "max_tokens")  # required, as the engine requires it
    assert not next(i for i in cfg.input if i.name == "max_tokens").optional and cfg.max_batch_size == 1
    for bad in ({}, {1: 0}, {0: 10}, {1: -1}):
        with pytest.raises(ConfigError, match="weights"):
            check_weights("router 'm'", bad)


# ---------------------------------------------------------------- repository


def test_stage_versions_layout_and_served(tmp_path: Path) -> None:
    root = repo_mod.init_repository(tmp_path / "repo")
    engine = fake_engine_dir(tmp_path)
    assert repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, device_kind="cpu") == 1
    assert repo_mod.stage_engine_version(root, "m", engine, max_batch_size=4) == 2
    vdir = root / "m_v2" / "1"
    assert (vdir / "model.py").read_text() == (repo_mod.MODELS_DIR / "llm.py").read_text()
    assert (vdir / "engine" / "sub" / "x.bin").read_bytes() == b"x"
    assert (vdir / "engine" / "weights.pt").stat().st_ino == (engine / "weights.pt").stat().st_ino  # hardlink
    assert repo_mod.served_versions(root, "m") == [1]
    for version, batch in ((1, 8), (2, 4)):  # each version its own model and config
        cfg = parse_pbtxt((root / f"m_v{version}" / "config.pbtxt").read_text())
        assert cfg.name == f"m_v{version}" and list(cfg.version_policy.specific.versions) == [1]
        assert cfg.max_batch_size == batch
        assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU  # kept from version 1
    config_1 = (root / "m_v1" / "config.pbtxt").read_bytes()
    repo_mod.set_served_versions(root, "m", [1, 2])
    assert (root / "m_v1" / "config.pbtxt").read_bytes() == config_1  # serving another version changes none
    with pytest.raises(RepositoryError, match="still served"):
        repo_mod.remove_version(root, "m", 1)
    repo_mod.set_served_versions(root, "m", [2])
    repo_mod.remove_version(root, "m", 1)
    assert repo_mod.list_versions(root, "m") == [2]
    with pytest.raises(RepositoryError, match="already exists"):
        repo_mod.stage_engine_version(root, "m", engine, max_batch_size=4, version=2)
    assert not [p for p in root.iterdir() if p.name.startswith((".staging", ".removing"))]
    with pytest.raises(RepositoryError, match="not staged"):
        repo_mod.set_served_versions(root, "m", [1])
    repo_mod.stage_engine_version(root, "m_v2", engine, max_batch_size=4)  # a release named like a version
    assert repo_mod.list_versions(root, "m") == [2] and repo_mod.list_versions(root, "m_v2") == [1]


def test_each_version_keeps_the_settings_it_was_staged_with(tmp_path: Path) -> None:
    """Settings are a model's in Triton: with a model per version, the candidate's parameters never reach
    the live version, and the routers call both the way the newest served version is staged."""
    root = repo_mod.init_repository(tmp_path / "repo")
    engine = fake_engine_dir(tmp_path)

    def settings(version: int) -> tuple[dict[str, str], int]:
        cfg = parse_pbtxt((root / f"m_v{version}" / "config.pbtxt").read_text())
        params = {k: v.string_value for k, v in cfg.parameters.items()}
        return params, int(params.pop("max_queue_size"))

    repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, parameters={"warmup": "true"}, max_queue_size=9)
    repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, parameters={"decoupled": "true"},
                                  max_queue_size=5)
    assert settings(1) == ({"warmup": "true"}, 9) and settings(2) == ({"decoupled": "true"}, 5)
    repo_mod.set_served_versions(root, "m", [1, 2])
    assert repo_mod.engine_decoupled(root, "m")
    assert "model_transaction_policy" in repo_mod.llm_model_config(root, "m", 2)
    repo_mod.set_served_versions(root, "m", [1])  # rolled back
    assert not repo_mod.engine_decoupled(root, "m") and settings(1) == ({"warmup": "true"}, 9)


def test_serving_a_version_that_is_not_staged_changes_nothing(tmp_path: Path) -> None:
    root = repo_mod.init_repository(tmp_path / "repo")
    engine = fake_engine_dir(tmp_path)
    repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, parameters={"warmup": "true"})
    repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, parameters={"decoupled": "true"})
    repo_mod.set_served_versions(root, "m", [2])
    files = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for versions in ([1, 7], [7]):
        with pytest.raises(RepositoryError, match="not staged"):
            repo_mod.set_served_versions(root, "m", versions)
        assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == files


def test_stage_failure_mid_copy_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = repo_mod.init_repository(tmp_path / "repo")
    engine = fake_engine_dir(tmp_path)
    repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    real = repo_mod.link_or_copy
    placed: list[Path] = []

    def flaky(src: Path, dst: Path, *, link: bool = True) -> None:
        if placed:
            raise OSError(f"disk full while writing {dst}")
        placed.append(dst)
        real(src, dst, link=link)

    monkeypatch.setattr(repo_mod, "link_or_copy", flaky)
    with pytest.raises(OSError, match="disk full"):
        repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8)
    assert placed, "the failure must happen after a first file was written"
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in root.iterdir()) == sorted([".engines-m.json", "m_v1"])


def test_stage_refuses_a_bad_parameter_before_writing_anything(tmp_path: Path) -> None:
    root = repo_mod.init_repository(tmp_path / "repo")
    engine = fake_engine_dir(tmp_path)
    repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8)
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(RepositoryError, match="stream_interval_ms='-1'.*nothing was staged"):
        repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, parameters={"stream_interval_ms": "-1"})
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_stage_missing_engine_names_it(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match="argument engine_dir"):
        repo_mod.stage_engine_version(tmp_path / "repo", "m", tmp_path / "nope", max_batch_size=1)


def test_write_router_files(tmp_path: Path) -> None:
    cfg = repo_mod.write_router(tmp_path, "m", {1: 100})
    assert (tmp_path / "m" / "1" / "model.py").read_text() == (repo_mod.MODELS_DIR / "router.py").read_text()
    assert parse_pbtxt((tmp_path / "m" / "config.pbtxt").read_text()).name == cfg["name"] == "m"


# ---------------------------------------------------------------- install / process


def test_locate_triton_and_command(tmp_path: Path) -> None:
    inst = locate_triton(tmp_path / "backends")
    assert (inst.backends_dir / "python" / "triton_python_backend_stub").is_file()
    assert inst.env["LD_LIBRARY_PATH"].split(":")[0].endswith("/lib")
    argv = build_command(inst, tmp_path, host="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3, gpu=False)
    assert "--model-control-mode=explicit" in argv and "--http-address=127.0.0.1" in argv
    assert "--pinned-memory-pool-byte-size=0" in argv
    assert "--pinned-memory-pool-byte-size=0" not in build_command(
        inst, tmp_path, host="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3, gpu=True)


def test_start_triton_missing_repository(tmp_path: Path) -> None:
    with pytest.raises(TritonStartError, match="argument model_repository"):
        start_triton(tmp_path / "missing", log_path=tmp_path / "log")


# ---------------------------------------------------------------- request parsing and batching


def getter(**inputs):
    return lambda name: None if name not in inputs else np.asarray(inputs[name])


def test_parse_request_ids_and_text() -> None:
    req = parse_request(getter(input_ids=[[1, 2, 3]], max_tokens=[[4]], temperature=[[0.5]], seed=[[7]]))
    assert req.prompt_ids == (1, 2, 3) and req.max_tokens == 4 and not req.want_text
    assert req.sampling.temperature == 0.5 and req.sampling.seed == 7 and not req.sampling.is_greedy
    req = parse_request(getter(text_input=np.array([[b"hi"]], dtype=object), max_tokens=[[2]]))
    assert req.text == "hi" and req.want_text and req.sampling.is_greedy
    assert parse_request(getter(input_ids=[[1]], max_tokens=[[1]]), ("text_output",)).want_text


@pytest.mark.parametrize(("inputs", "match"), [
    ({"max_tokens": [[1]]}, "exactly one of"),
    ({"input_ids": [[1]], "text_input": np.array([[b"x"]], dtype=object), "max_tokens": [[1]]}, "exactly one of"),
    ({"input_ids": [[1]]}, "'max_tokens' is required"),
    ({"input_ids": [[1]], "max_tokens": [[0]]}, "'max_tokens'=0"),
    ({"input_ids": [[-1]], "max_tokens": [[1]]}, "negative token id"),
    ({"input_ids": [[1]], "max_tokens": [[1, 2]]}, "exactly one value"),
    ({"input_ids": [[1]], "max_tokens": [[1]], "top_p": [[0.0]]}, "'top_p'"),
    ({"input_ids": [[1]], "max_tokens": [[1]], "temperature": [[-1.0]]}, "'temperature'"),
    ({"text_input": np.array([[b"\xff"]], dtype=object), "max_tokens": [[1]]}, "UTF-8"),
])
def test_parse_request_rejects(inputs: dict, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        parse_request(getter(**inputs))


def test_check_limits_names_limit() -> None:
    with pytest.raises(RequestError, match="max_input_len=4"):
        check_limits((1,) * 5, 1, max_input_len=4, max_seq_len=100)
    with pytest.raises(RequestError, match="max_seq_len=10"):
        check_limits((1,) * 4, 7, max_input_len=4, max_seq_len=10)


def test_plan_batches_groups_and_bounds() -> None:
    items = [BatchItem(i, (1,) * n, t, k) for i, (n, t, k) in enumerate(
        [(2, 4, "a"), (3, 4, "a"), (2, 4, "b"), (2, 4, "a"), (20, 4, "a"), (2, 30, "a")])]
    batches = plan_batches(items, max_batch_size=2, max_seq_len=32)
    assert [[i.index for i in b] for b in batches] == [[0, 1], [3, 4], [5], [2]]
    assert all(max(len(i.prompt_ids) for i in b) + max(i.max_tokens for i in b) <= 32 for b in batches)


# ---------------------------------------------------------------- routing


def test_parse_weights() -> None:
    assert parse_weights('{"1": 90, "2": 10}') == {1: 90, 2: 10}
    for bad in ("", "[]", "{}", '{"a": 1}', '{"1": -1}', '{"1": 0}', '{"1": 1.5}', '{"0": 5}'):
        with pytest.raises(WeightsError, match="weights="):
            parse_weights(bad)


def test_choose_version_follows_weights() -> None:
    """4000 draws at 75/25: the count of version 2 is ~Binomial(4000, .25), sd 27; the band is +-5.8 sd."""
    rng = random.Random(0)
    picks = [choose_version({1: 75, 2: 25, 3: 0}, rng) for _ in range(4000)]
    assert 3 not in picks and 840 < picks.count(2) < 1160


def test_router_stats() -> None:
    s = RouterStats("m_engine", {1: 100})
    s.record(1, ok=True, latency_s=0.5)
    s.record(1, ok=False, latency_s=1.5)
    snap = json.loads(s.to_json())
    assert snap["versions"]["1"] == {"requests": 2, "errors": 1, "latency_sum_s": 2.0, "latency_max_s": 1.5}


# ---------------------------------------------------------------- models under a fake pb_utils


def llm_model(monkeypatch: pytest.MonkeyPatch, runner: FakeRunner, tmp_path: Path, text: EngineText | None = None):
    pb = make_fake_pb_utils()
    monkeypatch.setattr(llm_mod, "pb_utils", pb)
    model = llm_mod.TritonPythonModel()
    model.model_name, model.version = "m_engine", "1"
    model.log = llm_mod.Log("m_engine v1")
    model.host = llm_mod.EngineHost(runner, tmp_path, model.log, text or EngineText())
    return model


def test_llm_stops_at_the_engines_eos_unless_the_request_ignores_it(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    model = llm_model(monkeypatch, FakeRunner(), tmp_path, EngineText(eos_token_ids=(9,)))
    out = model.execute([
        FakeRequest({"input_ids": [[7]], "max_tokens": [[4]]}),
        FakeRequest({"input_ids": [[7]], "max_tokens": [[4]], "ignore_eos": [[True]]}),
        FakeRequest({"input_ids": [[7]], "max_tokens": [[4]], "ignore_eos": [[True]], "stop_token_ids": [[10]]}),
    ])
    assert out[0].output("output_ids").tolist() == [[8, 9]] and out[0].output("finish_reason")[0, 0] == b"stop"
    assert out[0].output("prompt_tokens").tolist() == [[1]]
    assert out[1].output("output_ids").tolist() == [[8, 9, 10, 11]] and out[1].output("finish_reason")[0, 0] == b"length"
    assert out[2].output("output_ids").tolist() == [[8, 9, 10]] and out[2].output("finish_reason")[0, 0] == b"stop"


def test_llm_execute_batches_and_isolates_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runner = FakeRunner(FakeLimits(max_batch_size=2, max_input_len=8, max_seq_len=32))
    model = llm_model(monkeypatch, runner, tmp_path)
    reqs = [
        FakeRequest({"input_ids": [[1, 2]], "max_tokens": [[3]]}),
        FakeRequest({"input_ids": [[5]], "max_tokens": [[2]]}),
        FakeRequest({"input_ids": [list(range(9))], "max_tokens": [[2]]}),  # too long
        FakeRequest({"max_tokens": [[2]]}),  # no prompt
        FakeRequest({"input_ids": [[7]], "max_tokens": [[4]], "stop_token_ids": [[9]]}),
        FakeRequest({"input_ids": [[10]], "max_tokens": [[1]]}),
    ]
    out = model.execute(reqs)
    assert len(out) == 6
    assert out[0].output("output_ids").tolist() == [[3, 4, 5]]
    assert out[1].output("output_ids").tolist() == [[6, 7]]  # truncated to its own max_tokens
    assert out[1].output("finish_reason").tolist() == [[b"length"]]
    assert "max_input_len=8" in out[2].error().message() and "m_engine v1" in out[2].error().message()
    assert "exactly one of" in out[3].error().message()
    assert out[4].output("output_ids").tolist() == [[8, 9]] and out[4].output("finish_reason")[0, 0] == b"stop"
    assert out[5].output("output_ids").tolist() == [[11]]
    # greedy requests without stop tokens share calls of at most max_batch_size; the stop-token one runs alone
    assert [len(c["prompts"]) for c in runner.calls] == [2, 1, 1]


def test_llm_generate_failure_is_a_response(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runner = FakeRunner()

    def boom(*a, **k):
        raise RuntimeError("CUDA out of memory")

    runner.generate = boom
    model = llm_model(monkeypatch, runner, tmp_path)
    out = model.execute([FakeRequest({"input_ids": [[1]], "max_tokens": [[1]]})])
    assert "CUDA out of memory" in out[0].error().message()


def _kwargs_loader(engine_dir: Path, **kwargs: str) -> None:
    raise RuntimeError(f"loader kwargs {kwargs}")


@pytest.mark.parametrize(("given", "kwargs"), [
    ({}, "{'device': 'cpu'}"),
    ({"decode_gemm": "Torch"}, "{'device': 'cpu', 'overrides': {'decode_gemm': 'torch'}}"),
    ({"decode_gemm": ""}, "{'device': 'cpu'}"),
    ({"speculative": "ngram"}, "{'device': 'cpu', 'overrides': {'speculative': 'ngram'}}"),
])
def test_llm_passes_decode_kernel_choices_to_the_loader_only_when_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                      given: dict[str, str], kwargs: str) -> None:
    """``decode_gemm`` (auto | triton | torch) reaches the loader as an engine option override (`overrides`);
    unset or empty, a custom loader gets no new argument."""
    monkeypatch.setattr(llm_mod, "pb_utils", make_fake_pb_utils())
    params = {"engine_loader": {"string_value": "test_triton_units:_kwargs_loader"}}
    params.update({name: {"string_value": value} for name, value in given.items()})
    args = {"model_name": "m_engine", "model_version": "1", "model_repository": str(tmp_path),
            "model_instance_kind": "CPU", "model_config": json.dumps({"parameters": params})}
    with pytest.raises(RuntimeError, match=re.escape(f"loader kwargs {kwargs}")):
        llm_mod.TritonPythonModel().initialize(args)


def test_llm_initialize_error_names_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(llm_mod, "pb_utils", make_fake_pb_utils())
    args = {"model_name": "m_engine", "model_version": "3", "model_repository": str(tmp_path),
            "model_instance_kind": "CPU", "model_config": json.dumps({"parameters": {}})}
    with pytest.raises(RuntimeError, match=r"\[m_engine v3\] cannot load the engine in .*3/engine"):
        llm_mod.TritonPythonModel().initialize(args)


def router_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, handler, weights: str, *,
                 target_decoupled: bool = False):
    pb = make_fake_pb_utils(handler)
    monkeypatch.setattr(router_mod, "pb_utils", pb)
    model_dir = tmp_path / "m"
    model_dir.mkdir(exist_ok=True)
    (model_dir / ROUTING_FILE).write_text(json.dumps({"weights": json.loads(weights), "load_id": "load-1",
                                                      "target_model": "m_engine",
                                                      "target_decoupled": str(target_decoupled).lower()}))
    model = router_mod.TritonPythonModel()
    model.initialize({"model_name": "m", "model_repository": str(model_dir), "model_config": json.dumps(
        {"parameters": {"target_model": {"string_value": "m_engine"}, "seed": {"string_value": "1"}}})})
    return model, pb


def test_router_forwards_counts_and_reports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def handler(model, version, inputs, requested):
        if version == 2:
            return FakeResponse(error=make_fake_pb_utils().TritonError("v2 broke"))
        return FakeResponse([FakeTensor("output_ids", np.array([[version]], dtype=np.int32))])

    model, pb = router_model(monkeypatch, tmp_path, handler, '{"1": 50, "2": 50}')
    reqs = [FakeRequest({"input_ids": [[1]], "max_tokens": [[1]]}, ("output_ids", "routed_version"))
            for _ in range(40)]
    out = answers(model, reqs)
    routed = [r.output("routed_version") for r in out]
    ok = [r for r in out if not r.has_error()]
    assert ok and all(r.output("routed_version")[0, 0] == 1 for r in ok)
    assert any(r.has_error() and "m_engine version 2: v2 broke" in r.error().message() for r in out)
    assert {c[3] and tuple(c[3]) for c in pb.calls} == {("output_ids",)}  # router-only names not forwarded
    assert set(pb.preferred_memory) == {("preferred", pb.TRITONSERVER_MEMORY_CPU, 0)}  # outputs in host memory
    assert len(routed) == 40
    stats = model.stats.snapshot()
    assert stats["versions"]["1"]["errors"] == 0 and stats["versions"]["2"]["errors"] == stats["versions"]["2"][
        "requests"] > 0
    assert stats["versions"]["1"]["requests"] + stats["versions"]["2"]["requests"] == 40


def test_router_merges_the_responses_of_a_streaming_target(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A decoupled llm answers a BLS call in several responses (and an empty final one): one answer, with
    every token in order, the text joined and the last finish reason; counted once."""
    def handler(model, version, inputs, requested):
        def piece(ids, text, reason=None):
            tensors = [FakeTensor("output_ids", np.array([ids], dtype=np.int32)),
                       FakeTensor("text_output", np.array([[text]], dtype=object))]
            if reason:
                tensors.append(FakeTensor("finish_reason", np.array([[reason]], dtype=object)))
            return FakeResponse(tensors)
        return [piece([7, 8], b"he"), piece([9], b"llo", b"length"), FakeResponse([])]

    model, pb = router_model(monkeypatch, tmp_path, handler, '{"1": 100}')
    (out,) = answers(model, [FakeRequest({"input_ids": [[1]], "max_tokens": [[3]]})])
    assert not out.has_error() and len(pb.calls) == 2  # refused as a plain call, then called decoupled
    answers(model, [FakeRequest({"input_ids": [[1]], "max_tokens": [[3]]})])
    assert len(pb.calls) == 3  # learnt: straight to the decoupled call
    assert out.output("output_ids").tolist() == [[7, 8, 9]]
    assert out.output("text_output")[0, 0] == b"hello" and out.output("finish_reason")[0, 0] == b"length"
    assert out.output("routed_version")[0, 0] == 1
    assert model.stats.snapshot()["detail"]["1"]["output_tokens"] == 3 + 3


def test_router_told_its_target_is_decoupled_never_makes_a_plain_call(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """With ``target_decoupled`` in its routing file the first call is already decoupled: no plain call whose
    refusal can take seconds to come back."""
    def handler(model, version, inputs, requested):
        return [FakeResponse([FakeTensor("output_ids", np.array([[4, 5]], dtype=np.int32))]), FakeResponse([])]

    model, pb = router_model(monkeypatch, tmp_path, handler, '{"1": 100}', target_decoupled=True)
    (out,) = answers(model, [FakeRequest({"input_ids": [[1]], "max_tokens": [[2]]})])
    assert not out.has_error() and out.output("output_ids").tolist() == [[4, 5]]
    assert len(pb.calls) == 1  # straight to the decoupled call


def test_router_holds_a_decoupled_call_until_the_stub_is_done_with_it(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """The bundled python backend frees a decoupled call's tensors without the GIL if its own thread drops
    the last reference (the H200's router segfaults): the router lets go of a call only after a round trip
    through the stub's queue, and sends no output its client did not ask for (the stub's send drops those
    without the GIL too). `answers` checks both on every router test; here the parts are named."""
    def handler(model, version, inputs, requested):
        return [FakeResponse([FakeTensor("output_ids", np.array([[4, 5]], dtype=np.int32))]), FakeResponse([])]

    model, _ = router_model(monkeypatch, tmp_path, handler, '{"1": 100}', target_decoupled=True)
    freed = STUB_QUEUE.freed_by_stub
    (out,) = answers(model, [FakeRequest({"input_ids": [[1]], "max_tokens": [[2]]}, ("output_ids",))])
    assert [t.name() for t in out.output_tensors()] == ["output_ids"]  # routed_version was not asked for
    cancelled = FakeRequest({"input_ids": [[1]], "max_tokens": [[2]]})
    cancelled.sender.cancelled = True  # its barrier is answered from a cache: the call is parked instead
    parked = bls_mod.parked_calls()
    (out,) = answers(model, [cancelled])
    assert out.output("routed_version")[0, 0] == 1 and bls_mod.parked_calls() == parked + 1
    gc.collect()
    assert STUB_QUEUE.freed_by_stub == freed


def stream_router_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, handler):
    from serving.triton.models import stream_router as stream_mod

    pb = make_fake_pb_utils(handler)
    monkeypatch.setattr(stream_mod, "pb_utils", pb)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / ROUTING_FILE).write_text(json.dumps({"weights": {"1": 100}, "load_id": "load-1",
                                                           "target_model": "m_v{version}"}))
    model = stream_mod.TritonPythonModel()
    model.initialize({"model_name": "m_stream", "model_repository": str(tmp_path / "m_stream"),
                      "model_config": json.dumps({"parameters": {"target_model": {"string_value": "m_v{version}"},
                                                                 "counters_model": {"string_value": "m"}}})})
    return model


def _streamed(model, request: FakeRequest) -> list:
    assert model.execute([request]) is None
    assert request.sender.done.wait(10)
    model.finalize()
    gc.collect()
    return request.sender.sent


@pytest.mark.parametrize("fails", [False, True])
def test_stream_router_forwards_each_response_and_holds_the_call_until_the_stub_is_done(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fails: bool) -> None:
    """Each response of the version goes on as it comes (only the outputs asked for), then an empty final
    one; an error response ends the stream with it, and the rest of the call is still taken, so the stub
    finishes the call before the router lets go of it."""
    def piece(ids):
        return FakeResponse([FakeTensor("output_ids", np.array([ids], dtype=np.int32)),
                             FakeTensor("prompt_tokens", np.array([[1]], dtype=np.int32))])

    def handler(model, version, inputs, requested):
        assert model == "m_v1"
        broke = FakeResponse(error=make_fake_pb_utils().TritonError("v1 broke"))
        return [piece([7]), broke, piece([8]), FakeResponse([])] if fails else [piece([7]), piece([8]), FakeResponse([])]

    freed = STUB_QUEUE.freed_by_stub
    model = stream_router_model(monkeypatch, tmp_path, handler)
    request = FakeRequest({"input_ids": [[1]], "max_tokens": [[2]]}, ("output_ids", "routed_version"))
    sent = _streamed(model, request)
    assert not request.sender.pruned and STUB_QUEUE.freed_by_stub == freed
    streamed = [r.output("output_ids").tolist() for r, flags in sent if r is not None and not r.has_error()]
    assert streamed == ([[[7]]] if fails else [[[7]], [[8]]])
    final, flags = sent[-1]
    assert flags == COMPLETE_FINAL and (final.has_error() and "m_v1: v1 broke" in final.error().message()
                                        if fails else final is None)


def test_routing_file_says_target_decoupled_when_its_llm_is_staged_decoupled(tmp_path: Path) -> None:
    from serving.triton.repository import router_routing, write_router

    def decoupled(**kwargs) -> bool:
        config = write_router(root, "m", {1: 100}, **kwargs)
        assert "target_decoupled" not in config["parameters"] and "weights" not in config["parameters"]
        return router_routing(root, "m").target_decoupled

    root = tmp_path / "repo"
    assert not decoupled()  # no llm staged
    engine = fake_engine_dir(tmp_path)
    repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, device_kind="cpu")
    assert not decoupled()  # a plain llm
    repo_mod.stage_engine_version(root, "m", engine, max_batch_size=8, parameters={"decoupled": "true"})
    assert not decoupled()  # staged, not served yet
    repo_mod.set_served_versions(root, "m", [1, 2])
    assert decoupled()
    assert not decoupled(target_model="other")


def test_a_weight_change_rewrites_only_the_routing_file(tmp_path: Path) -> None:
    """The config and model file stay byte for byte (Triton would reload a changed config); the routing
    file is replaced (a new inode, a new load_id), so the router instances see the change."""
    from serving.triton.repository import router_routing, write_router

    root = tmp_path / "repo"
    first = write_router(root, "m", {1: 100})
    files = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (root / "m" / "config.pbtxt", root / "m" / "1" / "model.py")}
    before = router_routing(root, "m")
    inode = (root / "m" / ROUTING_FILE).stat().st_ino
    assert write_router(root, "m", {1: 90, 2: 10}) == first
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == files
    after = router_routing(root, "m")
    assert after.weights == {1: 90, 2: 10} and after.load_id != before.load_id
    assert (root / "m" / ROUTING_FILE).stat().st_ino != inode
    with pytest.raises(ConfigError, match=r"router 'm': weights=\{1: 0\}"):
        write_router(root, "m", {1: 0})
    assert router_routing(root, "m") == after  # a refused write changes nothing


def test_router_follows_its_routing_file_and_counts_each_change_apart(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """A new routing file reaches the next batch; the old weights' counters are closed (written, final)
    and the new ones start at zero; a bad file keeps the routing in force and says so."""
    def handler(model, version, inputs, requested):
        return FakeResponse([FakeTensor("output_ids", np.array([[version]], dtype=np.int32))])

    model, _ = router_model(monkeypatch, tmp_path, handler, '{"1": 100}')
    def fresh(n: int) -> list[FakeRequest]:
        return [FakeRequest({"input_ids": [[1]], "max_tokens": [[1]]}, ("output_ids", "routed_version")) for _ in range(n)]

    one = fresh(5)
    assert {int(r.output("routed_version")[0, 0]) for r in answers(model, one)} == {1}
    routing = tmp_path / "m" / ROUTING_FILE
    tmp = routing.with_suffix(".tmp")
    tmp.write_text(json.dumps({"weights": {"1": 0, "2": 100}, "load_id": "load-2", "target_model": "m_engine"}))
    os.replace(tmp, routing)
    two = fresh(3)
    assert {int(r.output("routed_version")[0, 0]) for r in answers(model, two)} == {2}
    snap = model.stats.snapshot()
    assert snap["load_id"] == "load-2" and snap["versions"] == {"2": pytest.approx(
        {"requests": 3, "errors": 0, "latency_sum_s": 0.0, "latency_max_s": 0.0}, abs=1.0)}
    assert snap["cumulative"]["1"]["requests"] == 5 and snap["generations"] == 2
    closed = [json.loads(p.read_text()) for p in (tmp_path / "m" / "counters").glob("*.json")]
    assert [d["final"] for d in closed if d["load_id"] == "load-1"] == [True]
    tmp.write_text("{not json")
    os.replace(tmp, routing)
    assert {int(r.output("routed_version")[0, 0]) for r in answers(model, fresh(3))} == {2}
    assert model.weights == {1: 0, 2: 100}


def test_an_older_enginewrights_router_is_upgraded_before_a_restart_loads_it(tmp_path: Path) -> None:
    """A router written when the weights lived in its config (no routing file parameter; a model file that
    reads them there) gets this version's model file and config, keeping the weights it routed by."""
    root = tmp_path / "repo"
    repo_mod.write_router(root, "m", {1: 30, 2: 70})
    old_config = ('name: "m"\nbackend: "python"\nparameters {\n  key: "weights"\n  value {\n'
                  '    string_value: "{\\"1\\": 30, \\"2\\": 70}"\n  }\n}\n')
    (root / "m" / "config.pbtxt").write_text(old_config)
    (root / "m" / "1" / "model.py").write_text("# an older router.py\n")
    (root / "m" / ROUTING_FILE).write_text(json.dumps({"weights": {"1": 30, "2": 70}, "load_id": "old",
                                                       "target_model": "m_v{version}"}))  # as it was written
    assert repo_mod.upgrade_router_files(root, "m")
    assert (root / "m" / "1" / "model.py").read_bytes() == (repo_mod.MODELS_DIR / "router.py").read_bytes()
    cfg = parse_pbtxt((root / "m" / "config.pbtxt").read_text())
    assert cfg.parameters[ROUTING_PARAMETER].string_value == ROUTING_FILE and "weights" not in cfg.parameters
    assert repo_mod.router_routing(root, "m").weights == {1: 30, 2: 70}
    assert repo_mod.router_routing(root, "m").load_id == "old"
    assert not repo_mod.upgrade_router_files(root, "m")  # current already
    assert not repo_mod.upgrade_router_files(root, "m_v1")  # not a router


def test_router_without_a_routing_file_fails_initialize_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setattr(router_mod, "pb_utils", make_fake_pb_utils(None))
    model = router_mod.TritonPythonModel()
    with pytest.raises(RuntimeError, match=rf"\[m\] routing file {re.escape(str(tmp_path))}.*{ROUTING_FILE}"):
        model.initialize({"model_name": "m", "model_repository": str(tmp_path), "model_config": json.dumps(
            {"parameters": {"target_model": {"string_value": "m_engine"}}})})


def test_router_bad_weights_fail_initialize(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"\[m\] routing file .*weights="):
        router_model(monkeypatch, tmp_path, None, '{"1": 0}')


def test_senders_default_to_one_per_four_cpus_from_one_to_four() -> None:
    assert [params_mod.default_senders(n) for n in (1, 2, 7, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    assert params_mod.count({}, "idle_senders") == params_mod.default_senders()
    assert params_mod.count({}, "busy_senders") == params_mod.default_senders()
    assert params_mod.count({"idle_senders": "3"}, "idle_senders") == 3


@pytest.mark.parametrize("name, value", [("stream_interval_ms", "-5"), ("stream_interval_ms", "soon"),
                                         ("gil_switch_interval_ms", "0"), ("gil_switch_interval_ms", "inf"),
                                         ("idle_senders", "0"), ("idle_senders", "2.5"), ("idle_senders", "65"),
                                         ("busy_senders", "0"),
                                         ("admit_gap_ms", "-1"), ("decode_gemm", "cublas"),
                                         ("warmup", "maybe"), ("in_flight", "2"), ("decoupled", "yes please"),
                                         ("cuda_alloc_conf", "expandable_segments"), ("prefix_caching", "maybe"),
                                         ("execute_waits_launches", "sometimes"), ("speculative", "eagle"),
                                         ("cuda_alloc_conf", "max_split_size_mb:64,turbo:1")])
def test_llm_config_refuses_a_bad_numeric_parameter_by_name(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}='{value}'"):
        llm_config("m_engine", versions=[1], max_batch_size=8, device_kind="KIND_CPU",
                   parameters={"decoupled": "true", name: value})


@pytest.mark.parametrize("raw, default, value", [(None, True, True), ("", False, False), ("off", True, False),
                                                 ("False", True, False), ("0", True, False), ("On", False, True),
                                                 (" yes ", False, True)])
def test_boolean_parameters_read_the_same_words_everywhere(raw: str | None, default: bool, value: bool) -> None:
    name = "warmup" if default else "decoupled"
    assert params_mod.BOOLEAN_PARAMETERS[name] is default
    assert params_mod.flag({} if raw is None else {name: raw}, name) is value


def test_the_cuda_allocator_setting_reaches_the_models_process_before_torch_allocates(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    assert params_mod.cuda_alloc_conf({}) is None
    assert params_mod.cuda_alloc_conf({"cuda_alloc_conf": "expandable_segments:True,max_split_size_mb:512"}) == \
        "expandable_segments:True,max_split_size_mb:512"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    model = llm_mod.TritonPythonModel()
    with pytest.raises(RuntimeError):  # no engine in the folder: the load fails after the setting is applied
        model.initialize({"model_name": "m_v1", "model_version": "1", "model_repository": str(tmp_path),
                          "model_instance_kind": "CPU", "model_config": json.dumps(
                              {"parameters": {"cuda_alloc_conf": {"string_value": "expandable_segments:True"}}})})
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_llm_config_keeps_good_millisecond_parameters() -> None:
    cfg = llm_config("m_engine", versions=[1], max_batch_size=8, device_kind="KIND_CPU",
                     parameters={"stream_interval_ms": "20", "gil_switch_interval_ms": "0.05", "idle_senders": "8"})
    assert cfg["parameters"]["stream_interval_ms"] == {"string_value": "20"}
    assert cfg["parameters"]["idle_senders"] == {"string_value": "8"}


class ListLog:
    prefix = "llm_1"

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    error = info


class WarmRunner:
    """A runner that records its warm-up and hands out a scheduler whose loop returns at once."""

    def __init__(self, device_type: str) -> None:
        self.calls: list[str] = []
        self.device = SimpleNamespace(type=device_type)

    def warm_up_prefill(self) -> None:
        self.calls.append("warm_up")

    def scheduler(self, **options) -> object:
        self.calls.append(f"scheduler admit_every_steps={options['admit_every_steps']}")
        runner = self

        class Loop:
            work_while = None
            exclusive_launch = True

            def run_forever(self) -> None:
                runner.calls.append("run")

        return Loop()


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
@pytest.mark.parametrize("warmup", [True, False])
def test_the_engine_thread_warms_up_on_a_gpu_then_runs_the_runners_scheduler(warmup, device_type):
    runner, log = WarmRunner(device_type), ListLog()
    engine = llm_mod.EngineThread(runner, log, device_id=None, warmup=warmup, admit_every_steps=8)
    engine.start(timeout_s=10)
    engine.thread.join(10)
    warmed = warmup and device_type == "cuda"  # a CPU has no kernels to compile and no graphs to capture
    assert runner.calls == ["warm_up"] * warmed + ["scheduler admit_every_steps=8", "run"]
    assert any("engine thread ready in" in line and f"warmup={warmup} on {device_type}" in line for line in log.lines)


# ---------------------------------------------------------------- one model per version, fit check


def test_routers_call_the_model_of_the_version_their_weights_pick() -> None:
    from serving.triton.models.routing import target_label, target_of

    assert target_of("m_v{version}", 7) == ("m_v7", -1)
    assert target_of("m_engine", 7) == ("m_engine", 7)  # the old layout: one model, numbered versions
    assert target_label("m_v{version}", 7) == "m_v7" and target_label("m_engine", 7) == "m_engine version 7"
    from serving.triton.client import is_engine_model

    assert is_engine_model("m_v12") and is_engine_model("m_engine") and not is_engine_model("m")


def test_kv_cache_and_fit_figures() -> None:
    from serving.engine.memory import kv_cache_bytes
    from serving.triton.metrics import parse_metrics
    from tasks.fit import HEADROOM_FRACTION, device_memory, fit_problems

    # Llama-3.2-1B at batch 8 x 2048 tokens in bf16: 16 layers, 8 KV heads of 64
    assert kv_cache_bytes(n_layers=16, n_kv_heads=8, head_dim=64, max_batch_size=8, max_seq_len=2048,
                          dtype="bfloat16") == 512 * 1024**2
    samples = parse_metrics('nv_gpu_memory_total_bytes{gpu_uuid="GPU-a"} 1000\n'
                            'nv_gpu_memory_used_bytes{gpu_uuid="GPU-a"} 900\n'
                            'nv_gpu_memory_total_bytes{gpu_uuid="GPU-b"} 1000\n'
                            'nv_gpu_memory_used_bytes{gpu_uuid="GPU-b"} 100\n'
                            'nv_cpu_memory_total_bytes 5000\nnv_cpu_memory_used_bytes 1000\n')
    gpus = device_memory(samples, "gpu")
    assert [(d.device, d.free_bytes) for d in gpus] == [("gpu GPU-a", 100), ("gpu GPU-b", 900)]
    assert device_memory(samples, "cpu")[0].free_bytes == 4000 and device_memory([], "gpu") == []
    need = 900 - int(HEADROOM_FRACTION * 1000)  # exactly GPU-b's room
    problems = fit_problems(need, gpus, where="http://t")
    assert len(problems) == 1 and problems[0].startswith("http://t gpu GPU-a: needs 0 MiB, has 0 MiB free")
    assert fit_problems(need + 1, gpus, where="http://t")[1].startswith("http://t gpu GPU-b")


def test_free_ports_are_distinct_and_avoid_the_ports_already_chosen():
    from serving.triton.process import free_ports

    for _ in range(50):  # one at a time, the OS handed the same port twice (Triton then would not start)
        ports = free_ports("127.0.0.1", 3)
        assert len(set(ports)) == 3
    taken = tuple(free_ports("127.0.0.1", 2))
    assert not set(free_ports("127.0.0.1", 5, taken=taken)) & set(taken)
