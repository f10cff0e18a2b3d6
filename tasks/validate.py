"""Gate 1: does the engine harm the model's output? Judged against Hugging Face at the engine's precision.

The reference is HF in float32. Beside it, HF runs in the engine's own dtype (the *peer*), and the engine
may be as far from the reference as the peer is, times a margin, plus a floor (``tasks.quality_budgets``):
a bfloat16 engine is judged like HF bfloat16, a float32 one must agree almost exactly, and a precision HF
cannot run (a quantized engine) against its own budget. A checkpoint already in FP8 is HF's plain model of its
weights dequantized by its own scales, its peer those weights too (``tasks.hf_reference``). Figures, all two-sided:
- teacher-forced over the fixed passages (``tasks/evaluation_data.json``) and each prompt with the
  reference's continuation: mean per-token KL(reference || engine), the NLL difference, top-1 agreement;
- greedy generations compared the way vLLM's ``check_logprobs_close`` does: identical, or where they first
  diverge each side's token is in the other's top-N logprobs, then that sequence is not compared further.
  EOS ends a generation on either side (HF is not forced past it), so a step where one side stops is
  judged with the same top-N tolerance as any other token;
- the text path: tokenizer files hashed, texts tokenized the way Triton does (``tasks.text_path``);
- the whole envelope (``tasks.envelope``, ``tasks.decode_check``): besides the spec's prompts, long ones of the
  fixed texts up to the engine's ``max_input_len``; every generated token scored against HF float32
  teacher-forced over the engine's own sequence (how many are not HF's argmax, how far, the mean log-prob
  difference: a divergence is never simply tolerated); the prompts in one batch of ``max_batch_size`` rows
  against each alone; stop ids picked as the served engine picks them (``eos_token_ids``);
- recorded = loaded (``tasks.loaded_check``): what the runner holds against engine.json and the budget chosen.

The HF side is computed once per (checkpoint, spec, precision) by ``reference_run`` and can be reused to
judge several engines: the release keeps it in its work dir (``tasks.gate_reference``), the tests in memory.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch
from prefect import task
from prefect.cache_policies import NONE

from tasks.decode_check import (
    BatchCheck,
    DecodeFigures,
    DecodeLimits,
    Float32Reference,
    ReferenceLogits,
    check_wide_batch,
    judge_decode,
    score_generations,
)
from tasks.envelope import long_prompts
from tasks.errors import GateFailed
from tasks.gate_specs import ValidationSpec
from tasks.hf_reference import fp8_checkpoint_of, load_hf_model, round_fp8_checkpoint_tokens
from tasks.loaded_check import LoadedCheck, check_loaded, render_loaded
from tasks.quality_budgets import PrecisionBudget, budget_for, quantized_precision, with_kv_cache
from tasks.text_path import TokenizerCheck, check_text_path
from tasks.token_stats import DistanceFigures, combine, sequence_stats


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
    precision: str
    comparisons: list[PromptComparison]
    engine: DistanceFigures | None  # None: the engine failed before it could be measured
    peer: DistanceFigures | None  # HF at the engine's precision; None for float32 and precisions HF cannot run
    peer_diverged_prompts: int
    text_path: TokenizerCheck
    thresholds: dict[str, float]
    failures: list[str] = field(default_factory=list)
    decode: DecodeFigures | None = None  # free-running decode against HF on the engine's own sequences
    decode_limits: DecodeLimits | None = None
    wide_batch: BatchCheck | None = None
    loaded: LoadedCheck | None = None

    @property
    def top1_agreement(self) -> float:
        return self.engine.top1_agreement if self.engine else 0.0

    @property
    def max_logit_error(self) -> float:
        return self.engine.max_logit_error if self.engine else float("inf")

    @property
    def metrics(self) -> dict[str, float]:
        out = {
            "validation_identical_prompts": sum(c.status == "identical" for c in self.comparisons),
            "validation_diverged_prompts": sum(c.status == "diverged" for c in self.comparisons),
        }
        if self.engine:
            out |= {"validation_mean_kl": self.engine.mean_kl, "validation_nll_delta": self.engine.nll_delta,
                    "validation_top1_agreement": self.engine.top1_agreement,
                    "validation_max_logit_error": self.engine.max_logit_error}
        if self.peer:
            out |= {"validation_peer_mean_kl": self.peer.mean_kl,
                    "validation_peer_top1_agreement": self.peer.top1_agreement}
        if self.decode:
            out |= {"validation_decode_positions": self.decode.positions,
                    "validation_decode_disagreements": len(self.decode.disagreements),
                    "validation_decode_max_gap": self.decode.max_gap,
                    "validation_decode_logprob_delta": self.decode.mean_logprob_delta}
        if self.wide_batch:
            out |= {"validation_wide_batch_rows": self.wide_batch.rows,
                    "validation_wide_batch_differing_rows": len(self.wide_batch.differences)}
        return out

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "metrics": self.metrics}, indent=2, default=str)


@dataclass
class _Side:
    tokens: list[int]
    top: list[dict[int, float]]


@dataclass
class ReferenceRun:
    """The HF side for one checkpoint, spec and engine precision; judging an engine reuses it."""

    precision: str
    prompt_ids: list[list[int]]
    greedy: list[_Side]
    sequences: list[list[int]]  # teacher-forced ids: the passages, then each prompt + its greedy continuation
    logits: list[torch.Tensor]  # float32 reference logits of each sequence, [S, V] on the CPU
    peer: DistanceFigures | None
    peer_diverged: int
    eos_ids: list[int]
    texts: list[str]  # what the text path check tokenizes
    tokenizer: object  # the checkpoint's HF tokenizer
    prompt_labels: list[str] = field(default_factory=list)  # each prompt as a report names it (spec's, then long)


class ReferenceSource(Protocol):
    """Where a release finds its HF reference runs (``tasks.gate_reference.ReferenceCache``)."""

    def run(self, checkpoint: Path, spec: ValidationSpec, precision: str, *, device: torch.device | str,
            max_seq_len: int | None, max_input_len: int | None = None) -> ReferenceRun: ...


def compare_greedy(*, reference: _Side, engine: _Side) -> tuple[str, int | None]:
    """Return (status, first divergence position) of two greedy generations with top-N tolerance.

    A generation that ended at EOS on one side is, at that step, a token like any other: tolerated when the
    EOS is in the other side's top-N and the other side's token in this side's."""
    for pos, (tok_0, tok_1) in enumerate(zip(reference.tokens, engine.tokens)):
        if tok_0 == tok_1:
            continue
        tolerated = tok_0 in engine.top[pos] and tok_1 in reference.top[pos]
        return ("tolerated" if tolerated else "diverged"), pos
    if len(reference.tokens) != len(engine.tokens):
        return "diverged", min(len(reference.tokens), len(engine.tokens))
    return "identical", None


