"""Where an in-flight request's time goes inside the ``llm`` model, logged when the model unloads.

- `IntakeStats`: the requests the intake thread (`intake.Intake`) handed to the scheduler, the time that took
  (prompt ids, limits, the response stream, the scheduler's queue), and the turns it took the launch lock.
- `FirstTokenTimes`: for each request, the stages of its time to first token that the model sees: `wait`
  (from ``execute`` receiving it to the scheduler having it: queued in the intake, which waits while a step
  launches),
  `engine` (from the scheduler having it to the engine delivering its first token: queueing, admission,
  prompt steps) and `send` (from that token to its first response handed to Triton), over the last
  `FIRST_TOKENS_KEPT` requests (a server runs for months). A client's TTFT beyond their sum was spent in
  Triton's process, on the wire or in the client.

Imports: stdlib only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

FIRST_TOKENS_KEPT = 100_000  # requests whose stages are kept (about 10 MB)


@dataclass
class IntakeStats:
    """In-flight requests handed to the scheduler by the intake thread, and its turns between launches."""

    requests: int = 0
    seconds: float = 0.0
    longest_s: float = 0.0
    turns: int = 0

    def add(self, seconds: float) -> None:
        self.requests += 1
        self.seconds += seconds
        self.longest_s = max(self.longest_s, seconds)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class FirstTokenStats:
    """Milliseconds at p50 and p99 of each stage (`FirstTokenTimes`), over the last `requests` requests."""

    requests: int
    wait_ms_p50: float
    wait_ms_p99: float
    engine_ms_p50: float
    engine_ms_p99: float
    send_ms_p50: float
    send_ms_p99: float


@dataclass
class FirstTokenTimes:
    """The last requests' stages to their first response, in seconds: (wait, engine, send)."""

    stages: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=FIRST_TOKENS_KEPT))

    def add(self, received: float, submitted: float, emitted: float, sent: float) -> None:
        """Monotonic times of one request; called on the thread that sent its first response (a deque append
        is atomic, so sender threads need no lock)."""
        self.stages.append((submitted - received, emitted - submitted, sent - emitted))

    def stats(self) -> FirstTokenStats:
        columns = list(zip(*self.stages)) or [(), (), ()]
        ms = [[v * 1e3 for v in column] for column in columns]
        return FirstTokenStats(len(self.stages), *(round(nearest_rank(values, q), 2) for values in ms for q in (50, 99)))
