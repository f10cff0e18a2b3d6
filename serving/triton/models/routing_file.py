"""The routing file: what a release's routers route by, changed without reloading them.

``<root>/<name>/enginewright.json`` beside the router's config holds the weights, the ``load_id`` their
counters share and whether the engine versions are decoupled. The controller replaces it atomically
(temp file + ``os.replace``, so every write is a new inode); each router instance looks at it (one
``os.stat``) before it picks versions for a batch and re-reads it when it changed. A weight change thus
starts no stub and reloads no model: a reload under traffic starts new router stubs on a busy CPU, and a
starved stub misses the python backend's one-second health check ("Stub process ... is not healthy").

Imports: stdlib and the pure routing helpers, so it runs inside Triton's python backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.triton.models.params import truthy
from serving.triton.models.routing import COUNTERS_DIR, RouterStats, WeightsError, parse_weights

ROUTING_FILE = "enginewright.json"
ROUTING_PARAMETER = "routing_file"  # in a router's config: it follows ROUTING_FILE (older routers had weights there)


class RoutingFileError(ValueError):
    """The routing file is missing or malformed; the message names the file."""


@dataclass(frozen=True)
class Routing:
    """One write of the routing file."""

    weights: dict[int, int]
    load_id: str
    target_model: str
    target_decoupled: bool = False

    def to_json(self) -> str:
        return json.dumps({"weights": {str(v): int(w) for v, w in sorted(self.weights.items())},
                           "load_id": self.load_id,
                           "target_model": self.target_model,
                           "target_decoupled": "true" if self.target_decoupled else "false"}, sort_keys=True)


def parse_routing(text: str, *, source: str) -> Routing:
    """A routing file's content; RoutingFileError naming ``source`` and the bad field."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise RoutingFileError(f"routing file {source} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise RoutingFileError(f"routing file {source} holds {type(doc).__name__}, not a JSON object")
    try:
        weights = parse_weights(json.dumps(doc.get("weights")))
    except WeightsError as exc:
        raise RoutingFileError(f"routing file {source}: {exc}") from exc
    return Routing(weights=weights, load_id=str(doc.get("load_id") or ""),
                   target_model=str(doc.get("target_model") or ""),
                   target_decoupled=truthy(str(doc.get("target_decoupled") or "")))


def read_routing(path: Path) -> Routing:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise RoutingFileError(f"routing file {path} cannot be read: {exc}") from exc
    return parse_routing(text, source=str(path))


class RoutingWatch:
    """Re-reads the routing file at ``path`` when its inode, size or mtime changed since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None

    def poll(self) -> Routing | None:
        """The file's routing if it changed since the last poll (always on the first), else None.
        RoutingFileError when it cannot be read or parsed; the next poll tries again."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise RoutingFileError(f"routing file {self.path} cannot be read: {exc}") from exc
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return None
        routing = read_routing(self.path)
        self._stamp = stamp
        return routing


class FollowedRouting:
    """A router instance's current routing and the counters of its generation: a new ``load_id`` in the
    file closes this generation's counters (written, final) and opens a new one, as a reload did."""

    def __init__(self, path: Path, target_model: str, counters_dir: Path | None) -> None:
        self.watch = RoutingWatch(path)
        self.target_model = target_model
        self.counters_dir = counters_dir
        routing = self.watch.poll()
        assert routing is not None  # the first poll always reads
        self.routing = routing
        self.stats = self._new_stats(routing)

    def _new_stats(self, routing: Routing) -> RouterStats:
        return RouterStats(self.target_model, routing.weights, counters_dir=self.counters_dir,
                           load_id=routing.load_id)

    @property
    def weights(self) -> dict[int, int]:
        return self.routing.weights

    def refresh(self) -> Routing | None:
        """Follow the file; the new routing when it changed, else None. RoutingFileError (the routing in
        force stays) when the file is bad."""
        routing = self.watch.poll()
        if routing is None or routing == self.routing:
            return None
        old, self.stats = self.stats, self._new_stats(routing)  # every write has a fresh load_id
        old.persist(final=True)
        self.routing = routing
        return routing


def open_routing(model_name: str, router_dir: Path, target_model: str) -> FollowedRouting:
    """The routing of the router whose folder is ``router_dir`` (its routing file, its counters); RuntimeError
    naming ``model_name`` when the file is missing or bad, so the model's load fails saying why."""
    try:
        return FollowedRouting(Path(router_dir) / ROUTING_FILE, target_model, Path(router_dir) / COUNTERS_DIR)
    except RoutingFileError as exc:
        raise RuntimeError(f"[{model_name}] {exc}") from exc


def routing_parameters(params: dict[str, Any]) -> bool:
    """Whether a router config's parameters (``{name: {"string_value": ...}}``) follow a routing file."""
    return ROUTING_PARAMETER in (params or {})
