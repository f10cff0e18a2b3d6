"""A rollout's MLflow record (registry.rollout_record) against the embedded sqlite store: the tag names and
values existing deployments carry, the 5000-character clip, a hold's decision used once, and which versions
count as once finished (what `enginewright rollback` goes back to)."""

from __future__ import annotations

import uuid

from services import mlflow_embedded  # noqa: F401

from registry import model_registry as mr
from registry import rollout_record as rr
from registry.embedded import EmbeddedLocations


def test_a_rollouts_record_in_mlflow(mlflow_embedded: EmbeddedLocations) -> None:  # noqa: F811
    uri, name = mlflow_embedded.tracking_uri, f"record-{uuid.uuid4().hex[:8]}"
    v1, v2, v3 = (int(mr.register_engine_version(uri, name, fingerprint=f"fp-{uuid.uuid4().hex[:8]}",
                                                  source=f"s3://releases/{name}/{i}/manifest.json"))
                  for i in range(3))

    rr.record_canary(uri, name, v1)
    rr.record_success(uri, name, v1, None, "promote")
    assert mr.get_version_by_alias(uri, name, mr.ALIAS_PRODUCTION) == str(v1)
    assert mr.get_version_by_alias(uri, name, mr.ALIAS_CANARY) is None
    assert mr.get_version_tags(uri, name, str(v1))["rollout"] == "succeeded"

    rr.record_canary(uri, name, v2)
    rr.record_hold(uri, name, v2, "undecided " * 1000)
    assert len(mr.get_version_tags(uri, name, str(v2))["rollout.hold"]) == rr.MAX_TAG_VALUE
    assert rr.take_decision(uri, name, v2) is None
    mr.set_version_tag(uri, name, str(v2), "rollout.decision", " Abort ")
    assert rr.take_decision(uri, name, v2) == "abort"
    assert mr.get_version_tags(uri, name, str(v2))["rollout.decision"] == "abort (used)"
    assert rr.take_decision(uri, name, v2) is None, "a decision is used once"
    rr.record_failure(uri, name, v2, "analysis at step 1 Failed: " + "x" * 6000, {"outcome": "Failed"}, reject=True)
    tags = mr.get_version_tags(uri, name, str(v2))
    assert (tags["rollout"], tags["rollout.analysis"], len(tags["rollout.reason"])) == \
        ("failed", '{"outcome": "Failed"}', rr.MAX_TAG_VALUE)
    assert tags["approval"] == "rejected" and tags["rejected_by"] == rr.ROLLOUT_AUTHOR
    assert rr.rejection_of(uri, name, v2) == tags["approval_note"] and rr.rejection_of(uri, name, v1) is None
    assert mr.get_version_by_alias(uri, name, mr.ALIAS_CANARY) is None

    rr.record_canary(uri, name, v3)
    rr.record_interrupted(uri, name, v3, "interrupted in phase shifting")
    assert mr.get_version_tags(uri, name, str(v3))["rollout"] == "interrupted"
    assert mr.get_version_by_alias(uri, name, mr.ALIAS_CANARY) is None

    rr.record_success(uri, name, v3, v1, "promote")
    rr.record_success(uri, name, v1, v3, "rollback")
    back = mr.get_version_tags(uri, name, str(v3))
    assert (back["rollout"], back["rolled_back_to"], back["superseded_by"]) == ("rolled_back", str(v1), str(v1))
    assert rr.finished_versions(uri, name) == [v1, v3]
