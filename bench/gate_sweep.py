"""The quality gates' false-refusal sweep: many good builds through the whole validation gate and the fixed
evaluation against a good production build of the same checkpoint, faulty builds beside them.

Good builds: tiny random checkpoints of every supported architecture (`tasks.tiny_model.ARCHS`) and several
seeds, plus SmolLM2-135M-Instruct (`tasks.example_model`), each converted and built again per rebuild (the
rebuilds differ in `max_batch_size`, so the greedy prompts are batched differently), in every `--dtypes`
entry (and `--quantizations` on top of each). Each is judged against the checkpoint's HF float32 reference
(one per checkpoint) with the default `ValidationSpec` and scored on the whole fixed evaluation; production
is the float32 build of the same checkpoint, so a precision change is judged as a release would judge it.
Faulty builds (`--faults`, from tests/gate_faults.py) of the first good build of each precision must be
refused. Every figure is printed beside its limit as a *margin* (figure / limit: under 1 passes), and the
summary gives the count of good builds refused and the largest margin of each measure.

CPU (docs/gates.md's figures):
    .venv/bin/python bench/gate_sweep.py --threads 1 --out /tmp/sweep.json
The H200 check (bench/device_gate_sweep.sh):
    python3 bench/gate_sweep.py --device cuda --gguf SmolLM2.gguf --tiny-seeds 0 --faults int8_round,drop_layer
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # gate_faults, a test helper

import gate_faults

from serving.engine import build_engine, convert_checkpoint, load_engine
from serving.engine.build import EngineLimits
from serving.engine.quantize import QuantInfo
from tasks.evaluation import EvaluationScores, EvaluationSpec, compare_scores, load_evaluation, score
from tasks.quality_budgets import quantized_precision
from tasks.text_path import server_encode
from tasks.validate import ReferenceRun, ValidationResult, ValidationSpec, reference_run, validate_engine

FAULTS: dict[str, Callable] = {
    "int8_round": gate_faults.int8_round,
    "drop_layer": gate_faults.drop_layer(1),
    "swap_heads": gate_faults.swap_heads(0),
    "add_noise": gate_faults.add_noise(0.2),
}
BATCH_SIZES = (4, 2, 8, 3)  # rebuild r uses BATCH_SIZES[r % 4]
MEASURES = ("max_mean_kl", "max_nll_delta", "max_top1_disagreement", "max_failed_prompts",
            "max_decode_disagreements", "max_decode_gap")


@dataclass
class Case:
    """One build through the gates: its figures, their limits and margins, and the verdicts."""

    model: str
    precision: str
    build: str  # "rebuild N (max_batch_size B)" or "fault NAME"
    expect_pass: bool
    passed: bool
    figures: dict[str, float]
    limits: dict[str, float]
    failures: list[str]
    evaluation: dict[str, float] = field(default_factory=dict)  # regression / budget and p per part
    evaluation_passed: bool | None = None
    seconds: float = 0.0

    @property
    def margins(self) -> dict[str, float]:
        return {k: _ratio(self.figures[k], self.limits[k]) for k in MEASURES if k in self.figures}


def _ratio(value: float, limit: float) -> float:
    if limit > 0:
        return value / limit
    return 0.0 if value == 0 else math.inf


def figures_of(result: ValidationResult) -> dict[str, float]:
    e = result.engine
    out = {"max_failed_prompts": float(sum(c.status == "diverged" for c in result.comparisons))}
    if e is not None:
        out |= {"max_mean_kl": e.mean_kl, "max_nll_delta": abs(e.nll_delta), "max_top1_disagreement": e.top1_disagreement}
    if result.decode is not None:  # free-running decode against HF on the engine's own sequences
        out |= {"max_decode_disagreements": float(len(result.decode.disagreements)),
                "max_decode_gap": result.decode.max_gap}
    return out


def limits_of(result: ValidationResult) -> dict[str, float]:
    limits = dict(result.thresholds)
    if result.decode_limits is not None:
        limits |= {"max_decode_disagreements": float(result.decode_limits.max_disagreements),
                   "max_decode_gap": result.decode_limits.max_gap}
    return limits


def build(hf: Path, work: Path, *, dtype: str, method: str | None, batch: int, seq: int) -> Path:
    """Convert and build one engine of `hf` (the converted checkpoint removed afterwards)."""
    import shutil

    quant = QuantInfo(method) if method else None
    ckpt = convert_checkpoint(hf, work / "ckpt", dtype=dtype, quantization=quant)
    limits = EngineLimits(dtype=dtype, max_batch_size=batch, max_input_len=min(128, seq), max_seq_len=seq)
    engine = Path(build_engine(ckpt, work / "engine", limits=limits).path)
    shutil.rmtree(ckpt)
    return engine


def evaluation_scores(runner, engine: Path, data, seq: int) -> EvaluationScores:
    encode, _ = server_encode(engine)
    return score(lambda ids: runner.prefill_logits(ids).float(), encode, data, max_len=seq)


def sweep_model(name: str, hf: Path, work: Path, *, dtypes: list[str], quantizations: list[str], rebuilds: int,
                faults: list[str], device: str, seq: int, spec: ValidationSpec, data,
                report: Callable[[Case], None], overrides: dict | None = None) -> list[Case]:
    """Every build of one checkpoint through validation, then the fixed evaluation against its float32 build."""
    import shutil

    envelope = {"max_seq_len": seq, "max_input_len": min(128, seq)}  # the long prompts of `build`'s limits
    base = reference_run(hf, spec, "float32", device=device, **envelope)  # the float32 side, shared
    cases: list[Case] = []
    scores: dict[int, EvaluationScores] = {}
    production: EvaluationScores | None = None
    precisions = [(d, None) for d in dtypes] + [(d, m) for d in dtypes for m in quantizations]
    for dtype, method in precisions:
        precision = quantized_precision(dtype, method, lm_head=False) if method else dtype
        reference: ReferenceRun = base if precision == "float32" else reference_run(
            hf, spec, precision, device=device, base=base, **envelope)
        for r in range(rebuilds):
            t0 = time.monotonic()
            folder = work / f"{precision}-{r}"
            engine = build(hf, folder, dtype=dtype, method=method, batch=BATCH_SIZES[r % 4], seq=seq)
            runner = load_engine(engine, device=device, overrides=overrides)
            result = validate_engine(engine, hf, spec, reference=reference, runner=runner)
            case = Case(name, precision, f"rebuild {r} (max_batch_size {BATCH_SIZES[r % 4]})", True, result.passed,
                        figures_of(result), limits_of(result), result.failures)
            got = evaluation_scores(runner, engine, data, seq)
            if precision == "float32" and r == 0:
                production = got
            scores[len(cases)] = got
            cases.append(case)
            if r == 0:
                for fault in faults if not method else [f for f in faults if f == "swap_heads"]:
                    bad = gate_faults.edited_runner(engine, FAULTS[fault])
                    bad_result = validate_engine(engine, hf, spec, reference=reference, runner=bad)
                    bad_case = Case(name, precision, f"fault {fault}", False, bad_result.passed, figures_of(bad_result),
                                    limits_of(bad_result), bad_result.failures)
                    del bad
                    cases.append(bad_case)
                    report(bad_case)
            del runner
            shutil.rmtree(folder)
            case.seconds = time.monotonic() - t0
            report(case)
    if production is not None:
        espec = EvaluationSpec()
        for index, got in scores.items():
            comparison = compare_scores(got, production, espec, production_version="float32 rebuild 0")
            cases[index].evaluation_passed = comparison.passed
            # a part's margin: its upper bound over its budget (under 1: within, passes)
            cases[index].evaluation = {f"{p.name}_margin": _ratio(p.high, p.budget) for p in comparison.parts}
            if not comparison.passed:
                cases[index].failures += comparison.failures
    return cases


def tiny_models(work: Path, seeds: Iterable[int]) -> list[tuple[str, Path]]:
    from tasks.tiny_model import ARCHS, make_tiny_model

    return [(f"tiny-{arch}-s{seed}", make_tiny_model(work / f"hf-{arch}-{seed}", arch=arch, seed=seed))
            for seed in seeds for arch in ARCHS]


def smollm2(work: Path, gguf: Path | None) -> Path:
    """The example checkpoint: the cached one, or made here from a GGUF file (the device has no PyPI)."""
    if gguf is None:
        from tasks.example_model import make_example_model

        return make_example_model()
    from tasks.example_model import convert_gguf

    out = work / "smollm2-f32"
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
    return out


def line(case: Case) -> str:
    m, f, lim = case.margins, case.figures, case.limits
    verdict = "pass" if case.passed else "REFUSED"
    expected = "" if case.passed == case.expect_pass else "  <-- UNEXPECTED"
    evaluation = ""
    if case.evaluation_passed is not None:
        evaluation = (f" | eval {'pass' if case.evaluation_passed else 'REFUSED'} "
                      f"ppl {case.evaluation.get('perplexity_margin', 0):+.2f} acc {case.evaluation.get('cloze_margin', 0):+.2f}")
    figs = " ".join(f"{k.removeprefix('max_')} {f.get(k, float('nan')):.3g}/{lim.get(k, float('nan')):.3g}"
                    f" ({m.get(k, float('nan')):.2f})" for k in MEASURES)
    return f"{case.model:22s} {case.precision:14s} {case.build:28s} {verdict:7s} {figs}{evaluation}{expected}"


def summary(cases: list[Case]) -> dict:
    good = [c for c in cases if c.expect_pass]
    bad = [c for c in cases if not c.expect_pass]
    worst = {k: max((c.margins.get(k, 0.0) for c in good), default=0.0) for k in MEASURES}
    evaluated = [c for c in good if c.evaluation_passed is not None]
    return {
        "good_builds": len(good),
        "good_refused_by_validation": sum(not c.passed for c in good),
        "good_evaluated_against_production": len(evaluated),
        "good_refused_by_evaluation": sum(not c.evaluation_passed for c in evaluated),
        "largest_good_margin": worst,
        "largest_good_evaluation_margin": {k: max((c.evaluation.get(k, 0.0) for c in evaluated), default=0.0)
                                           for k in ("perplexity_margin", "cloze_margin")},
        "faulty_builds": len(bad),
        "faulty_passed": sum(c.passed for c in bad),
        "smallest_faulty_margin": min((max(c.margins.values(), default=0.0) for c in bad), default=None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny-seeds", default="0,1,2,3", help="Seeds of the tiny checkpoints, comma-separated "
                        "(each seed: one checkpoint per architecture); empty: none.")
    parser.add_argument("--no-smollm2", action="store_true", help="Leave out SmolLM2-135M-Instruct.")
    parser.add_argument("--gguf", type=Path, help="Make SmolLM2 from this GGUF file instead of the cache.")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantizations", default="", help="Methods built on top of each dtype, e.g. fp8.")
    parser.add_argument("--rebuilds", type=int, default=2)
    parser.add_argument("--faults", default="int8_round,drop_layer,swap_heads",
                        help=f"Faulty builds of each precision's first build: {sorted(FAULTS)}.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default); on a "
                        "loaded 2-core machine 1 is many times faster (threads spin waiting for each other).")
    parser.add_argument("--work", type=Path, default=None, help="Scratch folder (default: a temporary one).")
    parser.add_argument("--out", type=Path, help="Write every case and the summary as JSON here.")
    parser.add_argument("--fp8-precise-accum", action="store_true", help="fp8 prompt GEMMs without _scaled_mm's fast "
                        "accumulation (EngineOptions.fp8_fast_accum off), to set its quality beside the engine's (GPU)")
    args = parser.parse_args(argv)

    import tempfile

    import torch

    torch.manual_seed(0)
    overrides = {"fp8_fast_accum": False} if args.fp8_precise_accum else None
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="gate-sweep-"))
    split = lambda s: [x for x in s.split(",") if x]
    models = tiny_models(work, [int(s) for s in split(args.tiny_seeds)])
    if not args.no_smollm2:
        models.append(("smollm2-135m", smollm2(work, args.gguf)))
    spec, data = ValidationSpec(), load_evaluation()
    print(f"{len(models)} checkpoints x {split(args.dtypes)} (+{split(args.quantizations)}) x {args.rebuilds} rebuilds,"
          f" faults {split(args.faults)}, device {args.device}; margin = figure / limit", flush=True)
    cases: list[Case] = []
    t0 = time.monotonic()
    for name, hf in models:
        cases += sweep_model(name, hf, work / name, dtypes=split(args.dtypes), quantizations=split(args.quantizations),
                             rebuilds=args.rebuilds, faults=split(args.faults), device=args.device,
                             seq=args.max_seq_len, spec=spec, data=data, report=lambda c: print(line(c), flush=True),
                             overrides=overrides)
        for c in cases:
            if c.model == name and c.evaluation_passed is not None:
                print(f"  eval vs float32 rebuild 0: {c.precision} {c.build}: {line(c).split(' | ')[-1]}", flush=True)
    result = summary(cases)
    result["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"summary": result, "cases": [asdict(c) | {"margins": c.margins} for c in cases]},
                                       indent=2, default=str))
    ok = not result["good_refused_by_validation"] and not result["good_refused_by_evaluation"] and not result["faulty_passed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
