"""Before staging: does the candidate fit beside the live engine on every device of every endpoint?

The candidate's need is `serving.engine.memory.estimate_engine_memory` (weights + the KV cache's block pool)
plus a fixed overhead per instance (python stub; on GPU the CUDA context). What a device has free comes
from the endpoint's own Triton metrics (``nv_gpu_memory_*`` per GPU, ``nv_cpu_memory_*`` for host memory),
so a remote fleet is measured where it runs and the live engine is already counted as used. An endpoint
without those metrics is skipped with a logged reason. A refusal names every figure, before anything
changes.

A tensor-parallel engine (``engine.tensor_parallel`` N) needs N GPUs, each with room for one rank's share
(``MemoryEstimate.per_rank_bytes``) plus the per-instance overhead (each rank is a process with its own CUDA
context): refused when fewer than N of an endpoint's GPUs have that room, naming the count. Triton's metrics
name GPUs by UUID, not index, so the check counts GPUs with room; the version's instance takes GPUs 0..N-1
(``serving.triton.model_configs.llm_config``). On the CPU the ranks share the host's memory: the whole engine
plus N overheads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tasks.engine_kinds import kind_of
from tasks.errors import StepError
from tasks.targets import Target

log = logging.getLogger(__name__)

GIB = 1024**3
INSTANCE_OVERHEAD_BYTES = {"gpu": 1 * GIB, "cpu": 64 * 1024**2}  # CUDA context + stub / the python stub
HEADROOM_FRACTION = 0.05  # of a device's total, kept free for allocator slack and activations
METRICS = {"gpu": ("nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "gpu_uuid"),
           "cpu": ("nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes", None)}


class CandidateDoesNotFit(StepError):
    """The candidate's estimated memory exceeds what a device of an endpoint has free."""


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # "cpu" or "gpu <uuid>"
    total_bytes: int
    used_bytes: int

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.used_bytes

    def room_bytes(self) -> int:
        """Free memory less the headroom kept on it."""
        return self.free_bytes - int(HEADROOM_FRACTION * self.total_bytes)


def device_memory(samples: list, kind: str) -> list[DeviceMemory]:
    """Per device of ``kind`` ("gpu" or "cpu"), total and used bytes from Triton metric samples."""
    total_name, used_name, label = METRICS[kind]
    totals = {s.labels.get(label, "") if label else "": s.value for s in samples if s.name == total_name}
    used = {s.labels.get(label, "") if label else "": s.value for s in samples if s.name == used_name}
    return [DeviceMemory(f"{kind} {key}".strip(), int(totals[key]), int(used[key]))
            for key in sorted(totals) if key in used and totals[key] > 0]


def _mib(n: float) -> str:
    return f"{n / 1024**2:,.0f} MiB"


def fit_problems(need_bytes: int, devices: list[DeviceMemory], *, where: str) -> list[str]:
    """One line per device whose room is smaller than ``need_bytes``."""
    return [f"{where} {d.device}: needs {_mib(need_bytes)}, has {_mib(d.free_bytes)} free of {_mib(d.total_bytes)} "
            f"({_mib(d.room_bytes())} after keeping {HEADROOM_FRACTION:.0%} headroom)"
            for d in devices if d.room_bytes() < need_bytes]


def rank_fit_problems(need_bytes: int, ranks: int, devices: list[DeviceMemory], *, where: str) -> list[str]:
    """One line when fewer than ``ranks`` of ``devices`` have room for ``need_bytes`` each (a rank's share)."""
    roomy = [d for d in devices if d.room_bytes() >= need_bytes]
    if len(roomy) >= ranks:
        return []
    return [f"{where}: a tensor_parallel={ranks} engine needs {ranks} GPUs with {_mib(need_bytes)} each; "
            f"{len(roomy)} of its {len(devices)} GPUs have that room ("
            + ", ".join(f"{d.device} {_mib(d.room_bytes())} after headroom" for d in devices) + ")"]


def check_fits(targets: list[Target], engine_dir: Path, *, device: str, engine_kind: str = "torch") -> list[str]:
    """Raise `CandidateDoesNotFit` naming every figure when the candidate cannot sit beside the live engine
    on some device; return what was checked (or why not), one line per endpoint, as logged."""
    from serving.triton.metrics import scrape

    estimate_memory = kind_of(engine_kind).memory_estimate
    if estimate_memory is None:
        line = f"fit check skipped: no memory estimate for engine kind {engine_kind!r} (torch engines only)"
        log.warning(line)
        return [line]
    estimate = estimate_memory(engine_dir)
    checked, problems = [], []
    for target in targets:
        if not target.metrics_url:
            line = f"fit check skipped on {target.url}: no metrics_url ({target.setting} has none) to read its memory"
            log.warning(line)
            checked.append(line)
            continue
        samples = scrape(target.metrics_url, setting=f"{target.setting} (metrics_url)")
        kinds = ["gpu"] if device == "cuda" else ["cpu"] if device == "cpu" else ["gpu", "cpu"]
        found = next(((k, d) for k in kinds if (d := device_memory(samples, k))), None)
        if found is None:
            line = (f"fit check skipped on {target.url}: its metrics carry no {' or '.join(METRICS[k][0] for k in kinds)} "
                    f"(Triton started without memory metrics?)")
            log.warning(line)
            checked.append(line)
            continue
        kind, devices = found
        ranks = estimate.ranks
        if kind == "gpu" and ranks > 1:
            need = estimate.per_rank_bytes + INSTANCE_OVERHEAD_BYTES[kind]
            problems += rank_fit_problems(need, ranks, devices, where=target.url)
        else:
            need = estimate.total_bytes + ranks * INSTANCE_OVERHEAD_BYTES[kind]
            problems += fit_problems(need, devices, where=target.url)
        per = f" per GPU on each of {ranks} GPUs (1/{ranks} of" if kind == "gpu" and ranks > 1 else " ("
        line = (f"fit check on {target.url}: candidate needs {_mib(need)}{per} weights {_mib(estimate.weights_bytes)} + "
                f"KV cache {_mib(estimate.kv_cache_bytes)} ({estimate.kv_cache}) + overhead {_mib(INSTANCE_OVERHEAD_BYTES[kind])}"
                f"{f' x {ranks} ranks' if ranks > 1 and kind != 'gpu' else ''}); "
                + ", ".join(f"{d.device} {_mib(d.free_bytes)} free" for d in devices))
        log.info(line)
        checked.append(line)
    if problems:
        raise CandidateDoesNotFit("the candidate does not fit beside the live engine: " + "; ".join(problems)
                                  + ". Free memory on those devices, or build the engine with smaller limits "
                                    + "(engine.kv_cache.num_blocks, max_batch_size, max_seq_len).")
    return checked
