"""lm-evaluation-harness against `enginewright serve`, scored beside lm-eval's own `hf` backend on the same
float32 checkpoint (issue 49's acceptance).

`python -m serving.bench.lm_eval_check --checkpoint DIR --out DIR` converts and builds a paged float32 engine of
the checkpoint, serves it (a real Triton, its routers, the OpenAI front on loopback), writes two tasks in
lm-eval's own format over local JSONL files (`write_tasks`: a multiple-choice likelihood task and a generation
task, arithmetic questions made from a fixed seed; `dataset_path: json`, no dataset hub), and runs the `lm_eval`
command line twice: `--model local-completions` against the front (token ids, `echo`, `logprobs`,
`max_tokens` 1: its likelihood requests; `stop` strings for generation) and `--model hf`. It writes
`report.json` (each task's two scores and their difference) and fails when a difference passes `--tolerance`
(1 point). docs/serving-clients.md has the command and its last result on the example model.

Needs the `lm-eval` package (a dev dependency). Imports: stdlib (the rest lazily).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

MODEL = "lm-eval-check"
MC_TASK, GEN_TASK = "ew_arith_mc", "ew_arith_gen"
WORDS = ("plus", "minus", "times")


def _question(rnd: random.Random) -> tuple[str, int]:
    a, b, op = rnd.randrange(2, 20), rnd.randrange(2, 10), rnd.choice(WORDS)
    value = a + b if op == "plus" else a - b if op == "minus" else a * b
    return f"What is {a} {op} {b}?", value


def write_tasks(folder: Path, *, mc_items: int = 120, gen_items: int = 40, seed: int = 0) -> list[str]:
    """The two tasks' JSONL data and YAML configs in `folder` (lm-eval's `--include_path`); their names."""
    folder.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    mc = []
    for _ in range(mc_items):
        question, value = _question(rnd)
        wrong = rnd.sample([v for v in range(value - 6, value + 7) if v != value], 3)
        choices = [str(v) for v in [value, *wrong]]
        rnd.shuffle(choices)
        mc.append({"question": question, "choices": choices, "answer": choices.index(str(value))})
    gen = []
    for _ in range(gen_items):
        question, value = _question(rnd)
        gen.append({"question": question, "answer": str(value)})
    for name, rows in ((MC_TASK, mc), (GEN_TASK, gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
              "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n")
    (folder / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n" + common.replace("{path}", str(folder / f"{MC_TASK}.jsonl"))
        + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        + "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n" + common.replace("{path}", str(folder / f"{GEN_TASK}.jsonl"))
        + "output_type: generate_until\ndoc_to_target: \" {{answer}}\"\n"
        + "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        + "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        + "    ignore_case: true\n    ignore_punctuation: true\n    regexes_to_ignore: [\"^\\\\s+\", \"\\\\s+$\"]\n")
    return [MC_TASK, GEN_TASK]


@contextlib.contextmanager
def served(checkpoint: Path, work: Path) -> Iterator[str]:
    """The checkpoint as a paged float32 engine behind Triton and the OpenAI front: yields the front's base URL."""
    from serving.engine import EngineLimits, build_engine, convert_checkpoint
    from serving.engine.paged_cache import PagedKVConfig
    from serving.triton.operations import apply_router_weights, serve_versions
    from serving.triton.process import free_port, start_triton
    from serving.triton.repository import init_repository, stage_engine_version

    ckpt = convert_checkpoint(checkpoint, work / "ckpt", dtype="float32")
    engine = build_engine(ckpt, work / "engine", limits=EngineLimits(dtype="float32", max_batch_size=8,
                                                                      max_input_len=448, max_seq_len=512),
                          paged=PagedKVConfig(block_size=16, num_blocks=288, max_num_tokens=512)).path
    repo = init_repository(work / "repository")
    triton = start_triton(repo, log_path=work / "triton.log")
    front = None
    try:
        version = stage_engine_version(repo, MODEL, engine, device_kind="cpu", parameters={"decoupled": "true"},
                                       link=True)
        serve_versions(triton.control(), repo, MODEL, [version], timeout_s=600)
        apply_router_weights(triton.control(), repo, MODEL, {version: 100})
        port = free_port()
        with open(work / "front.log", "wb") as log:
            code = (f"from serving.openai.server import run_server; run_server(grpc_url={triton.grpc_url!r}, "
                    f"models=[{MODEL!r}], port={port}, timeout_s=600)")
            front = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, front, work / "front.log")
        yield base
    finally:
        if front is not None:
            os.killpg(front.pid, signal.SIGTERM)
            front.wait(timeout=30)
        triton.stop()


