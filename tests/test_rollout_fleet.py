"""Fleets: two local Triton servers promoted as one. A load failure injected on ONE of them (its copy of
the candidate cannot load: ``tasks.fault_injection`` ``fail_load``) rolls BOTH back to the live version,
with requests flowing to both the whole time; without the fault the same version goes live on both."""

from __future__ import annotations

import logging

import pytest
import tritonclient.http as httpclient
from test_rollout_support import Load, assert_consistent, first_release, make_spec, publish, start_server
from triton_support import TritonServers, make_tiny_engine

from flows.promote import StageFailed, promote
from registry import model_registry as mr
from tasks.fault_injection import write_fault

pytestmark = pytest.mark.slow
NAME = "fleet"
STEPS = [{"set_weight": 50}, {"analysis": {"requests": 8, "compare": None}}, {"set_weight": 100}]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("fleet")
    for seed in (0, 1):
        publish(tmp, NAME, make_tiny_engine(tmp / "engines", seed=seed))
    servers = TritonServers(tmp)
    try:
        procs = [start_server(servers, tmp / f"repo-{i}") for i in range(2)]
        yield {"tmp": tmp, "procs": procs, "spec": make_spec(tmp, NAME, procs, steps=STEPS, warmup_requests=1)}
    finally:
        servers.stop_all()


def test_load_failure_on_one_endpoint_rolls_back_both(world, caplog: pytest.LogCaptureFixture) -> None:
    spec, procs = world["spec"], world["procs"]
    first_release(spec)
    assert_consistent(spec, 1)
    write_fault(procs[1].model_repository, NAME, 2, {"fail_load": "injected on server 2 only"})
    # the failing candidate also brings a parameter of its own, which must never reach version 1's model
    parameters = {**spec.triton.engine_parameters, "stream_interval_ms": "7"}
    failing = spec.model_copy(update={"triton": spec.triton.model_copy(update={"engine_parameters": parameters})})
    with Load([p.http_url for p in procs], NAME) as load:
        load.mark("before")
        load.wait_for(20, timeout_s=60)
        load.mark("failed fleet promotion of v2")
        caplog.set_level(logging.INFO, logger="tasks.rollback")
        with pytest.raises(StageFailed, match="injected on server 2 only"):
            promote(failing, "2")
        rolled_back = [r for r in caplog.records if "rolled back to version 1" in r.getMessage()]
        assert len(rolled_back) == len(procs)  # once per endpoint: the flow does not redo stage()'s rollback
        load.mark("after")
        load.wait_for(20, timeout_s=60)
    print("\n" + load.table())
    assert_consistent(spec, 1)
    for proc in procs:  # what each Triton has loaded: version 1 with its own parameters
        loaded = httpclient.InferenceServerClient(proc.http_url.removeprefix("http://")).get_model_config(
            f"{NAME}_v1")
        assert {k: v["string_value"] for k, v in loaded["parameters"].items()} == {
            **spec.triton.engine_parameters, "max_queue_size": str(spec.triton.max_queue_size)}  # the engine's queue
    tags = mr.get_version_tags(spec.mlflow.tracking_uri, NAME, "2")
    assert tags["rollout"] == "failed" and "injected on server 2 only" in tags["rollout.reason"]
    records = load.records()
    assert {r.endpoint for r in records} == {p.http_url for p in procs}
    failures = [r.error for r in records if not r.ok]
    assert not failures, sorted(set(failures))[:3]

    write_fault(procs[1].model_repository, NAME, 2, None)
    result = promote(spec, "2")
    assert result.rollout.outcome == "Successful" and len(result.endpoints) == 2
    assert {r.endpoint for r in result.rollout.records} == {p.http_url for p in procs}
    assert_consistent(spec, 2)
