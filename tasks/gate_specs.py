"""The gates' settings of a release spec (validation, fixed evaluation, performance): pydantic models only.

Apart from the steps that use them (tasks.validate, tasks.evaluation, tasks.perf_gate import torch and Prefect), so
that reading a spec (flows.spec: every CLI command that takes one) loads neither."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "In machine learning, a transformer is",
    "Water boils at",
]


class ValidationSpec(BaseModel):
    """The quality gate: the engine against HF float32, judged by HF's own error at the engine's precision.

    The four limits default to the engine precision's entry in tasks/quality_budgets.py (docs/gates.md
    gives the measurements behind them); each is ``floor + peer_factor * HF peer's figure``.
    """

    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PROMPTS), min_length=1, description="Prompts run through both sides.")
    max_new_tokens: int = Field(16, ge=1, description="Greedy tokens generated per prompt on each side (fewer "
                                "when a side emits EOS).")
    top_logprobs: int = Field(5, ge=1, description="N of the top-N logprob tolerance at the first divergence.")
    max_failed_prompts: int = Field(
        0, ge=0, description="Prompts allowed to diverge to a token outside the other side's top-N, beyond those "
        "on which HF at the engine's precision diverges from HF float32 itself.")
    passages: list[str] | None = Field(
        None, description="Texts scored teacher-forced; default: the passages of tasks/evaluation_data.json.")
    max_mean_kl: float | None = Field(
        None, ge=0, description="Floor of the mean per-token KL(reference || engine), nats; default per precision.")
    max_nll_delta: float | None = Field(
        None, ge=0, description="Floor of |mean NLL engine - reference| per token, nats (either sign fails); "
        "default per precision.")
    max_top1_disagreement: float | None = Field(
        None, ge=0, le=1, description="Floor of the share of positions whose argmax differs from the reference; "
        "default per precision.")
    peer_factor: float | None = Field(
        None, ge=0, description="How many times HF's own figure at the engine's precision the engine may add to "
        "the floors; default per precision.")



class EvaluationSpec(BaseModel):
    """The fixed evaluation against the production version: regression budgets of the paired test."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Run the fixed evaluation on the candidate and the production version's "
                          "engine (skipped, and said so in the report, when there is no production version).")
    max_nll_regression: float = Field(
        0.02, ge=0, description="Largest mean relative increase of the passages' nats per byte over production's "
        "(0.02: 2% less likely text) before a significant increase fails.")
    max_accuracy_drop: float = Field(
        0.10, ge=0, le=1, description="Largest drop of the cloze items' accuracy below production's before a "
        "significant drop fails.")
    alpha: float = Field(0.01, gt=0, lt=1, description="Significance level of each one-sided paired test.")
    max_passages: int | None = Field(
        None, ge=1, description="Score only the first N passages of the fixed data (default: all). Fewer make the "
        "sign test weaker: with N passages the smallest p is 2**-N, so N < 7 can never fail at alpha 0.01.")
    max_choices: int | None = Field(
        None, ge=1, description="Score only the first N cloze items (default: all); the same caution as max_passages.")



class PerfSlo(BaseModel):
    """Absolute service-level objectives; a bound left unset is not checked."""

    model_config = ConfigDict(extra="forbid")

    min_output_tokens_per_s: float | None = Field(None, gt=0, description="Least output tokens per second.")
    max_ttft_p50_ms: float | None = Field(None, gt=0, description="Largest median time to first token, ms.")
    max_ttft_p99_ms: float | None = Field(None, gt=0, description="Largest p99 time to first token, ms.")
    max_tpot_p50_ms: float | None = Field(None, gt=0, description="Largest median time per output token, ms.")
    max_error_rate: float = Field(0.0, ge=0, le=1, description="Largest share of timed iterations that may raise.")


class PerfSpec(BaseModel):
    """The fixed workload of the performance gate, its budget against production and the absolute SLOs."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(4, ge=1, description="Concurrent sequences per generate call.")
    input_len: int = Field(32, ge=1, description="Prompt length in tokens (random token ids, seeded).")
    output_len: int = Field(32, ge=2, description="Generated tokens per sequence.")
    warmup: int = Field(1, ge=0, description="Untimed iterations per engine before measuring.")
    iterations: int = Field(5, ge=2, description="Fewest timed rounds (each: two iterations per engine, ABBA); "
                            "the first look is at this or at the fewest rounds that can decide, whichever is more.")
    max_iterations: int = Field(30, ge=2, description="Most timed rounds while the verdict is not yet decided.")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="1 - the chance, over the whole run, of refusing an "
                              "engine whose median round ratio is within budget (and of stopping early on a "
                              "'within' verdict for one that is not); also the level of the reported interval.")
    max_slowdown: float = Field(0.10, ge=0, lt=1, description="Largest relative throughput loss against the "
                                "production engine in the same run (0.10: at most 10% slower).")
    slo_retries: int = Field(1, ge=0, description="Measurements repeated when an absolute SLO is missed.")
    seed: int = Field(0, description="Seed of the random prompts.")
    slo: PerfSlo = Field(default_factory=PerfSlo, description="Absolute objectives the engine must meet.")


class LmEvalTaskSpec(BaseModel):
    """One lm-evaluation-harness task the release is gated on, scored on the candidate and on production."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The lm-eval task name (a hub task such as `arc_easy` where a "
                      "dataset hub is reachable, or a local task of `include_path`).")
    include_path: str | None = Field(None, description="A folder of lm-eval task YAML files over local data files "
                                     "(relative data_files are read beside the YAML); default: the tasks shipped "
                                     "in tasks/lm_eval_tasks.")
    metric: str = Field("exact_match", min_length=1, description="The per-item metric compared (lm-eval's name: "
                        "exact_match, acc, acc_norm...).")
    limit: int | None = Field(None, ge=1, description="Score only the first N items of the task (default: all).")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples (default: the task's own).")
    max_drop: float = Field(0.05, ge=0, le=1, description="Largest drop of the metric below production's "
                            "(absolute, 0.05 = 5 points) before a significant drop fails.")


class LmEvalGateSpec(BaseModel):
    """Standard evals as a gate: lm-eval tasks run through the serving path (Triton and the OpenAI front) on the
    candidate and on production, paired item by item."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[LmEvalTaskSpec] = Field(default_factory=list, description="The tasks; none: the gate is off.")
    alpha: float = Field(0.05, gt=0, lt=1, description="One-sided significance of a drop (the interval shown is "
                         "the two-sided 1 - 2 alpha one).")
    concurrency: int = Field(4, ge=1, le=64, description="Requests lm-eval sends at once to each engine.")
