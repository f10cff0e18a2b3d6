"""A request's grammar (the ``guided_decoding`` input) as the engine's token mask: `token_mask_for`.

The input is the JSON of a `serving.engine.grammar.Guide` (``{"kind", "value", "param"}``, written by the
OpenAI front) or of a tool-call guide, ``{"kind": "tool_calls", "value": {"functions": [{"name",
"parameters"}], "parallel": bool}}``, which becomes a Lark grammar in the chat template's own tool-call format
here, where the template is known (`tool_calls.tool_call_style`).

One `EngineGrammar` per engine tokenizer (llguidance's tokenizer view takes seconds to build at a 128k
vocabulary; the mask worker's threads are shared by every request of the engine).

Imports: stdlib at module import; the grammar engine lazily (through serving.engine.grammar).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from serving.triton.models.requests import RequestError
from serving.triton.models.tool_calls import tool_call_style, tool_calls_lark

TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class EngineGrammar:
    tokenizer: Any  # llguidance.LLTokenizer
    worker: Any  # serving.engine.grammar.MaskWorker


_ENGINES: dict[int, tuple[Any, EngineGrammar]] = {}  # id(tokenizers.Tokenizer) -> (it, its grammar view)
_ENGINES_LOCK = threading.Lock()


def engine_grammar(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> EngineGrammar:
    """The grammar view of an engine's `tokenizer` (built at its first guided request, then reused)."""
    from serving.engine.grammar import MaskWorker

    with _ENGINES_LOCK:
        known = _ENGINES.get(id(tokenizer))
        if known is None or known[0] is not tokenizer:
            import llguidance

            view = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids) or None)
            known = (tokenizer, EngineGrammar(view, MaskWorker()))
            _ENGINES[id(tokenizer)] = known
        return known[1]


def guide_of(spec: str, chat_template: str | None) -> Any:
    """The `Guide` of a ``guided_decoding`` input (a tool-call guide in the template's format)."""
    from serving.engine.grammar import Guide, GuideError

    try:
        data = json.loads(spec)
    except ValueError as exc:
        raise RequestError(f"input 'guided_decoding' is not JSON: {exc}") from exc
    if isinstance(data, dict) and data.get("kind") == TOOL_CALLS:
        value = data.get("value") or {}
        functions = value.get("functions") if isinstance(value, dict) else None
        if not isinstance(functions, list) or not functions or not all(
                isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions):
            raise RequestError("input 'guided_decoding': a tool_calls guide needs functions [{\"name\", "
                               "\"parameters\"}, ...]")
        lark = tool_calls_lark(functions, tool_call_style(chat_template), parallel=bool(value.get("parallel")))
        return Guide("lark", lark, param="tool_choice")
    try:
        return Guide.from_json(spec)
    except GuideError as exc:
        raise RequestError(f"input 'guided_decoding': {exc}") from exc


def token_mask_for(spec: str, tokenizer: Any, vocab_size: int, *, eos_ids: tuple[int, ...] = (),
                   chat_template: str | None = None) -> Any:
    """The `serving.engine.sampling.TokenMaskSource` enforcing the grammar `spec` (JSON text) over the engine's
    `tokenizer` (a `tokenizers.Tokenizer`) and `vocab_size` logits, ending at `eos_ids` (the engine's stop
    ids); RequestError naming what it cannot enforce."""
    from serving.engine.grammar import GuideError, make_matchers

    guide = guide_of(spec, chat_template)
    engine = engine_grammar(tokenizer, vocab_size, eos_ids)
    try:
        (matcher,) = make_matchers(guide, tokenizer=engine.tokenizer, worker=engine.worker, vocab_size=vocab_size)
    except GuideError as exc:
        raise RequestError(f"input 'guided_decoding' ({exc.param}): {exc}") from exc
    return matcher
