"""Tool calls at the OpenAI front: ``tools`` and ``tool_choice`` checked, the model's calls parsed out of its
text into ``tool_calls``, whole or as a stream of ``delta.tool_calls[index]`` chunks.

The engine renders the tools with the model's chat template and, for ``tool_choice`` "required" or a named
function, forces a call in the template's format (serving/triton/models/tool_calls.py). The front reads both
formats: Hermes/Qwen ``<tool_call>{...}</tool_call>`` blocks (text before the first block is the message's
content), and a Llama-3 turn that is one JSON object ``{"name", "parameters"}`` (after ``<|python_tag|>``
when written) naming one of the request's functions; anything else is content.

Imports: stdlib only.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from serving.triton.models.tool_calls import HERMES_CLOSE, HERMES_OPEN, LLAMA3_TAG

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
BLOCK = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.DOTALL)


class ParamRefused(ValueError):
    """A parameter the front refuses (tools, tool_choice, a guide): `param` names the OpenAI parameter (HTTP 400)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools: its functions (OpenAI's objects) and the choice."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # "none", "auto", "required", or a function's name
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def offered(self) -> bool:
        """Whether the model sees the tools at all (tool_choice "none" hides them)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> tuple[dict[str, Any], ...]:
        """The functions a call must be of ("required": any; a name: that one; else none forced)."""
        if self.choice == "required":
            return tuple(t["function"] for t in self.tools)
        if self.choice in ("none", "auto"):
            return ()
        return tuple(t["function"] for t in self.tools if t["function"]["name"] == self.choice)


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The request's tools, checked (ParamRefused naming ``tools`` or ``tool_choice``); None without tools."""
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise ParamRefused(f"tool_choice={json.dumps(tool_choice)[:80]} needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ParamRefused("tools must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    seen = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ParamRefused(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                             param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ParamRefused(f"tools[{i}].function.name={name!r} must be 1-64 letters, digits, _ or -",
                             param="tools")
        if name in seen:
            raise ParamRefused(f"tools[{i}].function.name={name!r} is given twice", param="tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ParamRefused(f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
    choice = _choice(tool_choice, seen)
    return ToolRequest(tuple(tools), choice, parallel=parallel_tool_calls is not False)


def _choice(tool_choice: Any, names: set[str]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict):
        raise ParamRefused(f"tool_choice={json.dumps(tool_choice)[:80]} must be \"none\", \"auto\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    name = function.get("name")
    if name not in names:
        raise ParamRefused(f"tool_choice names function {name!r}, which is not in tools ({', '.join(sorted(names))})",
                         param="tool_choice")
    return name


def tool_calls_guide(request: ToolRequest) -> str | None:
    """The ``guided_decoding`` input forcing a call (tool_choice "required" or a name), else None."""
    functions = request.forced
    if not functions:
        return None
    value = {"functions": [{"name": f["name"], "parameters": f.get("parameters")} for f in functions],
             "parallel": request.parallel and request.choice == "required"}
    return json.dumps({"kind": "tool_calls", "value": value}, separators=(",", ":"))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(obj: Any, names: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(obj["name"], text, id=f"call_{uuid.uuid4().hex[:24]}")


def parse_tool_calls(text: str, names: tuple[str, ...]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's whole answer; content is None when the answer is only calls."""
    if HERMES_OPEN in text:
        calls = []
        for block in BLOCK.findall(text):
            try:
                call = _call(json.loads(block), names)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        if calls:
            content = text[:text.index(HERMES_OPEN)].strip()
            return content or None, calls
        return text, []
    body = text.strip().removeprefix(LLAMA3_TAG).strip()
    if body.startswith("{"):
        try:
            call = _call(json.loads(body), names)
        except ValueError:
            call = None
        if call is not None:
            return None, [call]
    return text, []


class ToolCallStream:
    """A streamed answer split into content deltas and whole tool calls, as the text arrives.

    Content is passed on as it comes until the text could be the start of a call (``<tool_call>`` met, or a
    turn that opens with ``{`` or ``<|python_tag|>``); from there it is held, and each call goes out, as one
    ``delta.tool_calls[index]`` chunk, when its block closes (Hermes) or at the end (Llama-3 JSON). Held text
    that turns out to be no call goes out as content at the end."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.held = ""
        self.holding = False
        self.sent_content = False
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls complete now)."""
        if not self.holding:
            start = self._call_start(text)
            if start is None:
                self.sent_content = self.sent_content or bool(text.strip())
                return text, []
            self.holding, self.held = True, text[start:]
            before = text[:start]
            self.sent_content = self.sent_content or bool(before.strip())
            return before, self._complete_blocks()
        self.held += text
        return "", self._complete_blocks()

    def _call_start(self, text: str) -> int | None:
        if HERMES_OPEN in text:
            return text.index(HERMES_OPEN)
        pending = self.held + text
        if not self.sent_content and pending.lstrip().startswith(("{", LLAMA3_TAG)):
            return len(text) - len(text.lstrip())
        partial = max((k for k in range(1, len(HERMES_OPEN)) if text.endswith(HERMES_OPEN[:k])), default=0)
        return len(text) - partial if partial else None

    def _complete_blocks(self) -> list[ToolCall]:
        calls = []
        while HERMES_CLOSE in self.held and self.held.lstrip().startswith(HERMES_OPEN):
            end = self.held.index(HERMES_CLOSE) + len(HERMES_CLOSE)
            _, found = parse_tool_calls(self.held[:end], self.names)
            calls += found
            self.held = self.held[end:].lstrip()
        self.calls += len(calls)
        return calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content, calls) left when the answer ends."""
        held, self.held = self.held, ""
        if not held.strip():
            return "", []
        content, calls = parse_tool_calls(held, self.names)
        self.calls += len(calls)
        return content or "", calls


def chat_messages(messages: list[Any], tools: ToolRequest | None) -> list[dict[str, Any]] | dict[str, Any]:
    """The engine's ``messages`` input of a chat's `schemas.ChatMessage`s: a list of ``{"role", "content"}``
    (with ``tool_calls`` / ``tool_call_id`` where given), wrapped with the tools when the model is offered any."""
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text if message.content is not None else None}
        if message.tool_calls:
            item["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None and message.role == "tool":
            item["name"] = message.name
        out.append(item)
    if tools is not None and tools.offered:
        return {"messages": out, "tools": list(tools.tools)}
    return out


def prompt_chars(prompt: str | list[int] | list[dict[str, Any]] | dict[str, Any]) -> str:
    """The text a prompt carries, for the front's length limit (a chat's contents, its tools' JSON; none in
    token ids, which the engine counts)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return ""
    messages = prompt["messages"] if isinstance(prompt, dict) else prompt
    tools = json.dumps(prompt["tools"]) if isinstance(prompt, dict) else ""
    return "".join(m.get("content") or "" for m in messages) + tools


def assistant_message(text: str, tools: ToolRequest | None, reason: str) -> tuple[dict[str, Any], str]:
    """The chat answer's ``message`` and ``finish_reason``: calls parsed out when tools were offered."""
    if tools is None or not tools.offered:
        return {"role": "assistant", "content": text}, reason
    content, calls = parse_tool_calls(text, tools.names)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    return ({"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]},
            "tool_calls" if reason == "stop" else reason)
