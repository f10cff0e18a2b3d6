"""The text path in the gates: the engine folder's tokenizer is the checkpoint's, and tokenizes the same.

Triton serves text with the tokenizer files in the engine folder (``serving/triton/models/llm.py``:
``tokenizers.Tokenizer.from_file(<engine>/tokenizer.json).encode(text)``), while the reference
tokenizes with the checkpoint's. Two checks, each of which refuses an engine folder with another
tokenizer of the same vocabulary size:
- every tokenizer file (``serving.engine.convert.TOKENIZER_FILES``) present on either side has the same
  sha256 on both;
- texts encoded the way the server does equal Hugging Face's ``AutoTokenizer`` ids, and decode the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from serving.engine.convert import TOKENIZER_FILES
from tasks.hashing import file_sha256


@dataclass(frozen=True)
class TokenizerCheck:
    """What the text path checks found; `failures` is empty when the engine tokenizes like the checkpoint."""

    files: dict[str, tuple[str | None, str | None]]  # name -> (checkpoint sha256, engine sha256)
    texts_checked: int
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def tokenizer_hashes(folder: Path) -> dict[str, str]:
    """sha256 of each tokenizer file present in `folder`."""
    return {name: file_sha256(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()}


def compare_tokenizer_files(checkpoint: Path, engine_dir: Path) -> tuple[dict[str, tuple[str | None, str | None]],
                                                                        list[str]]:
    """Per file (checkpoint sha256, engine sha256), and one failure line per file that differs."""
    ours, theirs = tokenizer_hashes(checkpoint), tokenizer_hashes(engine_dir)
    files = {name: (ours.get(name), theirs.get(name)) for name in sorted({*ours, *theirs})}
    failures = []
    for name, (want, got) in files.items():
        if want != got:
            failures.append(f"tokenizer file {name}: engine folder {_short(got)} != checkpoint {_short(want)} "
                            f"(sha256; engine {engine_dir}, checkpoint {checkpoint})")
    if "tokenizer.json" not in theirs:
        failures.append(f"the engine folder {engine_dir} has no tokenizer.json: Triton cannot serve text requests")
    return files, failures


def server_encode(engine_dir: Path):
    """An `encode(text) -> ids` and `decode(ids) -> text` pair that tokenize as the Triton llm model does."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(engine_dir) / "tokenizer.json"))
    return (lambda text: list(tokenizer.encode(text).ids),
            lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))


def check_text_path(checkpoint: Path, engine_dir: Path, texts: Sequence[str], reference_tokenizer) -> TokenizerCheck:
    """Hashes of the tokenizer files, then each text through the server's tokenization against HF's."""
    files, failures = compare_tokenizer_files(checkpoint, engine_dir)
    if not (Path(engine_dir) / "tokenizer.json").is_file():
        return TokenizerCheck(files, 0, failures)
    encode, decode = server_encode(engine_dir)
    differing: list[str] = []
    for text in texts:
        want = list(reference_tokenizer(text).input_ids)
        got = encode(text)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            differing.append(f"text {text[:40]!r}: the engine folder's tokenizer gives {got[at:at + 3]} at token "
                             f"{at}, the checkpoint's {want[at:at + 3]}")
            continue
        want_text = reference_tokenizer.decode(want, skip_special_tokens=True)
        if decode(got) != want_text:
            differing.append(f"text {text[:40]!r}: the engine folder's tokenizer decodes to {decode(got)[:40]!r}, "
                             f"the checkpoint's to {want_text[:40]!r}")
    if differing:
        more = f" (and {len(differing) - 2} more texts)" if len(differing) > 2 else ""
        failures.append(f"{len(differing)} of {len(texts)} texts tokenize differently as Triton serves them: "
                        + "; ".join(differing[:2]) + more)
    return TokenizerCheck(files, len(texts), failures)


def _short(sha: str | None) -> str:
    return "missing" if sha is None else sha[:12]
