"""A byte-level BPE tokenizer of a chosen vocabulary size, trained offline on local text (no hub).

Question it answers: what does a grammar engine's per-token work cost at a vocabulary the example model
does not have (Llama-3's 128,256)? The grammar engines' mask cost grows with the vocabulary and with how
tokens share prefixes, so the tokenizer is a real BPE (merges learnt from text), not padded ids.

    .venv/bin/python bench/vocab_tokenizer.py --vocab 128256 --out /tmp/bpe-128256
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path


def corpus(max_bytes: int) -> Iterator[str]:
    """Python's own standard library sources: local, varied (code, docstrings, English prose)."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def train(vocab: int, out: Path, max_bytes: int = 60_000_000) -> Path:
    """Train, save `tokenizer.json` under `out`, return its path; the vocabulary is exactly `vocab`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=1, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(max_bytes), trainer=trainer)
    if tok.get_vocab_size() < vocab:  # the corpus ran out of merges: fill with reserved specials, as Llama-3 does
        tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(vocab - tok.get_vocab_size())])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    path = train(args.vocab, args.out)
    from tokenizers import Tokenizer

    print(f"{path}: vocabulary {Tokenizer.from_file(str(path)).get_vocab_size()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
