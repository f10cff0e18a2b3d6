"""What one token mask costs with each grammar engine, at two vocabulary sizes, on this machine's CPU.

Question it answers: xgrammar or llguidance for structured outputs? A constrained request needs a fresh
mask over the whole vocabulary before every sampled token; that work is on the host, per request, per step.
For each engine and tokenizer: compile a JSON schema (timed once, cold), then walk a valid document of that
schema token by token, timing the mask for every position (after the first `--skip` tokens, so the figure
is "per step, a few tokens in"), and consuming each token.

    .venv/bin/python bench/vocab_tokenizer.py --vocab 128256 --out /tmp/bpe-128256
    .venv/bin/python bench/grammar_mask.py --tokenizer smollm2=$(.venv/bin/enginewright example-model | tail -1 \
        | awk '{print $NF}') --tokenizer bpe128k=/tmp/bpe-128256 --json docs/bench/grammar-mask-cpu.json

Needs both engines installed (`uv pip install xgrammar llguidance`; only the chosen one is a dependency).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]+$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.org", "role": "admin",
            "tags": ["mathematics", "engines", "poetry of science"],
            "address": {"city": "London", "zip": "W1J 5NE"}}


def hf_tokenizer(path: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    folder = path if path.is_dir() else path.parent
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    if tok.eos_token is None:  # the trained BPE names its end token like Llama-3
        tok.eos_token = "<|end_of_text|>"
    return tok


def walk(fill: Callable[[], None], consume: Callable[[int], None], tokens: list[int], skip: int) -> list[float]:
    """Seconds per mask at each position from `skip` on; every token is consumed after its mask."""
    times = []
    for i, token in enumerate(tokens):
        started = time.perf_counter()
        fill()
        if i >= skip:
            times.append(time.perf_counter() - started)
        consume(token)
    return times


def bench_llguidance(tok: Any, text: str, skip: int, repeat: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tok)
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    compile_s = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, len(tok))
    tokens = tok.encode(text, add_special_tokens=False)
    times = []
    for _ in range(repeat):
        matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)

        def consume(token: int, matcher: Any = matcher) -> None:
            if not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")

        def fill(matcher: Any = matcher) -> None:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)

        times += walk(fill, consume, tokens, skip)
    return summary(times, tokenizer_s, compile_s)


def bench_xgrammar(tok: Any, text: str, skip: int, repeat: int) -> dict[str, float]:
    import warnings

    import xgrammar as xgr

    warnings.filterwarnings("ignore", message=".*stop_token_ids.*")

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - started
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    tokens = tok.encode(text, add_special_tokens=False)
    times = []
    for _ in range(repeat):
        matcher = xgr.GrammarMatcher(compiled)

        def consume(token: int, matcher: Any = matcher) -> None:
            if not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token}")

        def fill(matcher: Any = matcher) -> None:
            matcher.fill_next_token_bitmask(bitmask, 0)

        times += walk(fill, consume, tokens, skip)
    return summary(times, tokenizer_s, compile_s)


def summary(times: list[float], tokenizer_s: float, compile_s: float) -> dict[str, float]:
    ordered = sorted(times)
    return {"masks": len(times), "mean_us": 1e6 * statistics.fmean(times), "p50_us": 1e6 * ordered[len(ordered) // 2],
            "p90_us": 1e6 * ordered[int(0.9 * (len(ordered) - 1))], "max_us": 1e6 * ordered[-1],
            "tokenizer_s": tokenizer_s, "compile_s": compile_s}


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", action="append", required=True, metavar="NAME=PATH",
                        help="a tokenizer.json (or its folder) to measure, repeatable")
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES), help="default: both")
    parser.add_argument("--skip", type=int, default=3, help="tokens consumed before masks are timed")
    parser.add_argument("--repeat", type=int, default=5, help="walks of the document, each with a fresh matcher")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    text = json.dumps(DOCUMENT)
    rows = []
    for spec in args.tokenizer:
        name, _, path = spec.partition("=")
        tok = hf_tokenizer(Path(path))
        for engine in args.engine or sorted(ENGINES):
            row = {"engine": engine, "tokenizer": name, "vocab": len(tok), **ENGINES[engine](tok, text, args.skip, args.repeat)}
            rows.append(row)
            print(f"{engine:>10} {name:>10} vocab {row['vocab']:>6}: mask mean {row['mean_us']:8.1f} us  p50 "
                  f"{row['p50_us']:8.1f}  p90 {row['p90_us']:8.1f}  max {row['max_us']:8.1f}  ({row['masks']} "
                  f"masks)  tokenizer {row['tokenizer_s']:.2f} s  schema compile {row['compile_s']*1e3:.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"schema": SCHEMA, "document": DOCUMENT, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
