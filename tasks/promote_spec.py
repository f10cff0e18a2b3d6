"""Spec sections of the promotion: approval, Triton targets and the rollout plan (Argo's vocabulary)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator


class ApprovalSpec(BaseModel):
    """How a published version is approved before it reaches Triton."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "mlflow-tag"] = Field(
        "mlflow-tag",
        description="`mlflow-tag`: wait until a person sets the version tag `approval` to `approved` or "
        "`rejected` in the MLflow UI. `auto`: approve at once (demos, tests).",
    )
    timeout_s: float = Field(3600, gt=0, description="How long to wait for a decision before giving up.")
    poll_s: float = Field(5, gt=0, description="Seconds between two reads of the approval tag.")
    by_grace_s: float = Field(
        10, ge=0, description="After `approval` is seen without `approved_by` / `rejected_by`, how long to keep "
        "reading the tags for the decider's name (a person often sets the name second).")
    ui_url: str | None = Field(
        None, description="Base URL of the MLflow UI for the approval link. Default: the tracking URI when it "
        "is an HTTP server; for a sqlite store, http://127.0.0.1:5000, where `mlflow ui --backend-store-uri "
        "<tracking_uri> --host 127.0.0.1 --port 5000` serves it (promote prints that command).")


class TritonEndpoint(BaseModel):
    """A running Triton server and the model repository it serves (explicit model-control mode)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="HTTP URL of the server, e.g. http://127.0.0.1:8000.")
    model_repository: Path = Field(description="Local path of the model repository that server reads.")
    metrics_url: str | None = Field(
        None, description="Prometheus endpoint of that server (e.g. http://127.0.0.1:8002); needed by analysis "
        "metrics with provider `prometheus`.")
    grpc_url: str | None = Field(
        None, description="gRPC address of that server (host:port, e.g. 127.0.0.1:8001). When set, model loads "
        "go through it: an HTTP load holds one of Triton's HTTP threads until the model is loaded, and the HTTP "
        "clients whose connections that thread serves wait with it (seconds while a candidate loads).")

    @field_validator("grpc_url")
    @classmethod
    def _host_port(cls, grpc_url: str | None) -> str | None:
        if grpc_url is not None and (grpc_url.startswith(("http://", "https://", "grpc://")) or ":" not in grpc_url):
            raise ValueError(f"Triton gRPC address {grpc_url!r} (triton.endpoints[].grpc_url) must be host:port, "
                             "without a scheme")
        return grpc_url

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Triton URL {url!r} must start with http:// or https://")
        return url.rstrip("/")


LOAD_TIMEOUT_S = 120.0


# What a release stages unless its spec says otherwise: the decoupled llm (in-flight batching, token streams).
DEFAULT_ENGINE_PARAMETERS: dict[str, str] = {"decoupled": "true"}


class TritonSpec(BaseModel):
    """Where the engine is served; no endpoints means the bundled Triton started on loopback."""

    model_config = ConfigDict(extra="forbid")

    endpoints: list[TritonEndpoint] = Field(
        default_factory=list,
        description="Servers to promote into, as one fleet. Empty: start the tritonserver bundled in the "
        "nvidia-pytriton wheel on 127.0.0.1 over `model_repository`.",
    )
    model_repository: Path = Field(
        Path(".state/triton-repository"), description="Model repository of the embedded server."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the llm model runs: KIND_GPU when CUDA is present (auto) or forced."
    )
    max_queue_size: int = Field(64, ge=1, description="Requests waiting for the engine per model version before "
                                "more are refused as an overload (clients retry; the OpenAI front's 429).")
    max_queue_delay_us: int = Field(2000, ge=0, description="Static path only (`engine_parameters` `in_flight` "
                                    "\"false\"): Triton's dynamic batcher's longest wait to fill a batch.")
    load_timeout_s: float = Field(
        LOAD_TIMEOUT_S, gt=0, description="Longest wait for a model to load.")
    request_timeout_s: float = Field(60, gt=0, description="Client timeout of one inference request.")
    warmup_requests: int = Field(
        3, ge=0, description="Requests sent straight to the candidate version after it loads, before it gets "
        "traffic; one that fails fails the staging.")
    engine_parameters: dict[str, str] = Field(
        default_factory=dict, validate_default=True,
        description="Config parameters of the candidate's Triton model `<model>_v<N>` (each version keeps its own), e.g. `device`, "
        "`decoupled`, `stream_interval_ms`, `admit_gap_ms`, `admit_every_steps`, `idle_senders` (docs/triton.md). "
        "`decoupled` is \"true\" unless given (streams go token by token through `<model>_stream`); \"false\" "
        "serves plain requests, one response each. Both batch in flight unless `in_flight` is \"false\" (the static "
        "path: one `generate` per Triton dynamic batch). "
        "Tests use `engine_loader: tasks.fault_injection:load_engine` to make a bad engine.")

    @field_validator("engine_parameters")
    @classmethod
    def _numeric_parameters(cls, params: dict[str, str]) -> dict[str, str]:
        from serving.triton.models.params import QUEUE_SIZE_PARAMETER, check_parameters

        check_parameters(params)  # ValueError naming the parameter and its value
        if QUEUE_SIZE_PARAMETER in params:
            raise ValueError(f"engine_parameters.{QUEUE_SIZE_PARAMETER}={params[QUEUE_SIZE_PARAMETER]!r}: the engine's queue limit "
                             "is the setting triton.max_queue_size (its parameter is written from it); set that instead")
        return {**DEFAULT_ENGINE_PARAMETERS, **params}


class SetWeight(BaseModel):
    model_config = ConfigDict(extra="forbid")
    set_weight: int = Field(ge=0, le=100, description="Percent of traffic routed to the candidate version.")


class PauseSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    duration_s: float = Field(ge=0, validation_alias=AliasChoices("duration_s", "duration"),
                              description="Seconds to hold the current weight while traffic flows (alias duration).")


class Pause(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pause: PauseSpec


_CONDITION = re.compile(r"^\s*result\s*(<=|>=|==|!=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
ROUTER_QUERIES = ("success_rate", "error_rate", "requests", "errors", "latency_mean_s", "latency_p50_s",
                  "latency_p99_s", "latency_per_token_s")
PROMETHEUS_QUERIES = ("success_rate", "requests", "failures", "request_mean_s", "queue_mean_s")


def parse_condition(text: str) -> tuple[str, float]:
    """``"result <= 0.01"`` -> ``("<=", 0.01)``; the only form a success_condition may take."""
    m = _CONDITION.match(text)
    if not m:
        raise ValueError(f"success_condition {text!r} must look like 'result <op> <number>' with op in "
                         "<, <=, >, >=, ==, !=")
    return m.group(1), float(m.group(2))


class MetricSpec(BaseModel):
    """One analysis metric, measured `count` times every `interval` seconds (Argo Rollouts' AnalysisTemplate)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Name shown in reports and MLflow tags.")
    provider: Literal["router", "prometheus"] = Field(
        "router", description="`router`: the router's own per-version counters (errors counted right). "
        "`prometheus`: Triton's metrics endpoint (`triton.endpoints[].metrics_url`) for the version's model `<model>_v<N>`.")
    query: str = Field(description=f"What to measure over one interval. router: {', '.join(ROUTER_QUERIES)}; "
                       f"prometheus: {', '.join(PROMETHEUS_QUERIES)}.")
    version: Literal["candidate", "live", "all"] = Field("candidate", description="Which version's figures.")
    interval: float = Field(1.0, ge=0, description="Seconds between two measurements.")
    count: int = Field(1, ge=1, description="Number of measurements.")
    success_condition: str = Field(description="`result <op> <number>`, e.g. `result <= 0.01`.")
    failure_limit: int = Field(0, ge=0, description="Failed measurements tolerated; more -> Failed.")
    inconclusive_limit: int = Field(0, ge=0, description="Measurements without data tolerated; more -> Inconclusive.")
    min_requests: int = Field(1, ge=0, description="A measurement over fewer requests has no data (inconclusive).")

    @model_validator(mode="after")
    def _check(self) -> MetricSpec:
        parse_condition(self.success_condition)
        allowed = ROUTER_QUERIES if self.provider == "router" else PROMETHEUS_QUERIES
        if self.query not in allowed:
            raise ValueError(f"metric {self.name!r}: query {self.query!r} is not one of {allowed} "
                             f"(provider {self.provider})")
        return self


def _default_metrics() -> list[MetricSpec]:
    # One measurement over the analysis window. No candidate request in the window (likely at a 10% weight with
    # a small window) is not a reason to hold a person: inconclusive_limit=1; later steps carry more traffic.
    return [MetricSpec(name="candidate-error-rate", provider="router", query="error_rate", interval=0, count=1,
                       success_condition="result <= 0", min_requests=1, inconclusive_limit=1)]


class ComparisonSpec(BaseModel):
    """Baseline (live) vs canary: is the candidate slower than live beyond a budget, with confidence?

    Per metric, the candidate/live latency ratio (Hodges-Lehmann on log latencies) and its one-sided bounds,
    each at confidence 1 - alpha. The limit is relative, 1 + max_slowdown, and sizes the window: the candidate
    samples that detect it at alpha with `power` given the spread observed so far. Only when that is more than
    max_samples (a spread too wide for the budget) does the absolute floor decide: the limit becomes
    1 + min_abs_effect_ms / live median, and the reason says so. Failed: the lower bound is above the limit (as
    soon as that is seen). Successful: the upper bound is at or below it, once the candidate has the samples
    the power calls for. Neither, or fewer than min_samples per side: not judged, and the window stays open
    for more samples up to its ceiling (analysis.timeout_s); a window that ends not judged is Inconclusive
    (rollout.hold decides), never a pass.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    metrics: list[Literal["ttft", "tpot"]] = Field(
        default_factory=lambda: ["ttft", "tpot"],
        description="ttft: latency of max_tokens=1 probe requests; tpot: latency per output token of the others.")
    alpha: float = Field(0.01, gt=0, lt=0.5, description="Error rate of each one-sided bound (0.01: a good "
                         "candidate is failed, or a slow one passed, in at most 1% of windows).")
    max_slowdown: float = Field(
        0.2, ge=0, validation_alias=AliasChoices("max_slowdown", "min_effect"),
        description="Relative budget on the candidate's latency (0.2: at most 20% slower than live); alias "
        "min_effect.")
    power: float = Field(0.9, ge=0.5, lt=1, description="Probability that the window detects a slowdown of the "
                         "limit (and passes an equal candidate): sizes the window in candidate samples.")
    max_samples: int = Field(
        400, ge=3, description="Most candidate samples a window plans for, per metric: when detecting "
        "max_slowdown would need more (the latencies spread too wide), the limit becomes min_abs_effect_ms.")
    min_abs_effect_ms: dict[Literal["ttft", "tpot"], float] = Field(
        default_factory=lambda: {"ttft": 50.0, "tpot": 5.0},
        description="Absolute floor of the limit (ms over the live median), per metric, used only where "
        "max_slowdown cannot be detected within max_samples: a tiny engine at a few ms per request spreads by "
        "its scheduling noise, which no user notices.")
    min_samples: int = Field(8, ge=3, description="Fewest samples per side before a verdict is tried.")
    weight_range: tuple[int, int] = Field(
        (1, 99), description="Compare only while the candidate's weight is within [low, high] (at 0% and 100% "
        "one version carries all traffic and there is nothing to compare).")

    @model_validator(mode="before")
    @classmethod
    def _no_insufficient(cls, data: Any) -> Any:
        if isinstance(data, dict) and "insufficient" in data:
            raise ValueError(f"compare.insufficient={data['insufficient']!r} is no longer a setting: a window with "
                             "too few samples stays open up to analysis.timeout_s and then is Inconclusive "
                             "(rollout.hold decides), never a pass")
        return data

    @field_validator("weight_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= value[0] <= value[1] <= 100:
            raise ValueError(f"compare.weight_range {list(value)} must be [low, high] with 0 <= low <= high <= 100")
        return value


class AnalysisSpec(BaseModel):
    """One analysis window: test traffic through the router until the window can be judged, up to a ceiling."""

    model_config = ConfigDict(extra="forbid")
    requests: int = Field(20, ge=1, description="Fewest requests in the window (all versions).")
    candidate_requests: int = Field(
        10, ge=0, description="Fewest of them answered by the candidate: at a 10% weight the window lasts about "
        "10x longer than at 100%. With `compare`, the window also waits for compare.min_samples per version and "
        "kind, and for a verdict, up to timeout_s.")
    min_success_rate: float = Field(1.0, ge=0, le=1, description="Least fraction of successful requests.")
    max_new_tokens: int = Field(8, ge=1, description="Tokens generated per analysis request.")
    metrics: list[MetricSpec] = Field(default_factory=_default_metrics, description="Argo-style metrics.")
    compare: ComparisonSpec | None = Field(
        default_factory=ComparisonSpec, description="Baseline-vs-canary latency test; null to skip.")
    timeout_s: float = Field(120, gt=0, description="Ceiling of the window: how long it may stay open for its "
                             "requests, samples and verdict. What was not judged by then is Inconclusive.")
    text_pairs: int = Field(
        2, ge=0, description="Fewest fixed texts the candidate must answer both as text (tokenized in Triton by its "
        "engine folder's tokenizer) and as the live version's token ids of that text (tasks.canary_text); 0: not "
        "compared. Greedy answers of one version agree when its tokenizer tokenizes like the live one's.")
    max_text_mismatch: float = Field(
        0.5, ge=0, le=1, description="Largest share of those texts whose two answers may differ (a rare argmax flip "
        "under another batch is not a tokenizer fault; another tokenizer of the same vocabulary differs on most).")


class Analysis(BaseModel):
    model_config = ConfigDict(extra="forbid")
    analysis: AnalysisSpec


RolloutStep = Annotated[SetWeight | Pause | Analysis, Field(union_mode="left_to_right")]


def _default_steps() -> list[RolloutStep]:
    return [
        SetWeight(set_weight=10),
        Analysis(analysis=AnalysisSpec()),
        SetWeight(set_weight=50),
        Analysis(analysis=AnalysisSpec()),
        SetWeight(set_weight=100),
        Analysis(analysis=AnalysisSpec()),
    ]


class HoldSpec(BaseModel):
    """What an Inconclusive analysis does: hold the weight and wait for a person, or decide alone."""

    model_config = ConfigDict(extra="forbid")

    on_inconclusive: Literal["hold", "abort", "continue"] = Field(
        "hold", description="`hold`: keep the weight and wait for the MLflow version tag `rollout.decision` "
        "= `continue` or `abort`; `abort`/`continue` decide without a person.")
    timeout_s: float = Field(600, gt=0, description="Longest hold; then the rollout is aborted (the safe side).")
    poll_s: float = Field(2, gt=0, description="Seconds between two reads of the decision tag.")


class RolloutSpec(BaseModel):
    """The gray release plan: steps in Argo Rollouts' vocabulary, applied to every endpoint."""

    model_config = ConfigDict(extra="forbid")

    steps: list[RolloutStep] = Field(default_factory=_default_steps, description="set_weight / pause / analysis.")
    concurrency: int = Field(2, ge=1, le=64, description="Parallel clients sending the rollout's own traffic. On a "
                             "server without headroom each one is load beside the users' (2 cores, 2 users' clients, "
                             "one client: p99 through the rollout 1.14-1.77x of steady unpaced, 1.03-1.23x at "
                             "`rate_per_s` 10; docs/gray-release.md).")
    rate_per_s: float | None = Field(
        None, gt=0, description="Requests a second the rollout's test traffic sends in all (paced; `concurrency` "
        "bounds how many are in flight). Unset: each client sends its next request as soon as the last is answered, "
        "which on a busy server adds `concurrency` clients' worth of load for the whole rollout.")
    ttft_probe_every: int = Field(
        3, ge=0, description="Every n-th test request asks for one token (a TTFT probe); 0: none.")
    hold: HoldSpec = Field(default_factory=HoldSpec, description="Inconclusive analyses.")

    @model_validator(mode="after")
    def _ends_at_full_weight(self) -> RolloutSpec:
        weights = [s.set_weight for s in self.steps if isinstance(s, SetWeight)]
        if not weights or weights[-1] != 100:
            raise ValueError(f"the last set_weight step must be 100 (got weights {weights})")
        if self.ttft_probe_every == 0 and any(s.analysis.compare is not None and "ttft" in s.analysis.compare.metrics
                                              for s in self.steps if isinstance(s, Analysis)):
            raise ValueError("rollout.ttft_probe_every=0 sends no TTFT probes, so an analysis comparing ttft could "
                             "never be judged: set it > 0 or leave ttft out of compare.metrics")
        return self
