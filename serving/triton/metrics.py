"""Read Triton's Prometheus metrics endpoint into samples (stdlib only)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from serving.triton.errors import TritonUnreachableError
from serving.triton.rest import call

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Prometheus text exposition -> samples (comments skipped)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            labels = dict(_LABEL.findall(m.group(2) or ""))
            samples.append(Sample(m.group(1), labels, float(m.group(3))))
    return samples


def scrape(metrics_url: str, *, timeout_s: float = 10.0, setting: str = "triton.metrics_url") -> list[Sample]:
    """GET ``<metrics_url>/metrics`` and parse it."""
    try:
        resp = call(metrics_url, "GET", "/metrics", timeout_s=timeout_s, setting=setting)
    except TimeoutError as exc:
        raise TritonUnreachableError(str(exc)) from exc
    return parse_metrics(resp.body.decode())


def model_counter(samples: list[Sample], name: str, model: str, version: int | None = None) -> float:
    """Sum of metric ``name`` for ``model`` (and ``version`` if given)."""
    return sum(s.value for s in samples if s.name == name and s.labels.get("model") == model
               and (version is None or s.labels.get("version") == str(version)))
