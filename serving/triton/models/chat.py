"""Chat requests of the ``llm`` model: the ``messages`` input (JSON) rendered with the engine's own chat
template, the way transformers' ``apply_chat_template(messages, add_generation_prompt=True)`` does, so
the prompt's token ids are the ones HF would make (the rendered text is tokenized without adding
special tokens: the template writes them itself).

The environment is transformers' (``utils/chat_template_utils.py``): jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does not
escape HTML, and the globals ``raise_exception`` and ``strftime_now``; the template sees ``messages``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).

Tools: the input is then ``{"messages": [...], "tools": [...]}`` (OpenAI's function objects), and messages
may be assistant turns with ``tool_calls`` (``content`` null) and ``role: tool`` turns with a
``tool_call_id``. A template that renders tools itself (transformers-style: it reads ``tools`` and
``tool_calls``) gets ``tools=`` and the messages as they are; any other template gets the tools described in
the system turn and the calls written out in its tool-call format (`tool_calls.plain_messages`).

Imports: stdlib at import time; jinja2 (a dependency of transformers) lazily, once per template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from serving.triton.models.requests import RequestError
from serving.triton.models.tool_calls import plain_messages, template_knows_tools, tool_call_style

ROLES = ("system", "user", "assistant", "tool", "developer")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


@dataclass(frozen=True)
class Chat:
    """A parsed ``messages`` input: the turns (dicts of `MESSAGE_KEYS`) and the tools offered (may be empty)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()


def _check_message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RequestError(f"input 'messages'[{i}] must be an object with a string 'content'")
    if message.get("role") not in ROLES:
        raise RequestError(f"input 'messages'[{i}] has role={message.get('role')!r}; expected one of {ROLES}")
    calls = message.get("tool_calls")
    if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)
                              or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)):
        raise RequestError(f"input 'messages'[{i}].tool_calls must be an assistant's list of "
                           "{\"function\": {\"name\", \"arguments\"}} objects")
    content = message.get("content")
    if not isinstance(content, str) and not (content is None and calls):
        raise RequestError(f"input 'messages'[{i}] must be an object with a string 'content'")
    return {k: message[k] for k in MESSAGE_KEYS if message.get(k) is not None}


def parse_messages(text: str) -> Chat:
    """The ``messages`` input: a JSON list of ``{"role": ..., "content": ...}``, or ``{"messages": [...],
    "tools": [...]}``; RequestError naming what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RequestError(f"input 'messages' is not JSON: {exc}") from exc
    tools: Any = []
    if isinstance(data, dict):
        data, tools = data.get("messages"), data.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError("input 'messages': 'tools' must be a list of function objects")
    if not isinstance(data, list) or not data:
        raise RequestError("input 'messages' must be a non-empty JSON list of {\"role\", \"content\"} objects")
    return Chat(tuple(_check_message(i, m) for i, m in enumerate(data)), tuple(tools))


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


def render_chat(template: str, chat: Chat | tuple[dict[str, Any], ...],
                special_tokens: tuple[tuple[str, str], ...]) -> str:
    """The prompt text of ``chat`` with the assistant's turn opened (``add_generation_prompt=True``)."""
    import jinja2

    chat = chat if isinstance(chat, Chat) else Chat(tuple(chat))
    tools = [dict(t) for t in chat.tools] or None
    if template_knows_tools(template):
        messages, extra = [dict(m) for m in chat.messages], {"tools": tools}
    else:
        messages, extra = plain_messages([dict(m) for m in chat.messages], tools, tool_call_style(template)), {}
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=True, **extra,
                                          **dict(special_tokens))
    except jinja2.TemplateError as exc:
        raise RequestError(f"the engine's chat template refused the messages: {exc}") from exc
