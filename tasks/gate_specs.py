"""The gates' settings of a release spec (validation, fixed evaluation, performance): pydantic models only.

Apart from the steps that use them (tasks.validate, tasks.evaluation, tasks.perf_gate import torch and Prefect), so
that reading a spec (flows.spec: every CLI command that takes one) loads neither."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "In machine learning, a transformer is",
    "Water boils at",
]


class EnvelopeSpec(BaseModel):
    """The gates over the engine's whole envelope: long prompts, free-running decode and wide batches."""

    model_config = ConfigDict(extra="forbid")

    long_prompts: int = Field(
        2, ge=0, description="Prompts made of the fixed texts added to the validation prompts, the longest as near "
        "engine.max_input_len as max_seq_len - max_new_tokens allows, the others shorter; 0: none.")
    wide_batch: bool = Field(
        True, description="Also run the prompts cycled to one batch of engine.max_batch_size rows and each alone: "
        "float32 rows must equal their output alone token for token; in reduced precision every row is scored "
        "against HF float32 like a prompt alone and held to the same decode budget.")
    max_decode_gap: float | None = Field(
        None, ge=0, description="Largest log-prob gap, nats, between HF's argmax and the engine's token at a "
        "generated position (HF float32 teacher-forced over the engine's own sequence), alone and in the wide "
        "batch. Default: 0.001 for float32, else 0.25 + peer_factor x HF peer's max logit error.")
    max_decode_disagreements: int | None = Field(
        None, ge=0, description="Most generated tokens that are not HF's argmax on the engine's own prefix. "
        "Default: the top-1 disagreement limit x generated positions + the precision's allowance of prompts.")
    max_wide_batch_rows: int | None = Field(
        None, ge=0, description="Reduced precision: most rows of the wide batch that may differ from their output "
        "alone at all, beside the decode budget each row is held to. Default: no cap. Float32: always 0.")


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
    envelope: EnvelopeSpec = Field(default_factory=EnvelopeSpec, description="Long prompts, free-running decode "
                                   "and wide batches (the engine's limits, not a slice of them).")



SERVED_PARTS = ("chat_template", "stop_ids", "tokenizer", "special_tokens", "generation_defaults")
ServedPart = Literal["chat_template", "stop_ids", "tokenizer", "special_tokens", "generation_defaults"]


class ServedSpec(BaseModel):
    """Drift against production: which differences of the served configuration are intended."""

    model_config = ConfigDict(extra="forbid")

    accept: dict[ServedPart, Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]] = Field(
        default_factory=dict, description="Parts of the served configuration (chat_template, stop_ids, tokenizer, "
        "special_tokens, generation_defaults) allowed to differ from production's, each with a description of why "
        "(shown on the version page). Any other difference refuses the release.")


