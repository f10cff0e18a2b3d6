"""The ``llm`` model's boolean, numeric and choice config parameters, read the same way when a config is
written (so a bad value fails at staging, naming it) and when the model loads inside Triton.

Imports: stdlib only.
"""

from __future__ import annotations

import os


def default_senders(cpus: int | None = None) -> int:
    """Threads that send at once (`idle_senders` while the engine is idle, `busy_senders` while a step
    computes), when unset: one per four CPUs, 1 to 4. On the 16-core H200 host, 1,024 streams of the paged 8B
    engine: 4 idle senders served 97.2% of the offline figure against 89.8% with 1, and 4 busy senders 90.3%
    against 87.6% with 1 (docs/throughput.md); a 2-core machine gets 1, where sending threads do not overlap."""
    return max(1, min(4, (cpus if cpus is not None else os.cpu_count() or 1) // 4))


# name -> (default in ms, whether 0 is allowed)
MILLISECOND_PARAMETERS: dict[str, tuple[float, bool]] = {
    "gil_switch_interval_ms": (0.5, False),
    "stream_interval_ms": (0.0, True),
    "admit_gap_ms": (3.0, True),
}
# name -> (default, least, most)
COUNT_PARAMETERS: dict[str, tuple[int, int, int]] = {
    "idle_senders": (default_senders(), 1, 64),
    "busy_senders": (default_senders(), 1, 64),
    "admit_every_steps": (8, 1, 64),
}


# Written by `model_configs.llm_config` for a model that batches in flight: the engine's limit of requests
# waiting for admission (Triton's queue limit where its dynamic batcher queues them instead).
QUEUE_SIZE_PARAMETER = "max_queue_size"


def batches_in_flight(params: dict[str, str], *, decoupled: bool) -> bool:
    """Whether the llm runs the in-flight engine thread: always when decoupled, else unless `in_flight` is false."""
    return decoupled or flag(params, "in_flight")


def queue_size(params: dict[str, str]) -> int | None:
    """The `QUEUE_SIZE_PARAMETER` a config carries (None: not set, no limit of the engine's own)."""
    raw = str(params.get(QUEUE_SIZE_PARAMETER) or "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"parameter {QUEUE_SIZE_PARAMETER}={raw!r} must be a whole number >= 1")
    return int(raw)


# name -> default when unset or empty
BOOLEAN_PARAMETERS: dict[str, bool] = {
    "decoupled": False,
    "in_flight": True,
    "exclusive_launch": True,
    "execute_waits_launches": False,
    "warmup": True,
}
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def truthy(value: str | None) -> bool:
    """A boolean value that no table here defaults (the router's own `target_decoupled`): "1", "true",
    "yes" or "on" (any case) is true. The llm model's parameters are read with `flag`."""
    return str(value or "").strip().lower() in TRUE_WORDS


def flag(params: dict[str, str], name: str) -> bool:
    """The value of one of `BOOLEAN_PARAMETERS` (its default when unset or empty)."""
    raw = str(params.get(name) or "").strip().lower()
    if not raw:
        return BOOLEAN_PARAMETERS[name]
    if raw not in TRUE_WORDS + FALSE_WORDS:
        raise ValueError(f"parameter {name}={params.get(name)!r} must be true or false (or 1/0, yes/no, on/off)")
    return raw in TRUE_WORDS


def milliseconds(params: dict[str, str], name: str) -> float:
    """The value of one of `MILLISECOND_PARAMETERS` (its default when unset or empty)."""
    default, zero_ok = MILLISECOND_PARAMETERS[name]
    raw = str(params.get(name) or "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = float("nan")
    if not (value > 0.0 or (zero_ok and value == 0.0)) or value == float("inf"):
        raise ValueError(f"parameter {name}={raw!r} must be a number of milliseconds {'>= 0' if zero_ok else '> 0'}")
    return value


def count(params: dict[str, str], name: str) -> int:
    """The value of one of `COUNT_PARAMETERS` (its default when unset or empty)."""
    default, least, most = COUNT_PARAMETERS[name]
    raw = str(params.get(name) or "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        value = least - 1
    if not least <= value <= most:
        raise ValueError(f"parameter {name}={raw!r} must be a whole number from {least} to {most}")
    return value


# name -> the values it may take (unset or empty: the engine's default, "auto")
CHOICE_PARAMETERS: dict[str, tuple[str, ...]] = {
    "decode_gemm": ("auto", "triton", "torch"),  # the decode step's GEMMs: Triton kernels or cuBLAS
    "prefix_caching": ("auto", "true", "false"),  # the engine's prefix caching: as built, on or off
    "load_priority": ("idle", "normal"),  # the engine's load below the serving threads, or beside them
}


def choice(params: dict[str, str], name: str) -> str | None:
    """The value of one of `CHOICE_PARAMETERS`, or None when unset or empty."""
    raw = str(params.get(name) or "").strip().lower()
    if raw and raw not in CHOICE_PARAMETERS[name]:
        raise ValueError(f"parameter {name}={params.get(name)!r} must be one of {', '.join(CHOICE_PARAMETERS[name])}")
    return raw or None


def speculative(params: dict[str, str]) -> str | None:
    """The `speculative` parameter (the engine option `speculative`: "off", "ngram" or a JSON object such as
    '{"method": "ngram", "max_draft": 4, "max_ngram": 3}', docs/engine.md), or None when unset or empty. A bad
    value raises ValueError naming the parameter."""
    raw = str(params.get("speculative") or "").strip()
    if not raw:
        return None
    # lazy: stdlib-only modules, imported when the parameter is set
    from serving.engine.errors import EngineLimitError
    from serving.engine.speculative import parse_speculative

    try:
        parse_speculative(raw)
    except EngineLimitError as exc:
        raise ValueError(f"parameter speculative={raw!r}: {exc}") from None
    return raw


# the CUDA caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF) that `cuda_alloc_conf` may name
CUDA_ALLOC_KEYS = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
                   "garbage_collection_threshold", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                   "pinned_num_register_threads")


def cuda_alloc_conf(params: dict[str, str]) -> str | None:
    """The `cuda_alloc_conf` parameter (PyTorch's `PYTORCH_CUDA_ALLOC_CONF` for the model's process, e.g.
    "expandable_segments:True"), or None when unset; each comma-separated item must be `key:value` with a key of
    `CUDA_ALLOC_KEYS`."""
    raw = str(params.get("cuda_alloc_conf") or "").strip()
    if not raw:
        return None
    for item in raw.split(","):
        key, sep, value = item.strip().partition(":")
        if not sep or not value or key not in CUDA_ALLOC_KEYS:
            raise ValueError(f"parameter cuda_alloc_conf={raw!r}: {item.strip()!r} is not key:value with a key of "
                             f"{', '.join(CUDA_ALLOC_KEYS)}")
    return raw


def check_parameters(params: dict[str, str]) -> None:
    """Raise ValueError naming the first boolean, numeric or choice parameter whose value is not valid."""
    for name in BOOLEAN_PARAMETERS:
        flag(params, name)
    for name in MILLISECOND_PARAMETERS:
        milliseconds(params, name)
    for name in COUNT_PARAMETERS:
        count(params, name)
    for name in CHOICE_PARAMETERS:
        choice(params, name)
    queue_size(params)
    cuda_alloc_conf(params)
    speculative(params)
