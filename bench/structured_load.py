"""Does a mix of structured and log-prob requests slow the served engine? (issue 49's device check)

Llama-3.1-8B's shape, FP8 weights (random: speed does not depend on the values), the paged engine in Triton
behind the OpenAI front. `--clients` closed-loop clients (256) send /v1/completions requests for
`--seconds`; two rounds on the same server:

- plain: every request plain (greedy, `ignore_eos`, `--max-tokens` tokens);
- mixed: 10% of the clients send a JSON schema (`response_format` json_schema, bounded: the grammar ends the
  document within the token budget), 10% ask `logprobs: 5`, the rest as plain.

Pass: mixed output tok/s >= 90% of plain, and every schema request's text parses as JSON with the schema's keys
(finish_reason "stop": the grammar completed it). The engine's tokenizer is a byte-level BPE of 128,256 tokens
trained on local text (bench/vocab_tokenizer.py), so the grammar engine's masks cost what Llama-3's would.

    .venv/bin/python bench/structured_load.py --work /tmp/structured-load --json docs/bench/structured-load-h100.json

Takes ~15 min on one H100 (the engine's build most of it, once: the work folder is reused); needs a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
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


def engine_with_tokenizer(work: Path, *, max_batch_size: int, max_seq_len: int) -> Path:
    """The FP8 paged engine of the 8B shape (built once) with the trained 128,256-token tokenizer in its folder."""
    from bench.served import build_random_engine
    from bench.vocab_tokenizer import train
    from serving.engine.kv_cache import KVCacheConfig

    engine = build_random_engine("llama-3.1-8b", work, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                 quantization="fp8", paged=KVCacheConfig(max_num_tokens=8192))
    if not (engine / "tokenizer.json").is_file():
        tokenizer = work / "tokenizer" / "tokenizer.json"
        if not tokenizer.is_file():
            train(128256, tokenizer.parent)
        shutil.copy(tokenizer, engine / "tokenizer.json")
        (engine / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "model_max_length": max_seq_len}))
    return engine


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body(kind: str, model: str, rng: random.Random, *, prompt_words: int, max_tokens: int) -> dict[str, Any]:
    base = {"model": model, "prompt": prompt(rng, prompt_words), "max_tokens": max_tokens, "temperature": 0}
    if kind == "schema":
        return {**base, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}
    if kind == "logprobs":
        return {**base, "logprobs": 5, "ignore_eos": True}
    return {**base, "ignore_eos": True}


async def closed_loop(url: str, model: str, kinds: list[str], *, seconds: float, prompt_words: int,
                      max_tokens: int) -> dict[str, Any]:
    """Every client sends its kind of request, one after the other, until `seconds` pass."""
    import httpx

    tokens = {k: 0 for k in set(kinds)}
    errors: list[str] = []
    schema_texts: list[tuple[str, str]] = []
    deadline = time.monotonic() + seconds

    async def client(i: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(i)
        while time.monotonic() < deadline:
            reply = await http.post(f"{url}/v1/completions", json=body(kinds[i], model, rng, prompt_words=prompt_words,
                                                                       max_tokens=max_tokens))
            if reply.status_code != 200:
                errors.append(f"{reply.status_code} {reply.text[:200]}")
                return
            data = reply.json()
            tokens[kinds[i]] += data["usage"]["completion_tokens"]
            if kinds[i] == "schema":
                schema_texts.append((data["choices"][0]["text"], data["choices"][0]["finish_reason"]))

    started = time.monotonic()
    limits = httpx.Limits(max_connections=len(kinds) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(len(kinds))))
    elapsed = time.monotonic() - started
    unparsed = []
    for text, reason in schema_texts:
        try:
            doc = json.loads(text)
            ok = reason == "stop" and set(doc) == set(SCHEMA["properties"])
        except ValueError:
            ok = False
        if not ok:
            unparsed.append(f"{reason}: {text[:120]}")
    return {"seconds": elapsed, "output_tokens": sum(tokens.values()), "tokens_by_kind": tokens,
            "output_tok_s": sum(tokens.values()) / elapsed, "errors": errors[:5], "error_count": len(errors),
            "schema_requests": len(schema_texts), "schema_unparsed": unparsed[:5],
            "schema_unparsed_count": len(unparsed)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--prompt-words", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from tasks.lm_eval_gate import served_engines

    engine = engine_with_tokenizer(args.work, max_batch_size=args.clients, max_seq_len=1024)
    tenth = max(1, args.clients // 10)
    mixed = ["schema"] * tenth + ["logprobs"] * tenth + ["plain"] * (args.clients - 2 * tenth)
    plain = ["plain"] * args.clients
    report: dict[str, Any] = {"shape": "llama-3.1-8b", "quantization": "fp8", "clients": args.clients}
    with served_engines({"bench": engine}, args.work / "serving", load_timeout_s=1200.0) as served:
        load = {"prompt_words": args.prompt_words, "max_tokens": args.max_tokens}
        asyncio.run(closed_loop(served.base_url, "bench", plain, seconds=10, **load))  # warm-up (graphs, masks)
        report["plain"] = asyncio.run(closed_loop(served.base_url, "bench", plain, seconds=args.seconds, **load))
        report["mixed"] = asyncio.run(closed_loop(served.base_url, "bench", mixed, seconds=args.seconds, **load))
    ratio = report["mixed"]["output_tok_s"] / report["plain"]["output_tok_s"]
    mixed_ok = not report["mixed"]["error_count"] and not report["mixed"]["schema_unparsed_count"]
    report.update(ratio=ratio, passed=ratio >= 0.9 and mixed_ok and report["mixed"]["schema_requests"] > 0)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
