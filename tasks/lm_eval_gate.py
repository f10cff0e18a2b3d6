"""Standard evals as a release gate: lm-evaluation-harness tasks scored on the candidate and on production,
through the serving path, and compared item by item.

Both engines are served the way clients reach them: one Triton (the ``llm`` model of each engine behind its
router, decoupled, in-flight batching) and the OpenAI front (``enginewright serve``), on loopback ports. lm-eval's own ``local-completions`` model sends the task's requests to
``/v1/completions`` (strings, not token ids; the engine folder's tokenizer for lm-eval's own bookkeeping), so
the gate scores what a client of this release would get: the chat-free prompt path, the engine's sampling
(greedy: the tasks ask for temperature 0) and its stop strings.

Tasks are lm-eval YAML tasks. Local ones (no dataset hub needed) live in a folder of YAML files whose
``dataset_kwargs.data_files`` may be relative: they are read beside the YAML (`local_task_folder` copies
the folder with those paths made absolute, as lm-eval reads them relative to the working directory).
tasks/lm_eval_tasks/ ships one written for this project.

The verdict of a task, paired over its items (candidate minus production, per item): the mean difference,
its two-sided 1 - 2 alpha interval (normal approximation; a point when every item agrees), and the one-sided
p-value of a drop (H0: no drop). The task fails when the drop exceeds its budget AND p < alpha, as the fixed
evaluation's parts do (tasks/evaluation.py): neither a negligible significant change nor a large change on
a few items by chance refuses a release. A rebuild of the same checkpoint answers every item as production
does (greedy decoding, the same engine): difference 0, passed.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from tasks.gate_specs import LmEvalGateSpec, LmEvalTaskSpec

SHIPPED_TASKS = Path(__file__).with_name("lm_eval_tasks")
CANDIDATE, PRODUCTION = "lm-eval-candidate", "lm-eval-production"
LOAD_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0
FRONT_START_S = 60.0


@dataclass(frozen=True)
class TaskVerdict:
    """One task's paired comparison (scores are means of the per-item metric, 0..1 for accuracies)."""

    name: str
    metric: str
    items: int
    candidate: float
    production: float
    interval: tuple[float, float]  # of the difference candidate - production
    p_value: float  # one-sided, of a drop
    budget: float
    alpha: float

    @property
    def difference(self) -> float:
        return self.candidate - self.production

    @property
    def passed(self) -> bool:
        return not (-self.difference > self.budget and self.p_value < self.alpha)

    def failure(self) -> str | None:
        if self.passed:
            return None
        return (f"lm-eval {self.name}: {self.metric} {self.candidate:.3f} against production's {self.production:.3f} "
                f"on {self.items} items, a drop of {-self.difference:.3f} > budget {self.budget:g} (p={self.p_value:.2g} "
                f"< {self.alpha:g})")


@dataclass(frozen=True)
class LmEvalResult:
    verdicts: list[TaskVerdict] = field(default_factory=list)
    skipped: str | None = None  # why nothing was compared (no task named, no production version)
    production_version: str | None = None

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)

    @property
    def failures(self) -> list[str]:
        return [f for f in (v.failure() for v in self.verdicts) if f]

    @property
    def metrics(self) -> dict[str, float]:
        out = {}
        for v in self.verdicts:
            out[f"lm_eval_{v.name}_{v.metric}"] = v.candidate
            out[f"lm_eval_{v.name}_{v.metric}_difference"] = v.difference
        return out


