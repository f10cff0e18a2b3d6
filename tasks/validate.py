"""Gate 1: the engine against Hugging Face transformers on the same prompts.

Greedy generations are compared the way vLLM's `check_logprobs_close` does: identical tokens, or,
where the two first diverge, each side's token must be among the other's top-N logprobs; after the
first divergence that sequence is not compared further. Teacher-forced top-1 agreement, the prefill
logit error and the perplexity ratio on a fixed text complete the picture.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from prefect import task
from pydantic import BaseModel, ConfigDict, Field

from tasks.errors import GateFailed

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "In machine learning, a transformer is",
    "Water boils at",
]

PERPLEXITY_TEXT = (
    "The river ran past the old mill and under the stone bridge, where children stood in the evening "
    "to watch the light fall on the water. Nobody in the village remembered who had built the bridge."
)

# Float32 engines should agree with the reference almost exactly; half precisions leave more room.
DEFAULT_MAX_LOGIT_ERROR = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.1}


class ValidationSpec(BaseModel):
    """Thresholds of the correctness gate (engine vs Hugging Face transformers)."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PROMPTS), min_length=1, description="Prompts run through both sides."
    )
    max_new_tokens: int = Field(16, ge=1, description="Greedy tokens generated per prompt on each side.")
    top_logprobs: int = Field(5, ge=1, description="N of the top-N logprob tolerance at the first divergence.")
    max_failed_prompts: int = Field(
        0, ge=0, description="Prompts allowed to diverge to a token outside the other side's top-N."
    )
    min_top1_agreement: float = Field(
        0.99, ge=0, le=1, description="Least teacher-forced per-position top-1 agreement, over all positions."
    )
    max_logit_error: float | None = Field(
        None, gt=0, description="Largest absolute prefill logit difference; default depends on the dtype."
    )
    max_perplexity_ratio: float = Field(
        1.01, ge=1, description="Largest engine/reference perplexity ratio on a fixed text."
    )


@dataclass
class PromptComparison:
    prompt: str
    status: Literal["identical", "tolerated", "diverged"]
    divergence_position: int | None
    reference_token: int | None
    engine_token: int | None
    reference_text: str
    engine_text: str


@dataclass
class ValidationResult:
    passed: bool
    comparisons: list[PromptComparison]
    top1_agreement: float
    max_logit_error: float
    mean_logit_error: float
    perplexity_reference: float
    perplexity_engine: float
    thresholds: dict[str, float]
    failures: list[str] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        return {
            "validation_identical_prompts": sum(c.status == "identical" for c in self.comparisons),
            "validation_diverged_prompts": sum(c.status == "diverged" for c in self.comparisons),
            "validation_top1_agreement": self.top1_agreement,
            "validation_max_logit_error": self.max_logit_error,
            "validation_mean_logit_error": self.mean_logit_error,
            "validation_perplexity_ratio": self.perplexity_engine / self.perplexity_reference,
        }

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "metrics": self.metrics}, indent=2)


@dataclass
class _Side:
    tokens: list[int]
    top: list[dict[int, float]]


def compare_greedy(
    *, reference: _Side, engine: _Side, name_0: str = "hf", name_1: str = "engine"
) -> tuple[str, int | None]:
    """Return (status, first divergence position) of two greedy generations with top-N tolerance."""
    for pos, (tok_0, tok_1) in enumerate(zip(reference.tokens, engine.tokens)):
        if tok_0 == tok_1:
            continue
        tolerated = tok_0 in engine.top[pos] and tok_1 in reference.top[pos]
        return ("tolerated" if tolerated else "diverged"), pos
    if len(reference.tokens) != len(engine.tokens):
        return "diverged", min(len(reference.tokens), len(engine.tokens))
    return "identical", None