def engine_precision(info) -> str:
    """The precision name an engine is judged by: its dtype, for a quantized engine its scheme too, and
    ``+fp8-kv`` for a ``torch`` engine with an fp8 KV cache (``tasks.quality_budgets``)."""
    quantization = getattr(info, "quantization", None)
    precision = info.limits.dtype
    if quantization is not None and quantization.enabled:
        precision = quantized_precision(precision, quantization.method, lm_head=quantization.lm_head)
    kv_cache = getattr(info, "kv_cache", None)  # a `torch` engine's; the TensorRT-LLM kinds' info has none
    return with_kv_cache(precision, kv_cache.kv_cache_dtype) if kv_cache is not None else precision


def eos_token_ids(checkpoint: Path) -> list[int]:
    """The ids that end a generation as the served engine picks them (``serving.triton.models.text``:
    generation_config.json's eos_token_id through ``stop_ids_for``; config.json's is not read, as Triton's
    ``llm`` model does not), so a checkpoint without generation_config.json is judged as it will be served."""
    from serving.triton.models.text import read_engine_text, stop_ids_for

    return list(stop_ids_for((), read_engine_text(Path(checkpoint)).eos_token_ids, ignore_eos=False))


def reference_run(checkpoint: Path, spec: ValidationSpec, precision: str, *, device: torch.device | str = "cpu",
                  max_seq_len: int | None = None, base: ReferenceRun | None = None,
                  max_input_len: int | None = None) -> ReferenceRun:
    """HF float32 on the prompts (greedy, to EOS) and the teacher-forced sequences; HF at `precision` beside it.

    With the engine's `max_input_len` (and `max_seq_len`), the prompts include `spec.envelope.long_prompts`
    made of the fixed texts up to it (``tasks.envelope``). `base`, a run of the same checkpoint and spec for
    another precision, lends its float32 side."""
    from transformers import AutoTokenizer

    from tasks.evaluation import load_evaluation

    budget = budget_for(precision)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    eos = eos_token_ids(checkpoint)
    passages = spec.passages if spec.passages is not None else list(load_evaluation().passages)
    prompt_ids = [list(tokenizer(p).input_ids) for p in spec.prompts]
    labels = list(spec.prompts)
    if max_input_len and max_seq_len and spec.envelope.long_prompts:
        longest_short = max(map(len, prompt_ids))
        for long in long_prompts(tokenizer, passages, spec.envelope.long_prompts, max_input_len=max_input_len,
                                 max_seq_len=max_seq_len, max_new_tokens=spec.max_new_tokens,
                                 shortest=min(longest_short + 1, max_input_len)):
            prompt_ids.append(long.ids)
            labels.append(long.label)
    if base is not None:
        greedy, sequences, logits = base.greedy, base.sequences, base.logits
    else:
        model = _hf_model(checkpoint, "float32", device)
        greedy = [_hf_greedy(model, ids, spec, eos) for ids in prompt_ids]
        sequences = [list(tokenizer(t).input_ids) for t in passages] + [
            ids + side.tokens for ids, side in zip(prompt_ids, greedy)]
        if max_seq_len:
            sequences = [s[:max_seq_len] for s in sequences]
        logits = [_hf_logits(model, s) for s in sequences]
        del model
    peer, peer_diverged = None, 0
    if budget.peer_dtype is not None and (budget.peer_dtype != "float32" or budget.peer_quantization
                                          or budget.peer_kv_cache):
        model = _hf_model(checkpoint, budget.peer_dtype, device)
        if budget.peer_quantization and fp8_checkpoint_of(checkpoint) is not None:  # its own FP8 weights
            round_fp8_checkpoint_tokens(model, checkpoint, scale_tokens=engine_scales_tokens(
                budget.peer_quantization, model.dtype, model.device))
        elif budget.peer_quantization:
            quantize_hf_linears(model, budget.peer_quantization, lm_head=budget.peer_lm_head)
        if budget.peer_kv_cache:
            round_hf_kv_cache(model, budget.peer_kv_cache)
        peer = combine(sequence_stats(ref, _hf_logits(model, s), s) for ref, s in zip(logits, sequences))
        peer_greedy = [_hf_greedy(model, ids, spec, eos) for ids in prompt_ids]
        peer_diverged = sum(compare_greedy(reference=r, engine=p)[0] == "diverged" for r, p in zip(greedy, peer_greedy))
        del model
    return ReferenceRun(precision, prompt_ids, greedy, sequences, logits, peer, peer_diverged, eos,
                        [*spec.prompts, *passages], tokenizer, labels)


