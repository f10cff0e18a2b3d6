"""What torch's compiler did during a load: its cache lookups (with the AOTAutograd keys' parts), its counters
and where its time went, for the load-time breakdown (`load_time.measure_load`).

`CompileTrace` wraps a block: it records every AOTAutograd cache key torch computes with the key's parts (torch's
own debug lines, "[hash] name: value"), the log lines of torch's caches (AOTAutograd hit / miss / bypass and why,
FX graph cache status per compile), dynamo's recompile reasons, and afterwards torch's counters and its
per-phase compile times. `key_differences` compares two processes' records: for each key of the second that the
first did not have, the parts whose hash differs from the first's key at the same place in the order of compiles
(why a lookup missed).

Imports: stdlib at import time; torch inside the functions (a bench module).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Self

CACHE_LOGGERS = ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache",
                 "torch._inductor.compile_fx", "torch.__recompiles")
LINE_LIMIT = 400  # characters kept of one log line or key part
_PART = re.compile(r"^\[(?P<hash>[^\]]*)\] (?P<name>[^:]+): ?(?P<value>.*)$", re.DOTALL)


class _Lines(logging.Handler):
    def __init__(self, out: list[str], started: float) -> None:
        super().__init__(logging.DEBUG)
        self.out, self.started = out, started

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a log line that cannot be formatted is dropped
            return
        if record.name not in CACHE_LOGGERS or (record.name.endswith("compile_fx") and "cache" not in msg.lower()):
            return  # graphs and guard functions (children's lines, compile_fx's other debug lines)
        self.out.append(f"{time.perf_counter() - self.started:7.2f} s {record.name.rsplit('.', 1)[-1]}: "
                        f"{msg[:LINE_LIMIT]}")


class CompileTrace:
    """Records torch's compile caches' keys, log lines, counters and phase times inside a `with` block."""

    def __init__(self) -> None:
        self.keys: list[dict[str, Any]] = []  # per AOTAutograd key computed: key, parts {name: [hash, value]}
        self.lines: list[str] = []
        self.counters: dict[str, dict[str, int]] = {}
        self.time_spent: Any = None
        self.compile_times: str = ""
        self._undo: list[Any] = []

    def __enter__(self) -> Self:
        import torch  # noqa: F401 - torch's loggers exist once it is imported

        started = time.perf_counter()
        try:
            from torch._functorch._aot_autograd import autograd_cache

            original = autograd_cache.autograd_cache_key
        except (ImportError, AttributeError) as exc:  # another torch: no keys, the rest stands
            self.lines.append(f"AOTAutograd keys not recorded: {type(exc).__name__}: {exc}")
        else:
            def recording_key(*args: Any, **kwargs: Any) -> Any:
                key, debug_lines = original(*args, **kwargs)
                self.keys.append({"key": key, "at_s": round(time.perf_counter() - started, 2),
                                  "parts": parts_of(debug_lines)})
                return key, debug_lines

            autograd_cache.autograd_cache_key = recording_key
            self._undo.append(lambda: setattr(autograd_cache, "autograd_cache_key", original))
        handler = _Lines(self.lines, started)
        for name in CACHE_LOGGERS:
            logger = logging.getLogger(name)
            level = logger.level
            logger.setLevel(logging.DEBUG)
            logger.addHandler(handler)
            self._undo.append(lambda lg=logger, lv=level: (lg.removeHandler(handler), lg.setLevel(lv)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        from torch._dynamo import utils

        for undo in reversed(self._undo):
            undo()
        self.counters = {group: {k: int(v) for k, v in values.items()} for group, values in utils.counters.items()
                         if group in ("aot_autograd", "inductor", "stats", "recompiles", "unimplemented")}
        try:
            self.time_spent = {k: round(float(v), 3) for k, v in utils.calculate_time_spent().items()}
        except Exception as exc:  # noqa: BLE001 - another torch: reported, the rest stands
            self.time_spent = f"unavailable: {type(exc).__name__}: {exc}"
        try:
            self.compile_times = str(utils.compile_times(repr="str", aggregate=True))
        except Exception as exc:  # noqa: BLE001
            self.compile_times = f"unavailable: {type(exc).__name__}: {exc}"

    def report(self) -> dict[str, Any]:
        return {"aot_keys": self.keys, "cache_log": self.lines, "counters": self.counters,
                "time_spent": self.time_spent, "compile_times": self.compile_times}


def parts_of(debug_lines: list[str]) -> dict[str, list[str]]:
    """torch's key debug lines ("[hash] name: value") as {name: [hash, value]}."""
    out: dict[str, list[str]] = {}
    for line in debug_lines:
        m = _PART.match(line)
        if m:
            out[m["name"].strip()] = [m["hash"], m["value"]]
    return out


def first_difference(a: str | None, b: str | None, context: int = 160) -> dict[str, Any]:
    """Where two values first differ, with `context` characters of each from just before there."""
    a, b = a or "", b or ""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, at - context // 4)
    return {"at": at, "lengths": [len(a), len(b)], "first": a[start:start + context],
            "second": b[start:start + context]}


def key_differences(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each key of `second` that `first` lacks: the parts whose hash differs from the key computed at the
    same place in `first` (the n-th compile of each process)."""
    known = {k["key"] for k in first}
    out = []
    for i, entry in enumerate(second):
        if entry["key"] in known:
            continue
        peer = first[i]["parts"] if i < len(first) else {}
        names = sorted(set(peer) | set(entry["parts"]))
        differs = {name: first_difference((peer.get(name) or [None, None])[1], (entry["parts"].get(name) or
                                                                                  [None, None])[1])
                   for name in names if (peer.get(name) or [None])[0] != (entry["parts"].get(name) or [None])[0]}
        out.append({"index": i, "key": entry["key"], "differs": differs})
    return out
