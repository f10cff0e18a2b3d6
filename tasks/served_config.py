"""Drift against production: the served configuration of the candidate's engine folder against production's.

What the served engine does with text besides the weights: the chat template, the ids that stop a
generation (picked exactly as Triton's `llm` model picks them: `serving.triton.models.text.read_engine_text`
then `stop_ids_for`, so a checkpoint without generation_config.json is seen stopping at nothing, as it will
be served), the tokenizer (a hash of its vocabulary and merges, and its size), the special tokens, and the
generation defaults of generation_config.json. The quality gates compare the candidate with its own
checkpoint, which carries the same change; only production's engine folder shows it.

Every difference refuses the release unless the spec's `served.accept` names that part with a description
of why (an intended change); a part production had and the candidate lost (no chat template, no stop ids) is
named as lost. Without a production version the candidate is still refused when it would stop at no id
while its checkpoint's config.json names an EOS (what HF, and so the quality gates before, would stop at).
The accepted differences are shown on the version page ("served configuration vs production").
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from tasks.gate_specs import SERVED_PARTS, ServedSpec

IGNORED_GENERATION_KEYS = ("eos_token_id", "transformers_version", "_from_model_config")


@dataclass(frozen=True)
class ServedConfig:
    """One engine folder's served configuration, each part as it is compared."""

    chat_template: str | None
    chat_template_source: str
    stop_ids: tuple[int, ...]
    tokenizer: str  # "<vocab size> tokens, sha256 <16 hex>" of tokenizer.json's model (vocabulary and merges)
    special_tokens: dict[str, str]  # name -> text, and "ids" -> the special ids
    generation_defaults: dict[str, object]

    def part(self, name: str) -> object:
        return {"chat_template": self.chat_template, "stop_ids": list(self.stop_ids), "tokenizer": self.tokenizer,
                "special_tokens": self.special_tokens, "generation_defaults": self.generation_defaults}[name]


@dataclass(frozen=True)
class PartDifference:
    part: str
    candidate: str  # short rendering of each side
    production: str
    lost: bool  # production had it, the candidate has none
    accepted: str | None  # the spec's description when `served.accept` names the part
    diff: str = ""  # the chat template's unified diff


@dataclass
class ServedDrift:
    production_version: str | None
    candidate: ServedConfig
    production: ServedConfig | None
    differences: list[PartDifference] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    skipped: str = ""  # why production was not compared

    @property
    def passed(self) -> bool:
        return not self.failures


def served_config(engine_dir: Path) -> ServedConfig:
    """What Triton's `llm` model serves from `engine_dir` besides the weights."""
    from serving.triton.models.text import GENERATION_CONFIG, TOKENIZER_JSON, read_engine_text, stop_ids_for

    engine_dir = Path(engine_dir)
    text = read_engine_text(engine_dir)
    tokenizer_json = engine_dir / TOKENIZER_JSON
    model = json.loads(tokenizer_json.read_text()).get("model", {}) if tokenizer_json.is_file() else {}
    digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()[:16]
    tokenizer = f"{len(model.get('vocab') or {})} tokens, sha256 {digest}" if model else "(no tokenizer.json)"
    generation_path = engine_dir / GENERATION_CONFIG
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    defaults = {k: v for k, v in sorted(generation.items()) if k not in IGNORED_GENERATION_KEYS}
    special = dict(text.special_tokens) | {"ids": ",".join(map(str, sorted(text.special_ids)))}
    return ServedConfig(text.chat_template, text.chat_template_source,
                        stop_ids_for((), text.eos_token_ids, ignore_eos=False), tokenizer, special, defaults)


def checkpoint_eos_ids(checkpoint: Path) -> list[int]:
    """config.json's eos_token_id: what Hugging Face stops at when there is no generation_config.json."""
    path = Path(checkpoint) / "config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def compare_served(engine_dir: Path, production_dir: Path | None, spec: ServedSpec, *, checkpoint: Path,
                   production_version: str | None = None, skipped: str = "") -> ServedDrift:
    """The candidate's served configuration against production's; refusals for every unaccepted difference."""
    candidate = served_config(engine_dir)
    production = served_config(production_dir) if production_dir is not None else None
    drift = ServedDrift(production_version, candidate, production, skipped=skipped)
    if not candidate.stop_ids and "stop_ids" not in spec.accept:
        eos = checkpoint_eos_ids(checkpoint)
        if eos:
            drift.failures.append(
                f"served configuration: the engine stops at no token id (no eos_token_id in generation_config.json; "
                f"Triton's llm model reads only that file) while the checkpoint's config.json names {eos}: served "
                "generations would run to max_tokens. Add generation_config.json, or accept it with "
                "served.accept.stop_ids")
    if production is None:
        return drift
    for part in SERVED_PARTS:
        new, old = candidate.part(part), production.part(part)
        if new == old:
            continue
        lost = not new and bool(old)
        accepted = spec.accept.get(part)
        diff = _template_diff(old, new) if part == "chat_template" else ""
        drift.differences.append(PartDifference(part, _short(new), _short(old), lost, accepted, diff))
        if accepted is None:
            what = "lost" if lost else "changed"
            drift.failures.append(
                f"served configuration: {part} {what} against production version {production_version}: production "
                f"{_short(old)}, candidate {_short(new)}; if intended, accept it with served.accept.{part}: "
                "'<why>'")
    return drift


def _short(value: object) -> str:
    if value is None or value == [] or value == {}:
        return "(none)"
    if isinstance(value, str) and len(value) > 40:
        return f"{len(value)} characters, sha256 {hashlib.sha256(value.encode()).hexdigest()[:12]}"
    return json.dumps(value, sort_keys=True) if not isinstance(value, str) else value


def _template_diff(old: object, new: object) -> str:
    before = (old or "").splitlines() if isinstance(old, str) or old is None else []
    after = (new or "").splitlines() if isinstance(new, str) or new is None else []
    lines = difflib.unified_diff(before, after, "production", "candidate", lineterm="", n=1)
    return "\n".join(list(lines)[:40])


def render_drift(drift: ServedDrift, *, heading: str = "##") -> list[str]:
    """Markdown lines: the served configuration against production, each difference and whether accepted."""
    title = f"{heading} Served configuration vs production"
    if drift.production is None:
        return [title, "", f"Not compared: {drift.skipped or 'no production version'}.",
                *(f"- {f}" for f in drift.failures), ""]
    lines = [title, "", f"Against production version {drift.production_version}: "
             + (f"{len(drift.differences)} part(s) differ." if drift.differences else "the same (chat template, stop "
                "ids, tokenizer, special tokens, generation defaults)."), ""]
    if drift.differences:
        lines += ["| part | production | candidate | verdict |", "| --- | --- | --- | --- |"]
        for d in drift.differences:
            verdict = f"accepted: {d.accepted}" if d.accepted else ("**LOST**" if d.lost else "**CHANGED**")
            lines.append(f"| {d.part} | {_cell(d.production)} | {_cell(d.candidate)} | {_cell(verdict)} |")
        lines.append("")
        for d in drift.differences:
            if d.diff:
                lines += [f"{d.part} diff:", "", "```diff", d.diff, "```", ""]
    lines += [f"- {f}" for f in drift.failures]
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
