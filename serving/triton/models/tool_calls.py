"""Tool calls in the model's own format: which format a chat template uses, the grammar that forces a call in
it (``tool_choice`` "required" or a named function), and the rendering of tools and tool turns for a template
that has no words for them.

Two formats, chosen from the template's text (`tool_call_style`):

- ``hermes`` (Hermes, Qwen 2.5/3, SmolLM3 and most ChatML templates): each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; the template's own tool turns are
  ``role: tool``. Chosen when the template writes ``<tool_call>``, and for a template that does not mention
  tools at all (the tools are then described in the system turn, in this format: `describe_tools`).
- ``llama3_json`` (Llama 3.1-3.3): one call is the whole turn, a JSON object ``{"name": ...,
  "parameters": {...}}`` (after ``<|python_tag|>`` when the model writes one). Chosen when the template
  mentions ``<|python_tag|>`` or ``ipython``.

Imports: stdlib only.
"""

from __future__ import annotations

import json
from typing import Any, Literal

ToolStyle = Literal["hermes", "llama3_json"]
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_TAG = "<|python_tag|>"
# the arguments' key of each style
ARGUMENTS_KEY: dict[str, str] = {"hermes": "arguments", "llama3_json": "parameters"}
# how a schema's JSON is laid out inside a forced call (as json.dumps writes it)
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def tool_call_style(template: str | None) -> ToolStyle:
    """The tool-call format of a chat template (see the module doc)."""
    text = template or ""
    if HERMES_OPEN in text:
        return "hermes"
    if LLAMA3_TAG in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def template_knows_tools(template: str | None) -> bool:
    """Whether a template renders `tools` and assistant `tool_calls` itself."""
    return bool(template) and "tools" in template and "tool_calls" in template  # type: ignore[operator]


def call_schema(function: dict[str, Any], style: ToolStyle) -> dict[str, Any]:
    """The JSON Schema of one call of `function` ({"name", "parameters"}) in `style`."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, ARGUMENTS_KEY[style]: parameters},
            "required": ["name", ARGUMENTS_KEY[style]], "additionalProperties": False, "x-guidance": JSON_LAYOUT}


def tool_calls_lark(functions: list[dict[str, Any]], style: ToolStyle, *, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect: ``%json`` embeds a JSON Schema) whose every sentence is one call
    (or, with `parallel` and the hermes style, one or more) of one of `functions`, in `style`."""
    calls = " | ".join(f"call_{i}" for i in range(len(functions)))
    rules = [f"call_{i}: %json {json.dumps(call_schema(f, style))}" for i, f in enumerate(functions)]
    if style == "hermes":
        block = f'"{HERMES_OPEN}\\n" call "\\n{HERMES_CLOSE}"'
        start = f'start: block ("\\n" block)*\nblock: {block}' if parallel else f"start: {block}"
    else:
        start = "start: call"
    return "\n".join([start, f"call: {calls}", *rules])


def describe_tools(tools: list[dict[str, Any]]) -> str:
    """The system-turn text that tells a model whose template has no tools how to call them (Hermes' words)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            f"within {HERMES_OPEN}{HERMES_CLOSE} XML tags:\n{HERMES_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + HERMES_CLOSE)


def calls_as_text(tool_calls: list[dict[str, Any]], style: ToolStyle) -> str:
    """An assistant turn's `tool_calls` written as the model writes them (for a template without tool_calls)."""
    texts = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = arguments
        body = json.dumps({"name": function.get("name"), ARGUMENTS_KEY[style]: parsed}, ensure_ascii=False)
        texts.append(f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}" if style == "hermes" else body)
    return "\n".join(texts)


def plain_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   style: ToolStyle) -> list[dict[str, Any]]:
    """`messages` for a template without tools: the tools described in the system turn (one is opened when
    there is none), assistant tool calls written out in `style`, every content a string."""
    out = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("role") == "assistant" and message.get("tool_calls"):
            content = "\n".join(t for t in (content, calls_as_text(message["tool_calls"], style)) if t)
        out.append({"role": message["role"], "content": content})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{describe_tools(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": describe_tools(tools)})
    return out