def _wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the front exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the front did not become healthy within {timeout_s:g} s: {log.read_text()[-2000:]}")


def run_lm_eval(model: str, model_args: str, tasks: list[str], include: Path, out: Path, *,
                limit: int | None = None, batch_size: int = 1) -> dict[str, float]:
    """`lm_eval` (its command line) -> {task: its metric}; each item's responses are logged under `out`."""
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
               "--tasks", ",".join(tasks), "--include_path", str(include), "--output_path", str(out),
               "--batch_size", str(batch_size), "--device", "cpu", "--log_samples"]
    if limit is not None:
        command += ["--limit", str(limit)]
    subprocess.run(command, check=True, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    found = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    if not found:
        raise RuntimeError(f"lm_eval wrote no results under {out}")
    results = json.loads(Path(found[-1]).read_text())["results"]
    return {task: next(v for k, v in results[task].items() if k.split(",")[0] in ("acc", "exact_match"))
            for task in tasks}


def _adds_bos(checkpoint: Path) -> bool:
    """Whether the checkpoint's tokenizer adds special tokens (a BOS) by default: lm-eval's `hf` backend then
    prompts with them, its API backends only with `add_bos_token`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return tokenizer("x").input_ids != tokenizer("x", add_special_tokens=False).input_ids


def item_responses(out: Path, task: str) -> dict[int, list]:
    """{doc id: lm-eval's responses} of `task`'s logged items under `out` (likelihood: [log-likelihood,
    is_greedy] per choice; generation: the text)."""
    found = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
    if not found:
        raise RuntimeError(f"lm_eval logged no items of {task} under {out}")
    rows = [json.loads(line) for line in Path(found[-1]).read_text().splitlines() if line.strip()]
    return {row["doc_id"]: [r[0] for r in row["resps"]] for row in rows}


def _item_differences(served: dict[int, list], hf: dict[int, list]) -> dict[str, float]:
    """The largest log-likelihood difference over every choice of every item, and the items whose generations
    differ. A generation that ends inside a UTF-8 character ends there served (the engine sends no incomplete
    character, as vLLM) and with U+FFFD from lm-eval's `hf` backend: such a tail is not a difference."""
    logliks = [abs(float(a[0]) - float(b[0])) for d in hf for a, b in zip(served[d], hf[d]) if isinstance(a, list)]

    def text(responses: list) -> list[str]:
        return [str(r).rstrip("\ufffd") for r in responses]

    texts = [d for d in hf if served[d] and not isinstance(served[d][0], list) and text(served[d]) != text(hf[d])]
    return {"max_loglikelihood_difference": max(logliks, default=0.0), "differing_generations": len(texts)}


def check(checkpoint: Path, out: Path, *, limit: int | None = None, tolerance_points: float = 1.0,
          mc_items: int = 120, gen_items: int = 40) -> dict:
    """Both runs and the comparison (see the module doc); the report is also written to `out/report.json`."""
    out.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(out / "tasks", mc_items=mc_items, gen_items=gen_items)
    with served(checkpoint, out / "serve") as base:
        served_scores = run_lm_eval("local-completions", f"model={MODEL},base_url={base}/v1/completions,"
                                    f"tokenizer={checkpoint},tokenizer_backend=huggingface,tokenized_requests=True,"
                                    f"num_concurrent=4,max_retries=1,max_length=512,add_bos_token={_adds_bos(checkpoint)}",
                                    tasks, out / "tasks", out / "served", limit=limit)
    hf_scores = run_lm_eval("hf", f"pretrained={checkpoint},dtype=float32,max_length=512", tasks, out / "tasks",
                            out / "hf", limit=limit, batch_size=8)
    rows = {task: {"served": served_scores[task], "hf": hf_scores[task],
                   "difference_points": round(100 * (served_scores[task] - hf_scores[task]), 3),
                   **_item_differences(item_responses(out / "served", task), item_responses(out / "hf", task))}
            for task in tasks}
    report = {"checkpoint": str(checkpoint), "limit": limit, "tolerance_points": tolerance_points, "tasks": rows,
              "passed": all(abs(r["difference_points"]) <= tolerance_points for r in rows.values())}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a Hugging Face checkpoint folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=None, help="items per task at most")
    parser.add_argument("--tolerance", type=float, default=1.0, help="points the two scores may differ by")
    args = parser.parse_args(argv)
    report = check(args.checkpoint, args.out, limit=args.limit, tolerance_points=args.tolerance)
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