def paired_verdict(spec: LmEvalTaskSpec, candidate: dict[int, float], production: dict[int, float], *,
                   alpha: float) -> TaskVerdict:
    """The verdict over the items both sides scored (lm-eval's doc ids)."""
    items = sorted(set(candidate) & set(production))
    if not items:
        raise ValueError(f"lm-eval task {spec.name!r}: no item was scored on both sides")
    diffs = [candidate[i] - production[i] for i in items]
    mean = statistics.fmean(diffs)
    spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    if spread == 0.0:
        interval, p_value = (mean, mean), (0.0 if mean < 0 else 1.0)
    else:
        se = spread / math.sqrt(len(diffs))
        z = statistics.NormalDist().inv_cdf(1 - alpha)
        interval = (mean - z * se, mean + z * se)
        p_value = statistics.NormalDist().cdf(mean / se)  # P(a mean this low | no drop)
    return TaskVerdict(spec.name, spec.metric, len(items), statistics.fmean(candidate[i] for i in items),
                       statistics.fmean(production[i] for i in items), interval, p_value, spec.max_drop, alpha)


def local_task_folder(include_path: Path, into: Path) -> Path:
    """A copy of a folder of lm-eval task YAML files whose relative ``data_files`` point beside the originals."""
    import yaml

    into.mkdir(parents=True, exist_ok=True)
    for source in sorted(include_path.rglob("*.yaml")):
        config = yaml.safe_load(source.read_text())
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, dict):
            config["dataset_kwargs"]["data_files"] = {
                split: str((source.parent / path).resolve()) if not Path(path).is_absolute() else path
                for split, path in files.items()}
        target = into / source.relative_to(include_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(config, sort_keys=False))
    return into


@dataclass(frozen=True)
class Served:
    base_url: str  # the OpenAI front, e.g. http://127.0.0.1:PORT
    tokenizers: dict[str, Path]  # served model name -> its engine folder (tokenizer files)


@contextmanager
def served_engines(engines: dict[str, Path], work: Path, *, parameters: dict[str, str] | None = None,
                   load_timeout_s: float = LOAD_TIMEOUT_S, max_queue_size: int | None = None) -> Iterator[Served]:
    """`engines` (model name -> engine folder) each behind its router in one Triton, and the OpenAI front
    (`enginewright serve`, its own process: lm-eval's asyncio client and the front's gRPC channel each keep
    their own event loop); `parameters`: the llm models' config parameters beside ``decoupled``;
    `max_queue_size`: requests waiting for admission at most (None: the repository's default)."""
    import httpx

    from serving.triton.operations import apply_router_weights, serve_versions
    from serving.triton.process import free_port, start_triton
    from serving.triton.repository import init_repository, stage_engine_version

    if work.exists():
        shutil.rmtree(work)
    repo = init_repository(work / "repository")
    server = start_triton(repo, log_path=work / "triton.log")
    front: subprocess.Popen | None = None
    try:
        for name, engine_dir in engines.items():  # on the GPU where there is one (device_kind auto)
            version = stage_engine_version(repo, name, engine_dir, parameters={"decoupled": "true", **(parameters or {})},
                                           max_queue_size=max_queue_size, link=True)
            serve_versions(server.control(), repo, name, [version], timeout_s=load_timeout_s)
            apply_router_weights(server.control(), repo, name, {version: 100})
        port = free_port()
        log = work / "front.log"
        command = [sys.executable, "-m", "flows.cli", "serve", "--triton-grpc", server.grpc_url, "--port", str(port),
                   "--timeout-s", str(REQUEST_TIMEOUT_S), *(a for name in engines for a in ("--model", name))]
        with open(log, "wb") as out:
            front = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + FRONT_START_S
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if front.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI front for the lm-eval gate did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield Served(url, dict(engines))
    finally:
        if front is not None:
            os.killpg(front.pid, signal.SIGTERM)
            front.wait(timeout=30)
        server.stop()


