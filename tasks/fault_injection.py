"""Test-only engine loader that makes a REAL engine bad on purpose: slow, failing, or unable to load.

Used by setting the engine models' parameter ``engine_loader`` to ``tasks.fault_injection:load_engine``
(spec: ``triton.engine_parameters``). Without a fault file it is exactly the default loader.
The fault is read from ``<model repository>/.faults-<release>.json`` (a file Triton ignores), keyed
by engine version number, so a test can make one version, or one server of a fleet, misbehave::

    {"3": {"delay_per_token_s": 0.02}}     # version 3 answers correctly, but slowly
    {"3": {"error_rate": 1.0}}             # version 3 raises in generate -> error responses
    {"3": {"fail_load": "disk on fire"}}   # version 3 cannot load on this server

Production specs never name this loader. It imports only the stdlib at import time (it runs inside the
Triton python stub).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any


def fault_file(model_repository: Path, release: str) -> Path:
    return Path(model_repository) / f".faults-{release}.json"


def write_fault(model_repository: Path, release: str, version: int, fault: dict[str, Any] | None) -> None:
    """Set (or clear, with None) the fault of one engine version of ``release``; written atomically."""
    from serving.triton.repository import write_atomic

    path = fault_file(model_repository, release)
    faults = json.loads(path.read_text()) if path.is_file() else {}
    if fault is None:
        faults.pop(str(version), None)
    else:
        faults[str(version)] = fault
    write_atomic(path, json.dumps(faults, sort_keys=True))


class FaultyRunner:
    """Wraps an engine runner: sleeps per generated token and/or raises at a given rate, whichever entry the
    llm model uses (``generate`` for a static batch, ``forward`` steps for in-flight batching)."""

    def __init__(self, runner: Any, fault: dict[str, Any]) -> None:
        self.runner = runner
        self.info = runner.info
        self.delay_per_token_s = float(fault.get("delay_per_token_s", 0.0))
        self.error_rate = float(fault.get("error_rate", 0.0))
        self.rng = random.Random(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def _step(self) -> None:
        if self.error_rate and self.rng.random() < self.error_rate:
            raise RuntimeError(f"injected fault: engine step fails (error_rate={self.error_rate})")
        if self.delay_per_token_s:
            time.sleep(self.delay_per_token_s)

    # The in-flight scheduler drives the engine by steps: each one a `forward` (or, run a step ahead, a
    # `forward_ahead`); the scheduler is made here so that it drives this wrapper, not the runner inside it.
    def scheduler(self, **options: Any) -> Any:
        from serving.engine.scheduler import Scheduler

        return Scheduler(self, max_waiting=self.runner.config.max_waiting, **options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._step()
        return self.runner.forward(*args, **kwargs)

    def forward_ahead(self, *args: Any, **kwargs: Any) -> Any:
        self._step()
        return self.runner.forward_ahead(*args, **kwargs)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, **kwargs: Any) -> Any:
        if self.error_rate and self.rng.random() < self.error_rate:
            raise RuntimeError(f"injected fault: generate fails (error_rate={self.error_rate})")
        out = self.runner.generate(prompts, max_new_tokens=max_new_tokens, **kwargs)
        if self.delay_per_token_s:
            time.sleep(self.delay_per_token_s * max_new_tokens)
        return out


def load_engine(engine_dir: Path, *, device: str = "auto", **options: Any) -> Any:
    """The llm model's default loader (``serving.engine.runner.load_engine``, with ``options``, e.g.
    ``decode_gemm``) plus the fault configured for this version, if any."""
    from serving.engine.runner import load_engine as real_load

    engine_dir = Path(engine_dir)
    model_dir = engine_dir.parent.parent  # <repo>/<release>_v<N>/1/engine
    release, _, version = model_dir.name.rpartition("_v")
    path = fault_file(model_dir.parent, release)
    faults = json.loads(path.read_text()) if path.is_file() else {}
    fault = faults.get(version) or {}
    if fault.get("fail_load"):
        raise RuntimeError(f"injected fault: version {version} cannot load ({fault['fail_load']})")
    runner = real_load(engine_dir, device=device, **options)
    return FaultyRunner(runner, fault) if fault else runner