class EvaluationSpec(BaseModel):
    """The fixed evaluation against the production version: budgets in the units a user reads, and the spreads
    the sample sizes are computed from (tasks/gate_power.py: each part needs enough passages or items that a
    candidate equal to production is shown within its budget with 90% power at `alpha`; the version page
    states n and the regression it detects). Each part is a one-sided paired t bound; with the defaults the
    calculation asks for 8 passages (perplexity, spread 0.03 nats/token), 32 cloze items (spread 0.3), 5 and 6
    passages (KL 0.02, top-1 0.05) and 32 greedy continuations (spread 0.3); the data holds 16 passages (48
    continuations) and 36 items (`tests/test_gates.py` checks the calculation by simulation)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Run the fixed evaluation on the candidate and the production version's "
                          "engine (skipped, and said so in the report, when there is no production version).")
    max_perplexity_increase: float = Field(
        0.05, gt=0, description="Largest increase of the passages' perplexity over production's, as a fraction "
        "(0.05: perplexity at most 5% higher; per token of production's tokenizer).")
    perplexity_spread: float = Field(
        0.03, gt=0, description="Assumed standard deviation over passages of a passage's log perplexity ratio "
        "(nats per token), for the sample size; the page shows the measured one beside it.")
    max_accuracy_drop_points: float = Field(
        20.0, gt=0, le=100, description="Largest drop of the cloze items' accuracy below production's, in "
        "percentage points.")
    accuracy_spread: float = Field(
        0.3, gt=0, description="Assumed standard deviation of an item's paired difference (-1, 0 or 1: lost, "
        "kept, won), for the sample size.")
    max_mean_kl: float = Field(
        0.05, gt=0, description="Largest mean per-token KL(production || candidate) over the passages, nats, "
        "teacher-forced on the same tokens (compared when both tokenize the passages alike).")
    kl_spread: float = Field(0.02, gt=0, description="Assumed standard deviation of a passage's mean KL, nats.")
    max_top1_disagreement: float = Field(
        0.10, gt=0, le=1, description="Largest share of passage positions whose most likely next token differs "
        "from production's (teacher-forced).")
    top1_spread: float = Field(0.05, gt=0, description="Assumed standard deviation of a passage's top-1 "
                               "disagreement share.")
    max_greedy_disagreement: float = Field(
        0.20, gt=0, le=1, description="Largest share of greedy continuation tokens that differ from production's "
        "at the same position (each side decoding freely from the same prompt, as it serves).")
    greedy_spread: float = Field(0.30, gt=0, description="Assumed standard deviation of one continuation's "
                                 "disagreement share (one early divergence changes the rest: shares are near 0 or "
                                 "large, a wide spread).")
    greedy_prompt_tokens: int = Field(8, ge=1, description="Prompt length of the first continuation of each "
                                      "passage, and the step between its continuations' prompts.")
    greedy_windows: int = Field(3, ge=1, description="Continuations per passage, from its first 1, 2, ... times "
                                "greedy_prompt_tokens tokens (each a unit: the passages alone are too few for the "
                                "power this spread needs).")
    greedy_tie_gap: float = Field(0.1, ge=0, description="A greedy divergence where either side's own log-prob of "
                                  "the other's token is within this many nats of its choice (0.1: the two within "
                                  "~10% of each other) is a tie that side could have broken either way, not a "
                                  "disagreement. The least gap: production's measured rounding noise (how far its "
                                  "log-prob gaps move between decode and prefill, one or two logit steps in bf16) "
                                  "is used where larger; 0 with a float32 production counts every divergence.")
    greedy_new_tokens: int = Field(8, ge=1, description="Greedy tokens generated per continuation on each side.")
    alpha: float = Field(0.01, gt=0, lt=1, description="Each part's one-sided error: the chance of passing a "
                         "candidate whose regression is its budget.")
    on_inconclusive: Literal["refuse", "hold"] = Field(
        "refuse", description="A part whose interval holds its budget (neither within nor beyond with "
        "confidence): refuse the release, or publish it held for a person's review (the version page says "
        "so, with the interval; approval.mode must be 'mlflow-tag', a person).")
    max_passages: int | None = Field(
        None, ge=2, description="Score only the first N passages of the fixed data (default: all). Fewer than "
        "the power calculation needs is refused with the number needed.")
    max_choices: int | None = Field(
        None, ge=2, description="Score only the first N cloze items (default: all); the same rule as max_passages.")

    @model_validator(mode="before")
    @classmethod
    def _renamed_budgets(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in RENAMED_EVALUATION_FIELDS.items():
                if old in data:
                    raise ValueError(f"evaluation.{old} ({data[old]!r}) is replaced by evaluation.{new}: {old} "
                                     f"was {RENAMED_WHY[old]}; set {new} instead")
        return data


RENAMED_EVALUATION_FIELDS = {"max_nll_regression": "max_perplexity_increase",
                             "max_accuracy_drop": "max_accuracy_drop_points"}
RENAMED_WHY = {
    "max_nll_regression": "a relative nats/byte increase (its 0.02 was about +6.7% perplexity on the example "
                          "model); max_perplexity_increase is the perplexity increase as a fraction (0.05: 5%)",
    "max_accuracy_drop": "a fraction of 1; max_accuracy_drop_points is in percentage points (0.10 -> 10)",
}


class PerfSlo(BaseModel):
    """Absolute service-level objectives; a bound left unset is not checked."""

    model_config = ConfigDict(extra="forbid")

    min_output_tokens_per_s: float | None = Field(None, gt=0, description="Least output tokens per second.")
    max_ttft_p50_ms: float | None = Field(None, gt=0, description="Largest median time to first token, ms.")
    max_ttft_p99_ms: float | None = Field(None, gt=0, description="Largest p99 time to first token, ms.")
    max_tpot_p50_ms: float | None = Field(None, gt=0, description="Largest median time per output token, ms.")
    max_error_rate: float = Field(0.0, ge=0, le=1, description="Largest share of timed iterations that may raise.")


class PerfSpec(BaseModel):
    """The fixed workload of the performance gate, its budget against production and the absolute SLOs.

    The A/B is a sign test of ABBA rounds against the budget at planned looks (tasks/perf_gate.py); with the
    defaults (budget 0.90, round_spread 0.05, looks at 7, 14, 28 and 30 rounds at alpha 0.0125 each) an engine
    as fast as production is shown within with 90% power after 10 rounds (tasks.gate_power.sign_test_rounds)."""

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
    round_spread: float = Field(0.05, gt=0, description="Assumed standard deviation of one round's log throughput "
                                "ratio (candidate / production), for the rounds the power calculation asks for: "
                                "an engine as fast as production is shown within the budget with 90% power.")
    on_inconclusive: Literal["refuse", "hold"] = Field(
        "refuse", description="Rounds that end neither slower nor within the budget with confidence: refuse the "
        "release (its interval in the message), or publish it held for a person's review (the version page says "
        "so, with the interval; approval.mode must be 'mlflow-tag', a person).")
    slo_retries: int = Field(1, ge=0, description="Measurements repeated when an absolute SLO is missed.")
    seed: int = Field(0, description="Seed of the random prompts.")
    long_row: bool = Field(True, description="The workload's last row at the longest prompt both engines take "
                           "with output_len tokens after it (tasks.envelope.workload_lengths), the others at "
                           "input_len: the timed run covers the long end of the envelope too.")
    check_outputs: int = Field(2, ge=0, description="Timed rows whose generations are checked against HF float32 "
                               "by validation's decode budget (the first N and the longest row; 0: none): what "
                               "was timed must also be right.")
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
