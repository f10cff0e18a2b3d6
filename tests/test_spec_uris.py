"""The spec checks every URI when it is loaded (issue 23, finding 8): the shipped spec's relative
``file://.state/artifacts`` is resolved then (it used to fail at publish, after both gates), bad URIs are
refused naming the field, and publish retries only what another try can fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.spec import SpecError, load_spec, parse_spec
from registry.errors import StoreConfigError, UploadError
from registry.stores.open import open_store
from tasks.publish import is_retryable, publish_task

SHIPPED = Path(__file__).resolve().parents[1] / "deployments" / "specs" / "tiny-llama.yaml"


def spec_with(**changes: object) -> dict:
    data = {"source": {"checkpoint": "ckpt"}, "mlflow": {"tracking_uri": "sqlite:///x.db", "model_name": "m"},
            "artifacts": {"uri": "file:///tmp/a"}}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        data[section][key] = value
    return data


def test_the_shipped_spec_opens_its_store_as_the_readme_runs_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the README runs the commands in the repository's root
    spec = load_spec(SHIPPED)
    assert spec.artifacts.uri == (tmp_path / ".state" / "artifacts").as_uri()
    assert str(open_store(spec.artifacts.uri)).endswith(".state/artifacts')")


@pytest.mark.parametrize(("field", "value", "words"), [
    ("artifacts__uri", "ftp://host/x", "must start with file:// or s3://"),
    ("artifacts__uri", "s3:///prefix", "names no bucket"),
    ("artifacts__uri", "file://", "names no folder"),
    ("mlflow__tracking_uri", "htp://mlflow:5000", "tracking URI"),
    ("mlflow__tracking_uri", "http:///", "names no host"),
    ("mlflow__tracking_uri", "sqlite:///", "names no database file"),
])
def test_a_bad_uri_is_refused_at_load_naming_the_field(field, value, words):
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with(**{field: value}))
    assert field.replace("__", ".") in str(caught.value) and words in str(caught.value)


def test_publish_retries_only_what_another_try_can_fix():
    assert not is_retryable(StoreConfigError("file URIs must be absolute and local"))
    assert not is_retryable(ValueError("bad setting"))
    assert is_retryable(UploadError("connection reset during part 3"))
    assert is_retryable(ConnectionError("refused"))
    assert publish_task.retry_condition_fn is not None and publish_task.retries == 2
