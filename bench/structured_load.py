"""Does a mix of structured and log-prob requests slow the served engine? (issue 49's device check)

Llama-3.1-8B's shape, FP8 weights (random: speed does not depend on the values, made on the GPU by
`bench.fp8_engine`, no bf16 checkpoint), the paged engine in Triton behind the OpenAI front. `--clients` closed-loop
clients (256) send /v1/completions requests for `--seconds` a round; after a warm-up round of the mixed kinds (CUDA
graphs, the grammar engine's view of the tokenizer, the schema's compile), three timed rounds on the same server:

- plain: every request plain (greedy, `ignore_eos`, `--max-tokens` tokens);
- mixed: 10% of the clients send a JSON schema (`response_format` json_schema, bounded: the grammar ends the
  document well within `--schema-max-tokens`), 10% ask `logprobs: 5`, the rest as plain;
- plain again: the mix is set against the mean of the two plain rounds around it (`plain_spread`: how far the plain
  figure moved by itself between them).

Pass: mixed output tok/s >= 90% of plain, no request failed, and every schema request's text parses as JSON with
the schema's keys (finish_reason "stop": the grammar completed it). The engine's tokenizer is a byte-level BPE of
the shape's vocabulary (128,256) trained on local text (bench/vocab_tokenizer.py, its begin/end tokens at the
shape's ids), so the grammar engine's masks cost what Llama-3's would; `--tokenizer` takes one trained before
(`tokenizer.json`, or `.json.xz`), since training it takes ~1 min of a CPU.

    .venv/bin/python bench/structured_load.py --work /tmp/structured-load --json docs/bench/structured-load-h100.json

On a device in one call: bench/device_structured_load.sh. The harness on a CPU (tiny shape, a few clients):

    .venv/bin/python bench/structured_load.py --shape tiny --device cpu --clients 10 --seconds 8 --warmup-seconds 4 \
        --prompt-words 8 --max-tokens 16 --max-seq-len 512 --work /tmp/sl-cpu --json /tmp/sl-cpu.json

The JSON is written after each phase (a run cut short keeps what it measured) with `timeline` (seconds of each
phase); `--steps-log` appends one line a phase to a file too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import lzma
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "editor", "viewer"]}, "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "role", "active", "tags"], "additionalProperties": False}
WORDS = ["the", "river", "carried", "light", "across", "a", "quiet", "valley", "where", "old", "stones", "kept", "the", "memory", "of", "rain", "and", "every", "morning", "the", "farmers", "walked", "to", "fields", "that", "their", "parents", "had", "planted", "long", "ago"]


def tokenizer_folder(shape: str, work: Path, *, tokenizer: Path | None, max_seq_len: int) -> Path:
    """`work`/tokenizer: `tokenizer.json` (`tokenizer`, unpacked when .xz; else trained to the shape's vocabulary),
    `tokenizer_config.json` and `generation_config.json` (the shape's end token: what stops a finished grammar)."""
    from tokenizers import Tokenizer

    from bench.models import SHAPES

    folder = work / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "tokenizer.json"
    config = SHAPES[shape]
    bos, eos, vocab = config["bos_token_id"], config["eos_token_id"], config["vocab_size"]
    if tokenizer is not None:
        if not tokenizer.is_file():
            raise FileNotFoundError(f"--tokenizer {tokenizer}: no such file")
        target.write_bytes(lzma.decompress(tokenizer.read_bytes()) if tokenizer.suffix == ".xz"
                           else tokenizer.read_bytes())
    elif not target.is_file():
        from bench.vocab_tokenizer import train

        train(vocab, folder, first_special=bos)
    loaded = Tokenizer.from_file(str(target))
    found = (loaded.get_vocab_size(), loaded.token_to_id("<|begin_of_text|>"), loaded.token_to_id("<|end_of_text|>"))
    if found != (vocab, bos, eos):
        raise ValueError(f"tokenizer {tokenizer or target}: vocabulary {found[0]}, <|begin_of_text|> {found[1]}, "
                         f"<|end_of_text|> {found[2]}; shape {shape} needs {vocab}, {bos}, {eos} (train it with "
                         f"bench/vocab_tokenizer.py --vocab {vocab} --first-special {bos})")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "model_max_length": max_seq_len}))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    return folder


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body(kind: str, model: str, rng: random.Random, *, prompt_words: int, max_tokens: int,
         schema_max_tokens: int) -> dict[str, Any]:
    base = {"model": model, "prompt": prompt(rng, prompt_words), "max_tokens": max_tokens, "temperature": 0}
    if kind == "schema":
        return {**base, "max_tokens": schema_max_tokens, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}
    if kind == "logprobs":
        return {**base, "logprobs": 5, "ignore_eos": True}
    return {**base, "ignore_eos": True}


