"""Recorded = loaded: what the gates' runner actually loaded, against the engine record and the budget chosen.

The quality gate picks its budget from `engine.json` (`tasks.validate.engine_precision`). If the runner holds
something else (weights in another dtype, another quantization, an fp8 KV cache the record does not show),
the figures are judged by the wrong budget and what gets published is not what was judged. Each mismatch
names the loaded value, the recorded one and the setting it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.quality_budgets import FP8_KV_CACHE, quantized_precision, with_kv_cache

FP8_KV_STORAGE = "float8_e4m3fn"  # what a paged cache of kv_cache_dtype "fp8" stores


@dataclass(frozen=True)
class LoadedCheck:
    """The runner's loaded configuration beside the record's, and every mismatch (empty: they agree)."""

    loaded: dict[str, Any]
    recorded: dict[str, Any]
    budget_precision: str  # the precision the gates' budget was chosen for (from the record)
    loaded_precision: str  # the precision of what was loaded
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def recorded_configuration(info: Any) -> dict[str, Any]:
    """What `engine.json` says the runner should hold, in `LoadedConfiguration`'s terms."""
    dtype = info.limits.dtype
    q = info.quantization
    kv_dtype = FP8_KV_STORAGE if info.kv_cache.kv_cache_dtype == FP8_KV_CACHE else dtype
    return {"weight_dtype": dtype, "quantization": q.method,
            "quantized_lm_head": bool(q.enabled and q.lm_head and not info.model.tie_word_embeddings),
            "kv_cache_dtype": kv_dtype}


def precision_of(loaded: dict[str, Any]) -> str:
    """The budget name (`tasks.quality_budgets`) of a loaded configuration."""
    precision = loaded["weight_dtype"]
    if loaded["quantization"] != "none":
        precision = quantized_precision(precision, loaded["quantization"], lm_head=loaded["quantized_lm_head"])
    return with_kv_cache(precision, FP8_KV_CACHE if loaded["kv_cache_dtype"] == FP8_KV_STORAGE else "auto")


# what must agree, and the setting each comes from
SETTINGS = {"weight_dtype": "engine.dtype", "quantization": "engine.quantization",
            "quantized_lm_head": "engine.quantize_lm_head", "kv_cache_dtype": "engine.kv_cache.kv_cache_dtype"}


def check_loaded(runner: Any, budget_precision: str) -> LoadedCheck:
    """Compare `serving.engine.loaded.loaded_configuration(runner)` with `runner.info` (engine.json) and with
    `budget_precision`, the precision whose budget the gate applies."""
    from serving.engine.loaded import loaded_configuration

    loaded = loaded_configuration(runner).to_dict()
    recorded = recorded_configuration(runner.info)
    failures = [f"recorded = loaded: the runner loaded {key} {loaded[key]!r}, the engine record (engine.json, "
                f"{SETTINGS[key]}) says {recorded[key]!r}" for key in SETTINGS if loaded[key] != recorded[key]]
    precision = precision_of(loaded)
    if precision != budget_precision:
        failures.append(f"recorded = loaded: the gate's budget is precision {budget_precision!r} (from engine.json), "
                        f"what the runner loaded is {precision!r}; judged by the wrong budget, refused")
    return LoadedCheck(loaded, recorded, budget_precision, precision, failures)


def render_loaded(check: LoadedCheck) -> list[str]:
    """Markdown lines: the loaded configuration beside the record."""
    lines = [(f"Loaded = recorded: {'yes' if check.passed else 'NO'} (budget precision {check.budget_precision!r}, "
             f"loaded {check.loaded_precision!r})."), "", "| what | loaded | engine.json |", "| --- | --- | --- |"]
    for key, value in check.loaded.items():
        lines.append(f"| {key} | {value} | {check.recorded.get(key, '(not recorded)')} |")
    return lines