def task_manager(include_path: Path | None, name: str):
    """lm-eval's task index holding `name`: the include folder's alone where the task is there (indexing
    lm-eval's own thousands of task files cost 5.6 s of CPU a call), else those too."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if name in local.all_tasks:
            return local
    return TaskManager(include_path=str(include_path)) if include_path else TaskManager()


def score_items(served: Served, model: str, spec: LmEvalTaskSpec, include_path: Path | None, *,
                concurrency: int) -> dict[int, float]:
    """lm-eval's per-item `spec.metric` of one served model (doc id -> value)."""
    import lm_eval

    model_args = {"base_url": f"{served.base_url}/v1/completions", "model": model,
                  "tokenizer_backend": "huggingface", "tokenizer": str(served.tokenizers[model]),
                  "tokenized_requests": False, "num_concurrent": concurrency, "max_retries": 1,
                  "timeout": REQUEST_TIMEOUT_S}
    manager = task_manager(include_path, spec.name)
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[spec.name],
                                  num_fewshot=spec.num_fewshot, limit=spec.limit, log_samples=True,
                                  task_manager=manager, apply_chat_template=False)
    samples = (out or {}).get("samples", {}).get(spec.name)
    if not samples:
        raise ValueError(f"lm-eval task {spec.name!r} returned no samples for {model}")
    if spec.metric not in samples[0]:
        metrics = sorted(k for k, v in samples[0].items() if isinstance(v, (int, float)) and k != "doc_id")
        raise ValueError(f"lm-eval task {spec.name!r} has no per-item metric {spec.metric!r} (lm_eval.tasks[].metric"
                         f"); it has {metrics}")
    return {int(s["doc_id"]): float(s[spec.metric]) for s in samples}


def lm_eval_gate(candidate_dir: Path, spec: LmEvalGateSpec, *, production_dir: Path | None,
                 production_version: str | None = None, skipped: str | None = None, work: Path) -> LmEvalResult:
    """Every task of `spec` on both engines, served side by side; skipped without tasks or production."""
    if not spec.tasks:
        return LmEvalResult(skipped="no lm-eval task in the spec (lm_eval.tasks)")
    if production_dir is None:
        return LmEvalResult(skipped=skipped or "no production version to compare with")
    verdicts = []
    with served_engines({CANDIDATE: candidate_dir, PRODUCTION: production_dir}, work / "serving") as served:
        for i, task_spec in enumerate(spec.tasks):
            folder = Path(task_spec.include_path) if task_spec.include_path else SHIPPED_TASKS
            include = local_task_folder(folder, work / f"tasks-{i}")
            scores = {model: score_items(served, model, task_spec, include, concurrency=spec.concurrency)
                      for model in (CANDIDATE, PRODUCTION)}
            verdicts.append(paired_verdict(task_spec, scores[CANDIDATE], scores[PRODUCTION], alpha=spec.alpha))
    return LmEvalResult(verdicts, production_version=production_version)


def render_report(result: LmEvalResult) -> str:
    """The gate's report (markdown)."""
    if result.skipped:
        return f"# Standard evals (lm-evaluation-harness): SKIPPED\n\n{result.skipped}.\n"
    lines = [f"# Standard evals (lm-evaluation-harness) against production: {'PASSED' if result.passed else 'FAILED'}",
             "", (f"Production version {result.production_version or '?'}, the same items, served side by side "
             "through Triton and the OpenAI front in this run."), "",
             "| task | metric | items | candidate | production | difference [interval] | p (drop) | fails when |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for v in result.verdicts:
        lines.append(f"| {v.name} | {v.metric} | {v.items} | {v.candidate:.3f} | {v.production:.3f} | "
                     f"{v.difference:+.3f} [{v.interval[0]:+.3f}, {v.interval[1]:+.3f}] | {v.p_value:.2g} | "
                     f"drop > {v.budget:g} and p < {v.alpha:g} |")
    lines += ["", *(f"- {f}" for f in result.failures)]
    return "\n".join(lines) + "\n"


@task(name="lm-eval-gate", cache_policy=NONE, retries=0)
def lm_eval_gate_task(candidate_dir: Path, spec: LmEvalGateSpec, *, production_dir: Path | None,
                      production_version: str | None, skipped: str | None, work: Path) -> LmEvalResult:
    """lm-eval tasks on the candidate and production, through the serving path."""
    return lm_eval_gate(candidate_dir, spec, production_dir=production_dir, production_version=production_version,
                        skipped=skipped, work=work)
