"""The fixed evaluation's false-refusal sweep: unchanged rebuilds and other good checkpoints against production,
each judged with the default `EvaluationSpec` (every part: perplexity, cloze, KL, top-1, greedy), and the
seeded faults beside them (which must be refused).

Production is the `--dtypes` entry's build of the checkpoint (max_batch_size 4). Per model and dtype:
- `--rebuilds` unchanged rebuilds (max_batch_size 2, 3, ...: rebuilt from the checkpoint, the same weights);
- `--good` other good checkpoints: the checkpoint with Gaussian noise of `--good-noise` x each matrix's std
  (seeds 1..N), a fine-tune that changed little;
- the faults: LM head x `--sharpen` (perplexity up, greedy text the same) and noise of each `--fault-noise`
  (greedy text different).
Each case is scored once; the greedy part is then judged at every `--tie-gaps` value (the spec's
`greedy_tie_gap`, the least tie gap: production's measured rounding noise raises it where larger), so one run
compares the rules. Prints a table (one row per case: every part's verdict and figure, production's rounding
noise, the greedy verdict per tie gap, pass or refuse) and a summary; `--out` writes every case's figures,
intervals and first divergences (each side's gap) as JSON. Exits 1 when a good build is refused or a fault passes
under the default spec.

    .venv/bin/python bench/evidence_sweep.py --models tiny --dtypes float32,bfloat16 --rebuilds 10 --good 5
    .venv/bin/python bench/evidence_sweep.py --models smollm2 --dtypes bfloat16 --rebuilds 0 --good 2 --quick \\
        --good-noise 0.002 --fault-noise 0.01,0.03 --sharpen 1.03
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # gate_faults

import gate_faults

from serving.engine import build_engine, convert_checkpoint, load_engine
from serving.engine.build import EngineLimits
from tasks.evaluation import EvaluationComparison, Scored, compare_scores, load_evaluation, score_pair
from tasks.gate_specs import EvaluationSpec
from tasks.text_path import server_encode

PARTS = ("perplexity", "cloze", "kl", "top1", "greedy")


@dataclass(frozen=True)
class Case:
    name: str
    engine: Path
    expect_pass: bool


def build(checkpoint: Path, out: Path, dtype: str, max_batch_size: int) -> Path:
    if not (out / "engine.json").is_file():
        converted = convert_checkpoint(checkpoint, out.with_name(out.name + "-ckpt"), dtype=dtype)
        build_engine(converted, out, limits=EngineLimits(dtype=dtype, max_batch_size=max_batch_size,
                                                         max_input_len=64, max_seq_len=128))
    return out


def scored(engine: Path) -> Scored:
    return Scored(load_engine(engine), server_encode(engine)[0])


def spec_with(base: EvaluationSpec, **changes) -> EvaluationSpec:
    return base.model_copy(update=changes)


def case_line(model: str, dtype: str, case: Case, result: EvaluationComparison, by_gap: dict[float, str],
              gaps: list[tuple[float, float]], noise: float, seconds: float) -> dict:
    return {"model": model, "dtype": dtype, "case": case.name, "expect_pass": case.expect_pass,
            "passed": result.passed, "seconds": round(seconds, 1), "greedy_by_tie_gap": by_gap,
            "first_divergence_gaps": gaps, "rounding_noise": noise,
            "parts": {p.name: {"figure": p.figure, "low": p.low, "high": p.high, "budget": p.budget,
                               "verdict": p.verdict, "n": p.units, "needed": p.needed} for p in result.parts}}


def table_row(line: dict, tie_gaps: list[float]) -> str:
    parts = line["parts"]
    cells = [f"{parts[n]['verdict']} {parts[n]['figure']:.3g}" if n in parts else "-" for n in PARTS]
    cells.append(f"{line['rounding_noise']:.3g}")
    greedy = [line["greedy_by_tie_gap"][str(g)] for g in tie_gaps]
    outcome = "pass" if line["passed"] else "REFUSE"
    wrong = "" if line["passed"] == line["expect_pass"] else " (wrong)"
    return (f"| {line['model']} | {line['dtype']} | {line['case']} | " + " | ".join(cells) + " | "
            + " | ".join(greedy) + f" | {outcome}{wrong} |")


def cases_for(model: str, checkpoint: Path, root: Path, dtype: str, args) -> list[Case]:
    cases = [Case(f"rebuild {r}", build(checkpoint, root / f"{dtype}-rebuild{r}", dtype, 2 + r), True)
             for r in range(args.rebuilds)]
    for g in range(1, args.good + 1):
        hf = root / f"hf-good{g}-{args.good_noise}"
        if not hf.exists():
            gate_faults.degrade(checkpoint, hf, relative_noise=args.good_noise, seed=g)
        cases.append(Case(f"good checkpoint {g} (noise {args.good_noise})",
                          build(hf, root / f"{dtype}-good{g}-{args.good_noise}", dtype, 4), True))
    sharper = root / f"hf-sharper-{args.sharpen}"
    if not sharper.exists():
        gate_faults.scale_logits(checkpoint, sharper, factor=args.sharpen)
    cases.append(Case(f"fault: LM head x {args.sharpen}", build(sharper, root / f"{dtype}-sharper-{args.sharpen}",
                                                                 dtype, 4), False))
    for noise in (float(x) for x in args.fault_noise.split(",")):
        noisy = root / f"hf-noisy-{noise}"
        if not noisy.exists():
            gate_faults.degrade(checkpoint, noisy, relative_noise=noise)
        cases.append(Case(f"fault: noise {noise}", build(noisy, root / f"{dtype}-noisy-{noise}", dtype, 4), False))
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny", help="comma-separated: tiny, smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rebuilds", type=int, default=10)
    ap.add_argument("--good", type=int, default=5)
    ap.add_argument("--good-noise", type=float, default=0.0005)
    ap.add_argument("--fault-noise", default="0.004", help="comma-separated noise levels, each a fault")
    ap.add_argument("--sharpen", type=float, default=1.012)
    ap.add_argument("--tie-gaps", default="0,0.1,0.25,0.5", help="greedy_tie_gap values the greedy part is judged at")
    ap.add_argument("--work", type=Path, default=Path("/tmp/evidence-sweep"))
    ap.add_argument("--out", type=Path, default=None, help="also write the lines here (JSON list)")
    ap.add_argument("--quick", action="store_true", help="8 cloze items against a 50-point budget (the demo's), "
                    "the other parts as the default spec: a quarter of the scoring, for a loaded machine")
    args = ap.parse_args()
    spec = (EvaluationSpec(max_choices=8, max_accuracy_drop_points=50.0) if args.quick else EvaluationSpec())
    tie_gaps = [float(x) for x in args.tie_gaps.split(",")]
    data = load_evaluation()
    lines, bad = [], 0
    print("| model | dtype | case | " + " | ".join(PARTS) + " | rounding noise | "
          + " | ".join(f"greedy, tie gap {g}" for g in tie_gaps) + " | outcome |", flush=True)
    for model in args.models.split(","):
        root = args.work / model
        root.mkdir(parents=True, exist_ok=True)
        if model == "tiny":
            from tasks.tiny_model import make_tiny_model

            checkpoint = root / "hf"
            if not checkpoint.exists():
                make_tiny_model(checkpoint, seed=0)
        else:
            from tasks.example_model import make_example_model

            checkpoint = make_example_model()
        for dtype in args.dtypes.split(","):
            production = scored(build(checkpoint, root / f"{dtype}-production", dtype, 4))
            for case in cases_for(model, checkpoint, root, dtype, args):
                start = time.perf_counter()
                c_scores, p_scores, distances = score_pair(scored(case.engine), production, data, spec)
                result = compare_scores(c_scores, p_scores, spec, production_version="production",
                                        distances=distances)
                by_gap = {}
                for gap in tie_gaps:
                    judged = compare_scores(c_scores, p_scores, spec_with(spec, greedy_tie_gap=gap),
                                            production_version="production", distances=distances)
                    greedy = next(p for p in judged.parts if p.name == "greedy")
                    by_gap[str(gap)] = f"{greedy.verdict} {greedy.figure:.3f} [{greedy.low:.3f}, {greedy.high:.3f}]"
                gaps = [(c.tie_gap(first), c.candidate_gap(first)) for c in distances.greedy
                        if (first := c.first_divergence(spec.greedy_new_tokens)) is not None]
                line = case_line(model, dtype, case, result, by_gap, gaps, distances.rounding_noise,
                                 time.perf_counter() - start)
                bad += line["passed"] != case.expect_pass
                lines.append(line)
                print(table_row(line, tie_gaps), flush=True)
    good = [x for x in lines if x["expect_pass"]]
    faults = [x for x in lines if not x["expect_pass"]]
    print(f"good builds refused: {sum(not x['passed'] for x in good)} of {len(good)}; "
          f"faults passed: {sum(x['passed'] for x in faults)} of {len(faults)}")
    if args.out:
        args.out.write_text(json.dumps(lines, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
