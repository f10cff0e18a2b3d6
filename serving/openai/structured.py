"""Structured outputs at the OpenAI front: ``response_format`` (``text``, ``json_object``, ``json_schema``),
vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice``, and the tool-call guide, turned into the one
``guided_decoding`` input the engine enforces (serving/engine/grammar.py).

Each guide is checked here, before the request travels (`serving.engine.grammar.check_guide`: no tokenizer
needed), so a schema that is not JSON Schema, or uses a feature the grammar engine would not enforce, is a 400
naming the OpenAI parameter and the feature. At most one guide per request.

Imports: stdlib at module import; the grammar engine lazily.
"""

from __future__ import annotations

import json
from typing import Any

from serving.openai.tools import ParamRefused, ToolRequest, tool_calls_guide


def _response_format_guide(response_format: Any) -> Any:
    from serving.engine.grammar import Guide

    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ParamRefused("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                               "{...}, \"strict\": ...}}", param="response_format")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise ParamRefused(f"response_format.json_schema.name={name!r} must be a string", param="response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ParamRefused(f"response_format.json_schema.strict={strict!r} must be true or false",
                               param="response_format")
        return Guide("json_schema", spec["schema"])
    raise ParamRefused(f"response_format={json.dumps(response_format)[:120]} must be {{\"type\": \"text\"}}, "
                       "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {...}}",
                       param="response_format")


def guided_decoding(*, response_format: Any = None, guided_json: Any = None, guided_regex: Any = None,
                    guided_choice: Any = None, tools: ToolRequest | None = None) -> str | None:
    """The ``guided_decoding`` input of a request (None: unconstrained); ParamRefused naming the parameter."""
    from serving.engine.grammar import Guide, GuideError, check_guide

    guides = []
    response = _response_format_guide(response_format)
    if response is not None:
        guides.append(response)
    if guided_json is not None:
        guides.append(Guide("json_schema", guided_json, param="guided_json"))
    if guided_regex is not None:
        guides.append(Guide("regex", guided_regex, param="guided_regex"))
    if guided_choice is not None:
        guides.append(Guide("choice", guided_choice, param="guided_choice"))
    tool_guide = tool_calls_guide(tools) if tools is not None else None
    if len(guides) + (tool_guide is not None) > 1:
        names = [g.param for g in guides] + (["tool_choice"] if tool_guide else [])
        raise ParamRefused(f"{' and '.join(names)} each constrain the output: give one of them", param=names[-1])
    try:
        for guide in guides:
            check_guide(guide)
        if tools is not None:  # a forced call's arguments are enforced: their schemas must be enforceable
            forced = {f["name"] for f in tools.forced}
            for i, tool in enumerate(tools.tools):
                parameters = tool["function"].get("parameters")
                if parameters is not None and tool["function"]["name"] in forced:
                    check_guide(Guide("json_schema", parameters, param=f"tools[{i}].function.parameters"))
    except GuideError as exc:
        param = "tools" if exc.param.startswith("tools[") else exc.param
        raise ParamRefused(str(exc), param=param) from exc
    if tool_guide is not None:
        return tool_guide
    return guides[0].to_json() if guides else None
