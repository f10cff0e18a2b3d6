"""Chat requests of the ``llm`` model: the ``messages`` input (JSON) rendered with the engine's own chat
template, the way transformers' ``apply_chat_template(messages, add_generation_prompt=True)`` does, so
the prompt's token ids are the ones HF would make (the rendered text is tokenized without adding
special tokens: the template writes them itself).

The environment is transformers' (``utils/chat_template_utils.py``): jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does not
escape HTML, and the globals ``raise_exception`` and ``strftime_now``; the template sees ``messages``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).

Imports: stdlib at import time; jinja2 (a dependency of transformers) lazily, once per template.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from serving.triton.models.requests import RequestError

ROLES = ("system", "user", "assistant", "tool", "developer")


def parse_messages(text: str) -> tuple[dict[str, str], ...]:
    """The ``messages`` input: a JSON list of ``{"role": ..., "content": ...}``; RequestError naming what is wrong."""
    try:
        messages = json.loads(text)
    except ValueError as exc:
        raise RequestError(f"input 'messages' is not JSON: {exc}") from exc
    if not isinstance(messages, list) or not messages:
        raise RequestError("input 'messages' must be a non-empty JSON list of {\"role\", \"content\"} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise RequestError(f"input 'messages'[{i}] must be an object with a string 'content'")
        if message.get("role") not in ROLES:
            raise RequestError(f"input 'messages'[{i}] has role={message.get('role')!r}; expected one of {ROLES}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


@lru_cache(maxsize=4)
def _compiled(template: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: tuple[dict[str, str], ...], special_tokens: tuple[tuple[str, str], ...]) -> str:
    """The prompt text of ``messages`` with the assistant's turn opened (``add_generation_prompt=True``)."""
    import jinja2

    try:
        return _compiled(template).render(messages=[dict(m) for m in messages], add_generation_prompt=True,
                                          **dict(special_tokens))
    except jinja2.TemplateError as exc:
        raise RequestError(f"the engine's chat template refused the messages: {exc}") from exc