def schema_failure(text: str, reason: str) -> str | None:
    """Why a schema request's answer is not a complete document of the schema's keys (None: it is)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return f"{reason}: not JSON ({exc}): {text[:120]}"
    if reason != "stop" or not isinstance(doc, dict) or set(doc) != set(SCHEMA["properties"]):
        return f"{reason}: {text[:120]}"
    return None


async def closed_loop(url: str, model: str, kinds: list[str], *, seconds: float, prompt_words: int,
                      max_tokens: int, schema_max_tokens: int) -> dict[str, Any]:
    """Every client sends its kind of request, one after the other, until `seconds` pass; the figure counts every
    answer, those still running at the deadline too (each round ends the same way)."""
    import httpx

    tokens = {k: 0 for k in set(kinds)}
    requests = {k: 0 for k in set(kinds)}
    overloads = {k: 0 for k in set(kinds)}
    errors: list[str] = []
    schema_answers: list[tuple[str, str]] = []
    logprob_short = 0  # logprobs answers without a row of alternatives for each token
    deadline = time.monotonic() + seconds

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal logprob_short
        rng = random.Random(i)
        kind = kinds[i]
        while time.monotonic() < deadline:
            try:
                reply = await http.post(f"{url}/v1/completions", json=body(
                    kind, model, rng, prompt_words=prompt_words, max_tokens=max_tokens,
                    schema_max_tokens=schema_max_tokens))
            except httpx.TransportError as exc:  # a failed request, counted like a 5xx: the round's figures stand
                errors.append(f"{kind} {type(exc).__name__} {exc}")
                return
            if reply.status_code == 429:  # the engine's queue was full: a client retries, as OpenAI's do
                overloads[kind] += 1
                await asyncio.sleep(0.05)
                continue
            if reply.status_code != 200:
                errors.append(f"{kind} {reply.status_code} {reply.text[:200]}")
                return
            data = reply.json()
            choice = data["choices"][0]
            tokens[kind] += data["usage"]["completion_tokens"]
            requests[kind] += 1
            if kind == "schema":
                schema_answers.append((choice["text"], choice["finish_reason"]))
            elif kind == "logprobs":
                rows = len((choice.get("logprobs") or {}).get("top_logprobs") or [])
                logprob_short += rows != data["usage"]["completion_tokens"]

    started = time.monotonic()
    limits = httpx.Limits(max_connections=len(kinds) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(len(kinds))))
    elapsed = time.monotonic() - started
    failures = [f for f in (schema_failure(text, reason) for text, reason in schema_answers) if f is not None]
    schema_tokens = tokens.get("schema", 0)
    return {"seconds": elapsed, "output_tokens": sum(tokens.values()), "tokens_by_kind": tokens,
            "requests_by_kind": requests, "overloaded_by_kind": overloads,
            "output_tok_s": sum(tokens.values()) / elapsed, "errors": errors[:5],
            "error_count": len(errors), "schema_requests": len(schema_answers),
            "schema_tokens_per_answer": schema_tokens / len(schema_answers) if schema_answers else None,
            "schema_unparsed": failures[:5], "schema_unparsed_count": len(failures),
            "logprob_answers_short": logprob_short}


class Timeline:
    """Seconds of each phase since the start, printed, kept for the report and appended to `steps_log`."""

    def __init__(self, steps_log: Path | None) -> None:
        self.started = time.monotonic()
        self.phases: dict[str, float] = {}
        self.steps_log = steps_log
        self._last = self.started

    def done(self, phase: str, detail: str = "") -> None:
        now = time.monotonic()
        self.phases[phase] = round(now - self._last, 1)
        self._last = now
        line = f"[structured_load {now - self.started:.0f} s] {phase} took {self.phases[phase]} s {detail}".rstrip()
        print(line, flush=True)
        if self.steps_log is not None:
            with open(self.steps_log, "a") as log:
                log.write(line + "\n")


def kinds_of(clients: int) -> tuple[list[str], list[str]]:
    """(plain, mixed): one kind a client; a tenth of the clients (at least one) each for schemas and logprobs."""
    tenth = max(1, clients // 10)
    if clients < 3:
        raise ValueError(f"--clients {clients}: at least 3 (a schema, a logprobs and a plain client)")
    return ["plain"] * clients, ["schema"] * tenth + ["logprobs"] * tenth + ["plain"] * (clients - 2 * tenth)


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Mixed against plain: the mean of the plain rounds before and after it (a drift of the device between rounds
    cancels), `plain_spread` their difference over that mean (how far the figure moves by itself)."""
    plains = [report[name] for name in ("plain", "plain_again") if name in report]
    mixed = report["mixed"]
    plain_tok_s = sum(r["output_tok_s"] for r in plains) / len(plains)
    ratio = mixed["output_tok_s"] / plain_tok_s
    clean = not any(r["error_count"] for r in [*plains, mixed]) and not mixed["schema_unparsed_count"]
    spread = (max(r["output_tok_s"] for r in plains) - min(r["output_tok_s"] for r in plains)) / plain_tok_s
    return {"plain_tok_s": plain_tok_s, "plain_rounds": len(plains), "plain_spread": spread, "ratio": ratio,
            "passed": ratio >= 0.9 and clean and mixed["schema_requests"] > 0 and not mixed["logprob_answers_short"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shape", default="llama-3.1-8b", help="bench.models.SHAPES (tiny: the CPU check)")
    parser.add_argument("--device", default="auto", help="where the engine's random FP8 weights are made")
    parser.add_argument("--engine", type=Path, help="an engine folder built before (bench.fp8_engine): no build here")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (or .json.xz) of the shape's vocabulary")
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=45.0, help="each timed round")
    parser.add_argument("--warmup-seconds", type=float, default=10.0)
    parser.add_argument("--prompt-words", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--schema-max-tokens", type=int, default=256, help="room for the document (it ends sooner)")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--steps-log", type=Path)
    parser.add_argument("--build-only", action="store_true", help="make the tokenizer and the engine, then stop")
    args = parser.parse_args(argv)
    plain, mixed = kinds_of(args.clients)
    # a `timeout` ends the run with SIGTERM: leave through the context managers (Triton and the front stopped)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    timeline = Timeline(args.steps_log)
    report: dict[str, Any] = {"shape": args.shape, "quantization": "fp8", "clients": args.clients,
                              "seconds": args.seconds, "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
                              "schema_max_tokens": args.schema_max_tokens, "timeline": timeline.phases}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(report, indent=1) + "\n")

    engine = args.engine
    if engine is None:
        from bench.fp8_engine import build_fp8_engine
        from serving.engine.kv_cache import KVCacheConfig
        from serving.engine.runner import resolve_device

        folder = tokenizer_folder(args.shape, args.work, tokenizer=args.tokenizer, max_seq_len=args.max_seq_len)
        timeline.done("tokenizer")
        engine = build_fp8_engine(args.shape, args.work, device=resolve_device(args.device),
                                  max_batch_size=args.clients, max_seq_len=args.max_seq_len,
                                  kv_cache=KVCacheConfig(max_num_tokens=8192), tokenizer_dir=folder)
        timeline.done("build", str(engine))
    report["engine"] = str(engine)
    if args.build_only:
        print(f"engine: {engine}", flush=True)
        return 0

    from tasks.lm_eval_gate import served_engines

    load = {"prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
            "schema_max_tokens": args.schema_max_tokens}
    # every client's request may wait for admission: none is refused as an overload
    with served_engines({"bench": engine}, args.work / "serving", load_timeout_s=1200.0,
                        max_queue_size=args.clients) as served:
        timeline.done("serve", "(Triton, the llm model's load and warm-up, the front)")
        report["warmup"] = asyncio.run(closed_loop(served.base_url, "bench", mixed, seconds=args.warmup_seconds, **load))
        timeline.done("warmup", f"{report['warmup']['output_tok_s']:.0f} tok/s")
        save()
        for name, kinds in (("plain", plain), ("mixed", mixed), ("plain_again", plain)):
            report[name] = asyncio.run(closed_loop(served.base_url, "bench", kinds, seconds=args.seconds, **load))
            timeline.done(name, f"{report[name]['output_tok_s']:.0f} tok/s")
            if "mixed" in report:  # a run cut short after the mix keeps a verdict on the plain round before it
                report.update(verdict(report))
            save()
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
