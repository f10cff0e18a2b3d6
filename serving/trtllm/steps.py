"""Run one TensorRT-LLM command as a subprocess: log captured to a file, progress lines, a timeout.

The child runs in its own process group, so a timeout kills it and everything it started (MPI
workers, build workers) by that group id. A failure raises ``TrtllmStepError`` with the log's tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from serving.trtllm.errors import TrtllmStepError, TrtllmUnavailableError

TAIL_LINES = 40
PROGRESS_EVERY_S = 10.0


def run_step(argv: list[str], *, what: str, log_path: Path, timeout_s: float, setting: str,
             progress: Callable[[str], None] | None = None, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> None:
    """Run ``argv``; write its stdout+stderr to ``log_path``; raise ``TrtllmStepError`` on failure.

    ``what`` names the step in messages ("trtllm-build"); ``setting`` the spec field of its timeout.
    ``progress`` gets the newest output line at most every 10 s, and the start and end.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    say = progress or (lambda _msg: None)
    started = time.monotonic()
    say(f"{what}: starting ({' '.join(argv)}), log {log_path}")
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", env=env, cwd=cwd, start_new_session=True)
        except FileNotFoundError as exc:
            raise TrtllmUnavailableError(f"{what}: cannot start {argv[0]!r} ({exc}); is TensorRT-LLM installed "
                                         "here? (engine.kind needs it)") from exc
        last_report = [started]

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip("\n"))
                now = time.monotonic()
                if now - last_report[0] >= PROGRESS_EVERY_S:
                    last_report[0] = now
                    say(f"{what}: [{now - started:.0f}s] {line.strip()[:200]}")
            log.flush()

        reader = threading.Thread(target=pump, name=f"{what}-log", daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            reader.join(timeout=10)
            raise TrtllmStepError(f"{what} did not finish within {timeout_s:g} s (setting {setting}); killed",
                                  log_path=str(log_path), tail="\n".join(tail)) from None
        reader.join(timeout=30)
    if code != 0:
        raise TrtllmStepError(f"{what} failed with exit code {code}", log_path=str(log_path), tail="\n".join(tail))
    say(f"{what}: done in {time.monotonic() - started:.1f} s")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, SIGKILL it after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
