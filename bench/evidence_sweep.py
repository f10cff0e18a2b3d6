"""The fixed evaluation's false-refusal sweep: unchanged rebuilds and other good checkpoints against production,
each judged with the default `EvaluationSpec` (every part: perplexity, cloze, KL, top-1, greedy), and the
seeded faults beside them (which must be refused).

Production is the float32 (or `--dtypes` entry) build of the checkpoint. Per model and dtype:
- `--rebuilds` unchanged rebuilds (max_batch_size 2, 3, 4, ...: rebuilt from the checkpoint, the same weights);
- `--good` other good checkpoints: the checkpoint with Gaussian noise of `--good-noise` x each matrix's std
  (seeds 1..N), a fine-tune that changed little;
- the faults: LM head x `--sharpen` (perplexity up, greedy text the same) and noise `--fault-noise` (greedy
  text different).
Prints one JSON line per case (verdict and every part's figure, interval and budget) and a summary; exits 1
when a good build is refused or a fault passes.

    .venv/bin/python bench/evidence_sweep.py --models tiny --dtypes float32,bfloat16 --rebuilds 10 --good 5
    .venv/bin/python bench/evidence_sweep.py --models smollm2 --dtypes float32,bfloat16 --rebuilds 10 --good 5 \
        --good-noise 0.002 --fault-noise 0.05 --sharpen 1.03
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # gate_faults

import gate_faults

from serving.engine import build_engine, convert_checkpoint
from serving.engine.build import EngineLimits
from tasks.evaluation import EvaluationComparison, evaluate_engines
from tasks.gate_specs import EvaluationSpec


def build(checkpoint: Path, out: Path, dtype: str, max_batch_size: int) -> Path:
    if not (out / "engine.json").is_file():
        converted = convert_checkpoint(checkpoint, out.with_name(out.name + "-ckpt"), dtype=dtype)
        build_engine(converted, out, limits=EngineLimits(dtype=dtype, max_batch_size=max_batch_size,
                                                         max_input_len=64, max_seq_len=128))
    return out


def case_line(model: str, dtype: str, case: str, expect_pass: bool, result: EvaluationComparison,
              seconds: float) -> dict:
    return {"model": model, "dtype": dtype, "case": case, "expect_pass": expect_pass, "passed": result.passed,
            "seconds": round(seconds, 1),
            "parts": {p.name: {"figure": p.figure, "low": p.low, "high": p.high, "budget": p.budget,
                               "verdict": p.verdict, "n": p.units, "needed": p.needed} for p in result.parts}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny", help="comma-separated: tiny, smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rebuilds", type=int, default=10)
    ap.add_argument("--good", type=int, default=5)
    ap.add_argument("--good-noise", type=float, default=0.0005)
    ap.add_argument("--fault-noise", type=float, default=0.004)
    ap.add_argument("--sharpen", type=float, default=1.012)
    ap.add_argument("--work", type=Path, default=Path("/tmp/evidence-sweep"))
    ap.add_argument("--out", type=Path, default=None, help="also write the lines here (JSON list)")
    args = ap.parse_args()
    spec = EvaluationSpec()
    lines, bad = [], 0
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
            production = build(checkpoint, root / f"{dtype}-production", dtype, 4)
            cases: list[tuple[str, Path, bool]] = []
            for r in range(args.rebuilds):
                cases.append((f"rebuild {r}", build(checkpoint, root / f"{dtype}-rebuild{r}", dtype, 2 + r), True))
            for g in range(1, args.good + 1):
                hf = root / f"hf-good{g}"
                if not hf.exists():
                    gate_faults.degrade(checkpoint, hf, relative_noise=args.good_noise, seed=g)
                cases.append((f"good checkpoint {g} (noise {args.good_noise})", build(hf, root / f"{dtype}-good{g}", dtype, 4), True))
            sharper, noisy = root / "hf-sharper", root / "hf-noisy"
            if not sharper.exists():
                gate_faults.scale_logits(checkpoint, sharper, factor=args.sharpen)
            if not noisy.exists():
                gate_faults.degrade(checkpoint, noisy, relative_noise=args.fault_noise)
            cases += [(f"fault: LM head x {args.sharpen}", build(sharper, root / f"{dtype}-sharper", dtype, 4), False),
                      (f"fault: noise {args.fault_noise}", build(noisy, root / f"{dtype}-noisy", dtype, 4), False)]
            for name, engine, expect_pass in cases:
                start = time.perf_counter()
                result = evaluate_engines(engine, spec, production_dir=production, production_version="production")
                line = case_line(model, dtype, name, expect_pass, result, time.perf_counter() - start)
                bad += line["passed"] != expect_pass
                lines.append(line)
                print(json.dumps(line), flush=True)
    good = [x for x in lines if x["expect_pass"]]
    faults = [x for x in lines if not x["expect_pass"]]
    print(f"good builds refused: {sum(not x['passed'] for x in good)} of {len(good)}; "
          f"faults passed: {sum(x['passed'] for x in faults)} of {len(faults)}")
    if args.out:
        args.out.write_text(json.dumps(lines, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