def _hf_model(checkpoint: Path, dtype: str, device):
    """HF's model of the checkpoint; one already in FP8 dequantized by its own scales (`tasks.hf_reference`)."""
    return load_hf_model(checkpoint, dtype, device)


class _Fp8TokensLinear(torch.nn.Module):
    """An HF linear as the engine's fp8 GEMMs compute it on FP8 tensor cores: tokens rounded to e4m3 per row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.q, self.scale, self.bias = q, scale, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from serving.engine.quantize import fp8_emulated_linear

        return fp8_emulated_linear(x, self.q, self.scale, self.bias)


def engine_scales_tokens(method: str, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether an fp8 engine of `dtype` on `device` rounds its GEMMs' tokens to e4m3 (FP8 tensor cores, bf16)
    rather than computing weight-only (the dequantizing path: the CPU, older GPUs)."""
    from serving.engine.quantize import FP8, has_fp8_tensor_cores

    device = torch.device(device)
    return (method == FP8 and dtype == torch.bfloat16 and device.type == "cuda"
            and has_fp8_tensor_cores(device.index or 0))


@torch.no_grad()
def quantize_hf_linears(model, method: str, *, lm_head: bool, scale_tokens: bool | None = None) -> None:
    """Replace each decoder layer's linear weights (and the LM head's, when the engine quantizes it; a mixture of
    experts' stacked expert weights, not its router) by their quantized-then-dequantized values, per output
    channel as the engine's conversion does. Where the
    engine rounds tokens to e4m3 too (`scale_tokens`; by default `engine_scales_tokens` on the model's
    device), the peer's linears do the same, so that error is the peer's as well as the engine's."""
    from serving.engine.quantize import dequantize_weight, quantize_weight

    if scale_tokens is None:
        scale_tokens = engine_scales_tokens(method, model.dtype, model.device)
    linears = [(layer, name) for layer in model.model.layers for name, m in layer.named_modules()
               if isinstance(m, torch.nn.Linear)]
    if lm_head:
        linears.append((model, "lm_head"))
    for layer in model.model.layers:  # a mixture of experts' stacked weights [E, N, K]: weight-only (models.moe)
        for p in (p for p in layer.parameters() if p.dim() == 3):
            q, scale = quantize_weight(p.data.flatten(0, 1), method)
            p.data = dequantize_weight(q, scale, p.dtype).view_as(p)
    for owner, name in linears:
        linear = owner.get_submodule(name)
        q, scale = quantize_weight(linear.weight.data, method)
        if scale_tokens:
            parent_name, _, child = name.rpartition(".")
            parent = owner.get_submodule(parent_name) if parent_name else owner
            setattr(parent, child, _Fp8TokensLinear(q, scale, linear.bias))
        else:
            linear.weight.data = dequantize_weight(q, scale, linear.weight.dtype)


