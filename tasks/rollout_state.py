"""The rollout journal: what a gray release is doing, persisted so a killed promote can be reconciled.

One JSON file per model, ``<model repository>/.rollout-<model>.json``, written atomically (temp file +
``os.replace``) into EVERY repository of the fleet before each change (write-ahead): the record names the
phase, the candidate and live versions and the router weights being applied. Triton never reads it
(explicit model control only loads folders it is asked to). The newest record (highest ``seq``) wins.

Phases::

    staging -> shifting (step i, weights) -> finishing -> done
                      \\-> aborting (reason, figures) -> aborted
    any non-terminal phase found by a new run -> rolled back (``interrupted``) or finished (``finishing``)

``checkpoint(label)`` marks every point where a crash leaves a distinct state. Tests set
``ENGINEWRIGHT_TEST_CRASH_AT=<k>`` to SIGKILL the process at the k-th checkpoint, and
``ENGINEWRIGHT_TEST_CHECKPOINT_LOG=<file>`` to list them; production never sets either.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Phase = Literal["staging", "shifting", "finishing", "done", "aborting", "aborted", "interrupted"]
TERMINAL: frozenset[str] = frozenset({"done", "aborted", "interrupted"})
CRASH_ENV = "ENGINEWRIGHT_TEST_CRASH_AT"
CHECKPOINT_LOG_ENV = "ENGINEWRIGHT_TEST_CHECKPOINT_LOG"
_checkpoints = 0


@dataclass
class Journal:
    model_name: str
    candidate: int
    live: int | None
    phase: Phase
    kind: Literal["promote", "rollback"] = "promote"
    weights: dict[int, int] = field(default_factory=dict)
    step: int = -1
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    endpoints: list[str] = field(default_factory=list)
    seq: int = 0
    updated_at: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    owner: str = ""  # "<host> <pid> <process start time>" of the run that wrote it last ("" in older records)

    def to_json(self) -> str:
        doc = asdict(self)
        doc["weights"] = {str(v): w for v, w in sorted(self.weights.items())}
        return json.dumps(doc, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Journal:
        doc = json.loads(text)
        doc["weights"] = {int(v): int(w) for v, w in doc.get("weights", {}).items()}
        return cls(**doc)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL


def journal_path(model_repository: Path, model_name: str) -> Path:
    return Path(model_repository) / f".rollout-{model_name}.json"


def read_journal(repositories: list[Path], model_name: str) -> Journal | None:
    """The newest record over the fleet's repositories (None before the first rollout)."""
    found = []
    for root in repositories:
        path = journal_path(root, model_name)
        if path.is_file():
            found.append(Journal.from_json(path.read_text()))
    return max(found, key=lambda j: j.seq) if found else None


def write_journal(repositories: list[Path], journal: Journal, **changes: Any) -> Journal:
    """Apply ``changes``, bump ``seq``, write to every repository atomically, then pass a checkpoint."""
    from serving.triton.repository import write_atomic

    for key, value in changes.items():
        setattr(journal, key, value)
    journal.seq += 1
    journal.updated_at = time.time()
    journal.owner = this_process()
    journal.history = [*journal.history[-30:], {"seq": journal.seq, "phase": journal.phase, "step": journal.step,
                                                 "weights": {str(v): w for v, w in journal.weights.items()},
                                                 "at": journal.updated_at}]
    text = journal.to_json()
    for root in repositories:
        write_atomic(journal_path(root, journal.model_name), text)
    checkpoint(f"journal {journal.phase} step {journal.step}")
    return journal


def this_process() -> str:
    """``<host> <pid> <start time>``: names this process so that a reused PID is not taken for it."""
    return f"{socket.gethostname()} {os.getpid()} {_start_time(os.getpid())}"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("?" when it is gone or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "?"
    return "?" if len(fields) < 20 or fields[0] == "Z" else fields[19]


def owner_running(journal: Journal) -> bool | None:
    """Whether the run that last wrote ``journal`` still runs: None when that cannot be told (another host, an
    older record without owner)."""
    host, _, rest = journal.owner.partition(" ")
    if not rest or host != socket.gethostname():
        return None
    pid, _, started = rest.partition(" ")
    return started != "?" and _start_time(int(pid)) == started


def checkpoint(label: str) -> None:
    """A point where a crash leaves a distinct state; tests SIGKILL the process at the k-th one."""
    global _checkpoints
    _checkpoints += 1
    log_path = os.environ.get(CHECKPOINT_LOG_ENV)
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"{_checkpoints} {label}\n")
    crash_at = os.environ.get(CRASH_ENV)
    if crash_at and int(crash_at) == _checkpoints:
        os.kill(os.getpid(), signal.SIGKILL)
