"""Pure helpers of the ``router`` model: weights, weighted / sticky choice and per-version counters.

Counters are kept per router *generation* (one instance between two weight changes: a new ``load_id`` in
the routing file starts a new one, see ``routing_file``).
Each generation (one instance of one load) writes its counters to ``<router dir>/counters/<generation>.json``
(temp file + ``os.replace``) after every execute and at finalize, so totals survive the reloads: a stats answer
carries this generation's counters (``versions``, ``detail``) and the sum over every generation that
ever wrote a file (``cumulative``). Analyses read deltas of ``cumulative`` between two reads.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import random
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.llm_client import NOT_LOADED_WORDS, OVERLOAD_WORDS
from serving.triton.models.requests import INVALID_REQUEST

# Upper bounds (seconds) of the latency histogram buckets; the last bucket is +Inf.
LATENCY_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STICKY_BUCKETS = 10_000  # a routing key hashes to one of these; weights are percents of them
COUNTERS_DIR = "counters"


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


@dataclass(frozen=True)
class RouterParams:
    """The config parameters both router models read (``initialize`` raises naming a bad one); the weights
    come from the routing file (``routing_file.FollowedRouting``)."""

    params: dict[str, str]
    target_model: str
    rng: random.Random


def read_router_params(model_name: str, model_config: str, *, required: tuple[str, ...] = ()) -> RouterParams:
    """Parse a router's config JSON; RuntimeError naming the model when ``target_model`` or one of
    ``required`` is missing."""
    config = json.loads(model_config)
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    for name in ("target_model", *required):
        if not params.get(name):
            raise RuntimeError(f"[{model_name}] config parameter {name} is missing or empty")
    rng = random.Random(int(params["seed"])) if params.get("seed") else random.Random()
    return RouterParams(params, params["target_model"], rng)


VERSION_FIELD = "{version}"


def target_of(target_model: str, version: int) -> tuple[str, int]:
    """The (model, model version) a request routed to engine ``version`` goes to: ``target_model`` with
    ``{version}`` filled in, version -1 (its only one), for a release with a model per version; else
    ``target_model`` itself at ``version``."""
    if VERSION_FIELD in target_model:
        return target_model.replace(VERSION_FIELD, str(int(version))), -1
    return target_model, int(version)


def target_label(target_model: str, version: int) -> str:
    """How errors name the target of ``version``: ``tiny_v2``, or ``m_engine version 2``."""
    model, model_version = target_of(target_model, version)
    return model if model_version == -1 else f"{model} version {model_version}"


def pick_version(weights: dict[int, int], routing_key: Any, rng: random.Random) -> int:
    """The version a request goes to: by its ``routing_key`` tensor's value (sticky) when it has one,
    else by weight."""
    if routing_key is None:
        return choose_version(weights, rng)
    raw = routing_key.as_numpy().reshape(-1)
    value = raw[0] if raw.size else b""
    return choose_sticky(weights, value if isinstance(value, bytes) else str(value).encode())


def forwarded_outputs(requested: tuple[str, ...], input_names: set[str], router_only: frozenset[str]) -> list[str]:
    """The outputs to ask the target for: the client's, without the router's own, or by default the
    token ids and finish reason (and the text, for a text prompt)."""
    names = [n for n in requested if n not in router_only]
    if names:
        return names
    text = "text_input" in input_names or "messages" in input_names
    return ["output_ids", "finish_reason", *(["text_output"] if text else [])]


def target_error_code(message: str, error: Any, codes: Any) -> Any:
    """The code of a target's error as the router's client should see it (``codes``: pb_utils.TritonError):
    INVALID_ARG for the llm's refusal of the request, UNAVAILABLE for a full queue or a target that is not
    loaded (a restarted Triton loading it), else the error's own code (None without codes). Triton 2.51's BLS
    reports every target error as INTERNAL: the words decide."""
    if INVALID_REQUEST in message and hasattr(codes, "INVALID_ARG"):
        return codes.INVALID_ARG
    words = message.lower()
    if any(w in words for w in OVERLOAD_WORDS + NOT_LOADED_WORDS) and hasattr(codes, "UNAVAILABLE"):
        return codes.UNAVAILABLE
    code = getattr(error, "code", None)
    return code() if callable(code) else None


def key_bucket(key: bytes) -> float:
    """A routing key -> a stable point in [0, 1) (SHA-256, so every process and restart agrees)."""
    digest = hashlib.sha256(key).digest()
    return (int.from_bytes(digest[:8], "big") % STICKY_BUCKETS) / STICKY_BUCKETS


def choose_sticky(weights: dict[int, int], key: bytes) -> int:
    """The version a routing key goes to: versions own consecutive slices of [0, 1) in ascending order.

    With live < candidate the candidate owns the top slice, so a key that reached the candidate at 10%
    stays on it at 50% and 100% (the slice only grows), and returns to the live version on rollback.
    """
    point = key_bucket(key)
    versions = sorted(v for v, w in weights.items() if w > 0)
    total = sum(weights[v] for v in versions)
    edge = 0.0
    for version in versions:
        edge += weights[version] / total
        if point < edge:
            return version
    return versions[-1]


@dataclass
class VersionCounters:
    requests: int = 0
    errors: int = 0
    latency_sum_s: float = 0.0
    latency_max_s: float = 0.0
    output_tokens: int = 0
    latency_hist: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))

    def summary(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors, "latency_sum_s": self.latency_sum_s,
                "latency_max_s": self.latency_max_s}

    def full(self) -> dict[str, Any]:
        return {**self.summary(), "output_tokens": self.output_tokens, "latency_hist": list(self.latency_hist)}


def merge_counters(parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Sum per-version ``full()`` dicts (``latency_max_s`` takes the max)."""
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for version, c in part.items():
            acc = out.setdefault(version, VersionCounters().full())
            acc["requests"] += int(c.get("requests", 0))
            acc["errors"] += int(c.get("errors", 0))
            acc["latency_sum_s"] += float(c.get("latency_sum_s", 0.0))
            acc["latency_max_s"] = max(acc["latency_max_s"], float(c.get("latency_max_s", 0.0)))
            acc["output_tokens"] += int(c.get("output_tokens", 0))
            hist = c.get("latency_hist") or []
            if len(hist) == len(acc["latency_hist"]):
                acc["latency_hist"] = [a + int(b) for a, b in zip(acc["latency_hist"], hist)]
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def diff_counters(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``after - before`` per version (for a measurement window); ``latency_max_s`` is not a delta."""
    out = {}
    for version, a in after.items():
        b = before.get(version) or VersionCounters().full()
        hist_a, hist_b = a.get("latency_hist") or [], b.get("latency_hist") or []
        out[version] = {
            "requests": a["requests"] - b["requests"],
            "errors": a["errors"] - b["errors"],
            "latency_sum_s": a["latency_sum_s"] - b["latency_sum_s"],
            "output_tokens": a.get("output_tokens", 0) - b.get("output_tokens", 0),
            "latency_hist": [x - y for x, y in zip(hist_a, hist_b)] if len(hist_a) == len(hist_b) else hist_a,
        }
    return out


def hist_quantile(hist: list[int], q: float) -> float | None:
    """Quantile ``q`` of a latency histogram (upper bound of the bucket holding it; None when empty)."""
    total = sum(hist)
    if total <= 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= rank and n:
            return LATENCY_BUCKETS_S[i] if i < len(LATENCY_BUCKETS_S) else float("inf")
    return float("inf")


def new_generation() -> str:
    """A sortable id of one loaded router instance: ``<unix ns>-<random>``."""
    return f"{time.time_ns():020d}-{secrets.token_hex(3)}"


@dataclass
class RouterStats:
    """Per-version counters of one router generation, optionally persisted under ``counters_dir``."""

    target_model: str
    weights: dict[int, int]
    loaded_at: float = field(default_factory=time.time)
    versions: dict[int, VersionCounters] = field(default_factory=dict)
    counters_dir: Path | None = None
    generation: str = field(default_factory=new_generation)
    load_id: str = ""  # shared by the instances of one load (config parameter load_id); "" = this instance only
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _dirty: bool = field(default=False, repr=False)

    def record(self, version: int, *, ok: bool, latency_s: float, output_tokens: int = 0) -> None:
        with self._lock:
            c = self.versions.setdefault(version, VersionCounters())
            c.requests += 1
            c.errors += 0 if ok else 1
            c.latency_sum_s += latency_s
            c.latency_max_s = max(c.latency_max_s, latency_s)
            c.output_tokens += output_tokens
            c.latency_hist[bisect.bisect_left(LATENCY_BUCKETS_S, latency_s)] += 1
            self._dirty = True

    def _mine(self) -> dict[str, dict[str, Any]]:
        return {str(v): c.full() for v, c in sorted(self.versions.items())}

    def persist(self, *, final: bool = False) -> None:
        """Write this generation's counters atomically (no-op without ``counters_dir``)."""
        if self.counters_dir is None:
            return
        with self._lock:
            if not self._dirty and not final:
                return
            doc = {"generation": self.generation, "load_id": self.load_id, "target_model": self.target_model,
                   "final": final,
                   "weights": {str(v): w for v, w in sorted(self.weights.items())}, "written_at": time.time(),
                   "versions": self._mine()}
            self._dirty = False
        self.counters_dir.mkdir(parents=True, exist_ok=True)
        path = self.counters_dir / f"{self.generation}.json"
        tmp = self.counters_dir / f".{self.generation}.{secrets.token_hex(3)}.tmp"
        tmp.write_text(json.dumps(doc, sort_keys=True))
        os.replace(tmp, path)

    def _others(self) -> list[tuple[str, dict[str, dict[str, Any]]]]:
        """(load_id, per-version counters) of every other generation that wrote a file."""
        if self.counters_dir is None:
            return []
        return counter_files(self.counters_dir, self.target_model, skip=self.generation)

    def snapshot(self) -> dict:
        others = self._others()
        with self._lock:
            mine = self._mine()
        same_load = [v for lid, v in others if self.load_id and lid == self.load_id]
        return counters_snapshot([mine, *same_load], [mine, *(v for _, v in others)], load_id=self.load_id,
                                 target_model=self.target_model, weights=self.weights) | {
            "loaded_at": self.loaded_at, "generation": self.generation}

    def to_json(self) -> str:
        return json.dumps(self.snapshot(), sort_keys=True)


def counter_files(counters_dir: Path, target_model: str, *, skip: str | None = None,
                  ) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """(load_id, per-version counters) of each generation's file in ``counters_dir`` counting for
    ``target_model`` (but the generation ``skip``)."""
    if not counters_dir.is_dir():
        return []
    parts = []
    for path in sorted(counters_dir.glob("*.json")):
        if path.stem == skip:
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a file being replaced; the next read sees it
        if doc.get("target_model") == target_model:
            parts.append((doc.get("load_id", ""), doc.get("versions", {})))
    return parts


def counters_snapshot(this_load: list[dict[str, dict[str, Any]]], every_load: list[dict[str, dict[str, Any]]], *,
                      load_id: str, target_model: str, weights: dict[int, int]) -> dict[str, Any]:
    """The router's counters: ``versions`` (summary) and ``detail`` summed over ``this_load`` (the
    instances of the load ``load_id``), ``cumulative`` over ``every_load`` that ever wrote a file."""
    load = merge_counters(this_load)
    summary_keys = ("requests", "errors", "latency_sum_s", "latency_max_s")
    return {
        "target_model": target_model,
        "weights": {str(v): w for v, w in sorted(weights.items())},
        "load_id": load_id,
        "latency_buckets_s": list(LATENCY_BUCKETS_S),
        "versions": {v: {k: c[k] for k in summary_keys} for v, c in load.items()},
        "detail": load,
        "cumulative": merge_counters(every_load),
        "generations": len(every_load),
    }