HF_FP8_KV_ATTENTION = "enginewright_fp8_kv_sdpa"  # the peer's attention over e4m3-rounded K/V (`round_hf_kv_cache`)


def _fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention over keys and values rounded to e4m3 as the engine's fp8 KV cache stores them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from serving.engine.kv_cache import from_kv_fp8, to_kv_fp8

    key, value = from_kv_fp8(to_kv_fp8(key), key.dtype), from_kv_fp8(to_kv_fp8(value), value.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def round_hf_kv_cache(model, kv_cache_dtype: str) -> None:
    """Make the HF model's attention read its keys and values as a KV cache of `kv_cache_dtype` holds them:
    "fp8" rounds them (rotated; every position, the current ones too) to e4m3 with the engine's clamp and
    scale (`kv_cache.to_kv_fp8`) before SDPA. Models whose attention goes through transformers'
    AttentionInterface (Llama, Mistral, Qwen2, Gemma 3) take it. Its masks are SDPA's (registered for it too:
    without, transformers builds none for an unknown implementation, and sliding windows would go unmasked)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if kv_cache_dtype != "fp8":
        raise ValueError(f"kv_cache.kv_cache_dtype={kv_cache_dtype!r} has no HF peer; only 'fp8' is rounded")
    AttentionInterface.register(HF_FP8_KV_ATTENTION, _fp8_kv_sdpa)
    AttentionMaskInterface.register(HF_FP8_KV_ATTENTION, sdpa_mask)
    model.set_attn_implementation(HF_FP8_KV_ATTENTION)


@torch.no_grad()
def _hf_logits(model, ids: Sequence[int]) -> torch.Tensor:
    return model(torch.tensor([list(ids)], device=model.device)).logits[0].float().cpu()


@torch.no_grad()
def _hf_greedy(model, prompt_ids: Sequence[int], spec: ValidationSpec, eos_ids: list[int]) -> _Side:
    """Greedy to max_new_tokens or the first of `eos_ids` (none: to max_new_tokens), with the raw logits' top-N
    at each step (a fresh GenerationConfig: no sampling settings or processors from the checkpoint's
    generation_config)."""
    from transformers import GenerationConfig

    input_ids = torch.tensor([list(prompt_ids)], device=model.device)
    # generate() fills an unset eos_token_id from the model's own generation config (config.json's EOS when the
    # checkpoint has no generation_config.json); the served engine stops at `eos_ids` only, and so does HF here
    model.generation_config.eos_token_id = eos_ids or None
    config = GenerationConfig(max_new_tokens=spec.max_new_tokens, do_sample=False, eos_token_id=eos_ids or None,
                              pad_token_id=(eos_ids or [0])[0], output_logits=True, return_dict_in_generate=True)
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    tokens = out.sequences[0, input_ids.shape[1]:].tolist()
    top = []
    for logits in out.logits:  # [1, V] per generated position, before any processor
        values, indices = torch.log_softmax(logits[0].float(), dim=-1).topk(spec.top_logprobs)
        top.append(dict(zip(indices.tolist(), values.tolist())))
    return _Side(tokens, top)


def validate_engine(engine_dir: Path, reference_checkpoint: Path, spec: ValidationSpec,
                    reference: ReferenceRun | None = None, runner=None,
                    reference_cache: ReferenceSource | None = None) -> ValidationResult:
    """Judge the engine against the HF reference (given, else from `reference_cache`, else computed here) and
    the precision's budget.

    `runner` (a loaded engine, e.g. wrapped by tasks.fault_injection) replaces loading `engine_dir`."""
    from serving.engine.runner import load_engine

    runner = runner or load_engine(engine_dir)
    precision = engine_precision(runner.info)
    lim = runner.info.limits
    if reference is None:
        run = reference_cache.run if reference_cache is not None else reference_run
        reference = run(reference_checkpoint, spec, precision, device=runner.device, max_seq_len=lim.max_seq_len,
                        max_input_len=lim.max_input_len)
    elif reference.precision != precision:
        raise ValueError(f"the reference was run for precision {reference.precision!r}, the engine is {precision!r}")
    budget = budget_for(precision)
    thresholds = _limits(spec, budget, reference)
    text_path = check_text_path(reference_checkpoint, engine_dir, reference.texts, reference.tokenizer)
    loaded = check_loaded(runner, precision)
    tok = reference.tokenizer
    labels = reference.prompt_labels or list(spec.prompts)
    comparisons: list[PromptComparison] = []
    figures = decode = wide = None
    decode_limits = _decode_limits(spec, budget, reference, thresholds)
    failures = [*text_path.failures, *loaded.failures]
    try:
        generate = _greedy(runner, spec, reference.eos_ids)
        # each prompt alone when the wide batch is checked (which then runs them all in one batch)
        generations = ([generate([p])[0] for p in reference.prompt_ids] if spec.envelope.wide_batch
                       else generate(reference.prompt_ids))
        for prompt, ref, gen in zip(labels, reference.greedy, generations):
            eng = _Side(list(gen.token_ids), [dict(t) for t in gen.top_logprobs])
            status, pos = compare_greedy(reference=ref, engine=eng)
            comparisons.append(PromptComparison(
                prompt, status, pos,  # type: ignore[arg-type]
                ref.tokens[pos] if pos is not None and pos < len(ref.tokens) else None,
                eng.tokens[pos] if pos is not None and pos < len(eng.tokens) else None,
                tok.decode(ref.tokens), tok.decode(eng.tokens)))
        figures = combine(
            sequence_stats(ref[:len(s[:lim.max_seq_len])], runner.prefill_logits(s[:lim.max_seq_len]).float(),
                           s[:lim.max_seq_len])
            for ref, s in zip(reference.logits, reference.sequences))
        reference_logits = _reference_logits(reference, Float32Reference(reference_checkpoint, runner.device))
        decode = score_generations(reference.prompt_ids, generations, reference_logits)
        if spec.envelope.wide_batch:
            wide = check_wide_batch(generate, reference.prompt_ids, generations, width=lim.max_batch_size,
                                    exact=precision == "float32", labels=labels, limits=decode_limits,
                                    reference_logits=reference_logits, max_rows=spec.envelope.max_wide_batch_rows)
    except Exception as exc:  # noqa: BLE001 - an engine that errors is refused with the error in the report
        failures.append(f"the engine raised {type(exc).__name__}: {exc}")
    if figures is not None:
        failures += _judge(comparisons, figures, thresholds)
    if decode is not None:
        failures += judge_decode(decode, decode_limits, labels)
    if wide is not None:
        failures += wide.failures
    return ValidationResult(not failures, precision, comparisons, figures, reference.peer, reference.peer_diverged,
                            text_path, thresholds, failures, decode, decode_limits, wide, loaded)


def _greedy(runner, spec: ValidationSpec, eos_ids: list[int]):
    """The engine's greedy generation with top-N log-probs, as the gate runs it (prompts -> Generations)."""
    def generate(prompts: list[list[int]]) -> list:
        return runner.generate(prompts, max_new_tokens=spec.max_new_tokens, top_logprobs=spec.top_logprobs,
                               stop_token_ids=eos_ids)
    return generate


def _reference_logits(reference: ReferenceRun, hf: Float32Reference) -> ReferenceLogits:
    """HF float32 teacher-forced logits of prompt i's sequence: the reference run's own where the sequence is
    the reference's greedy path, else HF run on it (once per distinct sequence)."""
    first = len(reference.sequences) - len(reference.prompt_ids)  # the passages come first
    computed: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(i: int, sequence: list[int]) -> torch.Tensor:
        stored = reference.sequences[first + i]
        if stored[:len(sequence)] == sequence:
            return reference.logits[first + i]
        key = tuple(sequence)
        if key not in computed:
            computed[key] = hf.logits(sequence)
        return computed[key]
    return logits


def _decode_limits(spec: ValidationSpec, budget: PrecisionBudget, reference: ReferenceRun,
                   thresholds: dict[str, float]) -> DecodeLimits:
    """How many generated tokens may differ from HF's argmax, how far, and the mean log-prob difference."""
    envelope = spec.envelope
    positions = len(reference.prompt_ids) * spec.max_new_tokens
    count = int(thresholds["max_top1_disagreement"] * positions) + budget.extra_diverged_prompts
    if budget.peer_dtype is None:  # float32: ties only
        gap = FLOAT32_DECODE_GAP
    else:
        peer_error = reference.peer.max_logit_error if reference.peer else 0.0
        gap = REDUCED_DECODE_GAP + thresholds["peer_factor"] * peer_error
    return DecodeLimits(
        max_disagreements=count if envelope.max_decode_disagreements is None else envelope.max_decode_disagreements,
        max_gap=gap if envelope.max_decode_gap is None else envelope.max_decode_gap,
        max_mean_logprob_delta=thresholds["max_nll_delta"] if budget.peer_dtype is None else None)


FLOAT32_DECODE_GAP = 1e-3  # nats: a float32 engine may break only a tie
REDUCED_DECODE_GAP = 0.25  # nats, plus the peer's logit error: a reduced-precision engine's near-ties


def _limits(spec: ValidationSpec, budget: PrecisionBudget, reference: ReferenceRun) -> dict[str, float]:
    """Effective limits: each floor (spec, else the precision's budget) plus peer_factor x the peer's figure."""
    factor = budget.peer_factor if spec.peer_factor is None else spec.peer_factor
    peer = reference.peer

    def limit(floor: float | None, default: float, peer_value: float) -> float:
        return (default if floor is None else floor) + (factor * peer_value if peer else 0.0)

    return {
        "max_failed_prompts": spec.max_failed_prompts + budget.extra_diverged_prompts + reference.peer_diverged,
        "max_mean_kl": limit(spec.max_mean_kl, budget.max_mean_kl, peer.mean_kl if peer else 0.0),
        "max_nll_delta": limit(spec.max_nll_delta, budget.max_nll_delta, abs(peer.nll_delta) if peer else 0.0),
        "max_top1_disagreement": limit(spec.max_top1_disagreement, budget.max_top1_disagreement,
                                       peer.top1_disagreement if peer else 0.0),
        "peer_factor": factor,
    }


def _judge(comparisons: list[PromptComparison], figures: DistanceFigures, limits: dict[str, float]) -> list[str]:
    failures = []
    diverged = [c for c in comparisons if c.status == "diverged"]
    if len(diverged) > limits["max_failed_prompts"]:
        failures.append(f"{len(diverged)} of {len(comparisons)} prompts diverged beyond the top-N tolerance (limit "
                        f"{limits['max_failed_prompts']:g}: validation.max_failed_prompts + the precision's allowance + HF's own at "
                        "this precision)")
    for value, key, what in ((figures.mean_kl, "max_mean_kl", "mean per-token KL(reference || engine)"),
                             (abs(figures.nll_delta), "max_nll_delta", "|NLL difference| per token"),
                             (figures.top1_disagreement, "max_top1_disagreement", "top-1 disagreement")):
        if value > limits[key]:
            failures.append(f"{what} {value:.3g} > limit {limits[key]:.3g} (validation.{key} + peer_factor "
                            f"{limits['peer_factor']:g} x HF's own at this precision)")
    return failures


def render_report(result: ValidationResult) -> str:
    """Markdown a person reads: verdict, engine and HF peer figures against the limits, one row per prompt."""
    e, p, t = result.engine, result.peer, result.thresholds
    peer = "HF at the engine's precision" if p else "-"
    kv_cache = budget_for(result.precision).peer_kv_cache if p else None
    if kv_cache:
        peer += f", its attention over K/V rounded as the engine's {kv_cache} KV cache stores them"

    def row(label: str, get, limit: str) -> str:
        return f"| {label} | {get(e) if e else '-'} | {get(p) if p else '-'} | {limit} |"

    lines = [
        f"# Validation gate: {'PASSED' if result.passed else 'FAILED'} (precision {result.precision})",
        "",
        *(f"- {f}" for f in result.failures),
        "",
        f"Against Hugging Face float32. Peer: {peer}.",
        "",
        "| figure | engine | peer | limit |",
        "| --- | --- | --- | --- |",
        row("mean KL(reference \\|\\| x), nats/token", lambda f: f"{f.mean_kl:.3g}", f"<= {t['max_mean_kl']:.3g}"),
        row("NLL x - reference, nats/token", lambda f: f"{f.nll_delta:+.3g}", f"\\|.\\| <= {t['max_nll_delta']:.3g}"),
        row("top-1 agreement", lambda f: f"{f.top1_agreement:.4f}", f">= {1 - t['max_top1_disagreement']:.4f}"),
        row("max logit error", lambda f: f"{f.max_logit_error:.3g}", "(not judged)"),
        row("scored positions", lambda f: str(f.positions), ""),
        "",
        (f"Text path: {len(result.text_path.files)} tokenizer files hashed, {result.text_path.texts_checked} texts "
        f"tokenized as Triton does: {'equal' if result.text_path.passed else 'DIFFERENT'}."),
        "",
        "| prompt | status | first divergence | hf text | engine text |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in result.comparisons:
        where = "-" if c.divergence_position is None else (
            f"token {c.divergence_position}: hf {c.reference_token} vs engine {c.engine_token}")
        lines.append(f"| {_cell(c.prompt)} | {c.status} | {where} | {_cell(c.reference_text)} | {_cell(c.engine_text)} |")
    return "\n".join(lines + _envelope_lines(result)) + "\n"


def _envelope_lines(result: ValidationResult) -> list[str]:
    """The free-running decode figures, the wide batch and what the runner loaded, for the report."""
    lines = [""]
    d, lim = result.decode, result.decode_limits
    if d is not None and lim is not None:
        lines += [
            ("Free-running decode, every generated token against HF float32 teacher-forced over the engine's own "
            "sequence:"), "",
            "| figure | engine | limit |", "| --- | --- | --- |",
            f"| generated tokens not HF's argmax | {len(d.disagreements)} of {d.positions} | <= {lim.max_disagreements} |",
            f"| largest gap to HF's argmax, nats | {d.max_gap:.3g} | <= {lim.max_gap:.3g} |",
            (f"| mean log-prob engine - HF where both pick the token, nats/token | {d.mean_logprob_delta:+.3g} | "
             + ("(not judged below float32)" if lim.max_mean_logprob_delta is None
                else f"\\|.\\| <= {lim.max_mean_logprob_delta:.3g}") + " |"), ""]
    if result.wide_batch is not None:
        w = result.wide_batch
        scored = ("" if w.figures is None else f"; every row against HF float32: {len(w.figures.disagreements)} of "
                  f"{w.figures.positions} tokens not its argmax, largest gap {w.figures.max_gap:.3g} nats")
        lines += [(f"Wide batch: {w.prompts} prompts in one batch of {w.rows} rows against each alone: "
                  f"{len(w.differences)} rows differ{scored}{' (refused)' if w.failures else ''}."), ""]
    if result.loaded is not None:
        lines += render_loaded(result.loaded)
    return lines


def _cell(text: str) -> str:
    return json.dumps(text)[1:-1].replace("|", "\\|")


def require_passed(result: ValidationResult) -> None:
    """Raise GateFailed with the report when the gate said no."""
    if not result.passed:
        raise GateFailed("validation", "; ".join(result.failures), render_report(result))


@task(name="validate", retries=0, cache_policy=NONE)  # NONE: a runner would be hashed by pickling its model
def validate_task(engine_dir: Path, reference_checkpoint: Path, spec: ValidationSpec, runner=None,
                  reference_cache: ReferenceSource | None = None) -> ValidationResult:
    """Compare the engine (loaded from `engine_dir` unless `runner` is given) with Hugging Face transformers
    (float32, and at the engine's precision; kept in `reference_cache` for later releases of the checkpoint)."""
    return validate_engine(engine_dir, reference_checkpoint, spec, runner=runner, reference_cache=reference_cache)
