"""A byte-level BPE tokenizer of a chosen vocabulary size, trained offline on local text (no hub).

Question it answers: what does a grammar engine's per-token work cost at a vocabulary the example model
does not have (Llama-3's 128,256)? The grammar engines' mask cost grows with the vocabulary and with how
tokens share prefixes, so the tokenizer is a real BPE (merges learnt from text), not padded ids.

    .venv/bin/python bench/vocab_tokenizer.py --vocab 128256 --out /tmp/bpe-128256

`--first-special 128000` puts `<|begin_of_text|>` and `<|end_of_text|>` at Llama-3's ids (128000, 128001: after
the merges, as the 8B shape's bos/eos ids say) instead of 0 and 1, so an engine of that shape stops on its own
end token.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def corpus(max_bytes: int) -> Iterator[str]:
    """Python's own standard library sources: local, varied (code, docstrings, English prose)."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def train(vocab: int, out: Path, max_bytes: int = 60_000_000, first_special: int = 0) -> Path:
    """Train, save `tokenizer.json` under `out`, return its path; the vocabulary is exactly `vocab`, the begin and
    end tokens at ids `first_special` and `first_special + 1` (0: before the byte alphabet; else after the merges,
    which then fill the ids below it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 0 <= first_special <= vocab - 2:
        raise ValueError(f"first_special={first_special} must leave room for the two special tokens in vocab={vocab}")
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    learnt = vocab if first_special == 0 else first_special
    trainer = trainers.BpeTrainer(vocab_size=learnt, min_frequency=1, special_tokens=special if first_special == 0 else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(max_bytes), trainer=trainer)
    if first_special:
        reserve(tok, first_special)
        tok.add_special_tokens(special)
    reserve(tok, vocab)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def reserve(tok: Any, size: int) -> None:
    """Fill the vocabulary up to `size` with reserved special tokens, as Llama-3 does (the corpus ran out of merges,
    or the ids after the named specials)."""
    start = tok.get_vocab_size()
    tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(start, size)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--first-special", type=int, default=0, help="id of <|begin_of_text|> (<|end_of_text|> next)")
    args = parser.parse_args(argv)
    path = train(args.vocab, args.out, first_special=args.first_special)
    from tokenizers import Tokenizer

    print(f"{path}: vocabulary {Tokenizer.from_file(str(path)).get_vocab_size()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