def validate_engine(engine_dir: Path, reference_checkpoint: Path, spec: ValidationSpec) -> ValidationResult:
    """Run the prompts through HF transformers and the engine and judge the engine against `spec`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving.engine import load_engine

    runner = load_engine(engine_dir)
    dtype = runner.info.limits.dtype
    tokenizer = AutoTokenizer.from_pretrained(reference_checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(reference_checkpoint, dtype=getattr(torch, dtype))
    reference = reference.to(runner.device).eval()

    prompt_ids = [tokenizer(p).input_ids for p in spec.prompts]
    with torch.no_grad():
        ref_sides = [_reference_greedy(reference, ids, spec) for ids in prompt_ids]
    generations = runner.generate(prompt_ids, max_new_tokens=spec.max_new_tokens, top_logprobs=spec.top_logprobs)
    eng_sides = [_Side(list(g.token_ids), [dict(t) for t in g.top_logprobs]) for g in generations]

    comparisons = []
    for prompt, ref, eng in zip(spec.prompts, ref_sides, eng_sides):
        status, pos = compare_greedy(reference=ref, engine=eng)
        comparisons.append(
            PromptComparison(
                prompt=prompt,
                status=status,  # type: ignore[arg-type]
                divergence_position=pos,
                reference_token=ref.tokens[pos] if pos is not None and pos < len(ref.tokens) else None,
                engine_token=eng.tokens[pos] if pos is not None and pos < len(eng.tokens) else None,
                reference_text=tokenizer.decode(ref.tokens),
                engine_text=tokenizer.decode(eng.tokens),
            )
        )

    max_len = runner.info.limits.max_input_len
    sequences = [(ids + ref.tokens)[:max_len] for ids, ref in zip(prompt_ids, ref_sides)]
    agreement, max_err, mean_err = _teacher_forced(reference, runner, sequences)
    ppl_text = tokenizer(PERPLEXITY_TEXT).input_ids[:max_len]
    ppl_ref, ppl_eng = _perplexities(reference, runner, ppl_text)

    max_logit_error = spec.max_logit_error or DEFAULT_MAX_LOGIT_ERROR[dtype]
    thresholds = {
        "max_failed_prompts": spec.max_failed_prompts,
        "min_top1_agreement": spec.min_top1_agreement,
        "max_logit_error": max_logit_error,
        "max_perplexity_ratio": spec.max_perplexity_ratio,
    }
    failures = _judge(comparisons, agreement, max_err, ppl_eng / ppl_ref, thresholds)
    return ValidationResult(
        passed=not failures,
        comparisons=comparisons,
        top1_agreement=agreement,
        max_logit_error=max_err,
        mean_logit_error=mean_err,
        perplexity_reference=ppl_ref,
        perplexity_engine=ppl_eng,
        thresholds=thresholds,
        failures=failures,
    )


def _reference_greedy(model, prompt_ids: Sequence[int], spec: ValidationSpec) -> _Side:
    input_ids = torch.tensor([list(prompt_ids)], device=model.device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=spec.max_new_tokens,
        min_new_tokens=spec.max_new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    top = []
    for scores in out.scores:  # scores: [1, V] per generated position
        logprobs = torch.log_softmax(scores[0].float(), dim=-1)
        values, indices = logprobs.topk(spec.top_logprobs)
        top.append(dict(zip(indices.tolist(), values.tolist())))
    return _Side(tokens, top)


def _teacher_forced(model, runner, sequences: list[list[int]]) -> tuple[float, float, float]:
    agree = total = 0
    max_err = 0.0
    err_sum = 0.0
    for seq in sequences:
        with torch.no_grad():
            ref_logits = model(torch.tensor([seq], device=model.device)).logits[0].float().cpu()  # [S, V]
        eng_logits = runner.prefill_logits(seq).float().cpu()  # [S, V]
        diff = (ref_logits - eng_logits).abs()
        agree += int((ref_logits.argmax(-1) == eng_logits.argmax(-1)).sum())
        total += len(seq)
        max_err = max(max_err, float(diff.max()))
        err_sum += float(diff.mean()) * len(seq)
    return agree / total, max_err, err_sum / total


def _perplexities(model, runner, ids: list[int]) -> tuple[float, float]:
    target = torch.tensor(ids[1:])
    with torch.no_grad():
        ref_logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1].float().cpu()
    eng_logits = runner.prefill_logits(ids)[:-1].float().cpu()
    nll = torch.nn.functional.cross_entropy
    return math.exp(float(nll(ref_logits, target))), math.exp(float(nll(eng_logits, target)))


def _judge(
    comparisons: list[PromptComparison],
    agreement: float,
    max_err: float,
    ppl_ratio: float,
    thresholds: dict[str, float],
) -> list[str]:
    failures = []
    diverged = [c for c in comparisons if c.status == "diverged"]
    if len(diverged) > thresholds["max_failed_prompts"]:
        failures.append(
            f"{len(diverged)} of {len(comparisons)} prompts diverged beyond the top-N tolerance "
            f"(validation.max_failed_prompts = {thresholds['max_failed_prompts']})"
        )
    if agreement < thresholds["min_top1_agreement"]:
        failures.append(
            f"teacher-forced top-1 agreement {agreement:.4f} < validation.min_top1_agreement "
            f"{thresholds['min_top1_agreement']}"
        )
    if max_err > thresholds["max_logit_error"]:
        failures.append(
            f"max prefill logit error {max_err:.3g} > validation.max_logit_error {thresholds['max_logit_error']:.3g}"
        )
    if ppl_ratio > thresholds["max_perplexity_ratio"]:
        failures.append(
            f"perplexity ratio engine/reference {ppl_ratio:.4f} > validation.max_perplexity_ratio "
            f"{thresholds['max_perplexity_ratio']}"
        )
    return failures


def render_report(result: ValidationResult) -> str:
    """Markdown a person reads: verdict, figures against thresholds, one row per prompt."""
    lines = [
        f"# Validation gate: {'PASSED' if result.passed else 'FAILED'}",
        "",
        *(f"- {f}" for f in result.failures),
        "",
        "| metric | value | threshold |",
        "| --- | --- | --- |",
        f"| teacher-forced top-1 agreement | {result.top1_agreement:.4f} | >= {result.thresholds['min_top1_agreement']} |",
        f"| max prefill logit error | {result.max_logit_error:.3g} | <= {result.thresholds['max_logit_error']:.3g} |",
        f"| mean prefill logit error | {result.mean_logit_error:.3g} | |",
        (f"| perplexity (reference / engine) | {result.perplexity_reference:.3f} / {result.perplexity_engine:.3f} "
         f"| ratio <= {result.thresholds['max_perplexity_ratio']} |"),
        "",
        "| prompt | status | first divergence | hf text | engine text |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in result.comparisons:
        where = "-" if c.divergence_position is None else (
            f"token {c.divergence_position}: hf {c.reference_token} vs engine {c.engine_token}"
        )
        lines.append(
            f"| {_cell(c.prompt)} | {c.status} | {where} | {_cell(c.reference_text)} | {_cell(c.engine_text)} |"
        )
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return json.dumps(text)[1:-1].replace("|", "\\|")


def require_passed(result: ValidationResult) -> None:
    """Raise GateFailed with the report when the gate said no."""
    if not result.passed:
        raise GateFailed("validation", "; ".join(result.failures), render_report(result))


@task(name="validate", retries=0)
def validate_task(engine_dir: Path, reference_checkpoint: Path, spec: ValidationSpec) -> ValidationResult:
    """Compare the engine with Hugging Face transformers on the spec's prompts."""
    return validate_engine(engine_dir, reference_checkpoint, spec)
