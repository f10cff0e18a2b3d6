"""Pure helpers of the ``router`` model: weights, weighted choice and per-version counters."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field


class WeightsError(ValueError):
    """The router's ``weights`` parameter is malformed."""


def parse_weights(text: str) -> dict[int, int]:
    """``'{"1": 90, "2": 10}'`` -> ``{1: 90, 2: 10}``; weights are integers >= 0 with a positive sum."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise WeightsError(f"router parameter weights={text!r} is not JSON: {exc}") from exc
    if not isinstance(raw, dict) or not raw:
        raise WeightsError(f"router parameter weights={text!r} must be a non-empty JSON object")
    weights: dict[int, int] = {}
    for key, value in raw.items():
        try:
            version, weight = int(key), int(value)
        except (TypeError, ValueError) as exc:
            raise WeightsError(f"router parameter weights={text!r}: entry {key!r}: {value!r} is not int: int") from exc
        if version < 1 or weight < 0 or weight != value:
            raise WeightsError(f"router parameter weights={text!r}: entry {key!r}: {value!r} needs version >= 1 "
                               "and an integer weight >= 0")
        weights[version] = weight
    if sum(weights.values()) <= 0:
        raise WeightsError(f"router parameter weights={text!r} has no positive weight")
    return weights


def dump_weights(weights: dict[int, int]) -> str:
    """Inverse of ``parse_weights`` (sorted keys, so equal weights give equal configs)."""
    return json.dumps({str(v): int(w) for v, w in sorted(weights.items())})


def choose_version(weights: dict[int, int], rng: random.Random) -> int:
    """Weighted random choice of a version; versions with weight 0 are never chosen."""
    versions = [v for v, w in weights.items() if w > 0]
    return rng.choices(versions, weights=[weights[v] for v in versions], k=1)[0]


@dataclass
class VersionCounters:
    requests: int = 0
    errors: int = 0
    latency_sum_s: float = 0.0
    latency_max_s: float = 0.0


@dataclass
class RouterStats:
    """Per-version counters since this router instance loaded (a weight change reloads it)."""

    target_model: str
    weights: dict[int, int]
    loaded_at: float = field(default_factory=time.time)
    versions: dict[int, VersionCounters] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, version: int, *, ok: bool, latency_s: float) -> None:
        with self._lock:
            c = self.versions.setdefault(version, VersionCounters())
            c.requests += 1
            c.errors += 0 if ok else 1
            c.latency_sum_s += latency_s
            c.latency_max_s = max(c.latency_max_s, latency_s)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "target_model": self.target_model,
                "weights": {str(v): w for v, w in sorted(self.weights.items())},
                "loaded_at": self.loaded_at,
                "versions": {
                    str(v): {"requests": c.requests, "errors": c.errors, "latency_sum_s": c.latency_sum_s,
                             "latency_max_s": c.latency_max_s}
                    for v, c in sorted(self.versions.items())
                },
            }

    def to_json(self) -> str:
        return json.dumps(self.snapshot(), sort_keys=True)
