"""A release that turns in-flight batching on (`engine_parameters: {decoupled: "true"}`) under a live
router, on a real Triton: the candidate is warmed up through `/generate` (HTTP `/infer` refuses a
decoupled model), the router reaches the decoupled llm with decoupled BLS and answers HTTP clients as
before, and requests flowing through the router the whole time all succeed."""

from __future__ import annotations

import pytest
from test_rollout_support import Load, assert_consistent, first_release, make_spec, publish, start_server
from triton_support import TritonServers, make_tiny_engine

from flows.promote import promote
from serving.triton.repository import llm_model_config

pytestmark = pytest.mark.slow
NAME = "inflight"
STEPS = [{"set_weight": 50}, {"analysis": {"requests": 8, "compare": None}}, {"set_weight": 100}]


def test_a_release_turns_in_flight_batching_on_with_requests_flowing(tmp_path) -> None:
    for seed in (0, 1):
        publish(tmp_path, NAME, make_tiny_engine(tmp_path / "engines", seed=seed))
    servers = TritonServers(tmp_path)
    try:
        proc = start_server(servers, tmp_path / "repo")
        plain = make_spec(tmp_path, NAME, [proc], steps=STEPS, engine_parameters={"warmup": "true"})
        first_release(plain)
        assert_consistent(plain, 1)
        inflight = make_spec(tmp_path, NAME, [proc], steps=STEPS, engine_parameters={"decoupled": "true"})
        with Load([proc.http_url], NAME) as load:
            load.mark("plain v1")
            load.gen.wait_for(10, timeout_s=60)
            load.mark("promoting v2 with decoupled on")
            result = promote(inflight, "2")
            load.mark("decoupled v2")
            load.gen.wait_for(10, timeout_s=60)
        print("\n" + load.table())
        assert result.rollout.outcome == "Successful"
        assert_consistent(inflight, 2)
        config = llm_model_config(proc.model_repository, NAME)
        assert config["model_transaction_policy"] == {"decoupled": True}
        records = load.gen.log.since(0)
        failures = [r.error for r in records if not r.ok]
        assert not failures, sorted(set(failures))[:3]
        assert {r.version for r in records if r.ok} == {1, 2}
        assert sum(r.version == 2 for r in records) >= 10
    finally:
        servers.stop_all()
