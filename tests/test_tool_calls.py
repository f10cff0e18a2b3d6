"""Tool calls without a server: the request checks, the parser of both formats (whole and streamed), the
template's format, the forced-call grammar, and the chat rendering of tools and tool turns."""

from __future__ import annotations

import json

import pytest

from serving.openai.tools import (
    ParamRefused,
    ToolCallStream,
    parse_tool_calls,
    tool_calls_guide,
    tool_request,
)
from serving.triton.models.chat import parse_messages, render_chat
from serving.triton.models.requests import RequestError
from serving.triton.models.tool_calls import tool_call_style, tool_calls_lark

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = ("get_weather", "get_time")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_tool_choice_naming_an_unknown_function_is_refused_naming_tool_choice():
    with pytest.raises(ParamRefused, match="'nope', which is not in tools") as info:
        tool_request([WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    assert info.value.param == "tool_choice"
    with pytest.raises(ParamRefused) as info:
        tool_request([{"type": "function", "function": {"name": "bad name!"}}], None, None)
    assert info.value.param == "tools"


def test_only_required_and_named_choices_force_a_call():
    assert tool_calls_guide(tool_request([WEATHER, TIME], "auto", None)) is None
    assert tool_calls_guide(tool_request([WEATHER, TIME], "none", None)) is None
    named = json.loads(tool_calls_guide(tool_request([WEATHER, TIME], {"type": "function",
                                                                       "function": {"name": "get_time"}}, None)))
    assert [f["name"] for f in named["value"]["functions"]] == ["get_time"]
    required = json.loads(tool_calls_guide(tool_request([WEATHER, TIME], "required", None)))
    assert [f["name"] for f in required["value"]["functions"]] == list(NAMES)


def test_hermes_and_llama3_calls_are_parsed():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_time", "parameters": {}}', NAMES)
    assert content is None and calls[0].name == "get_time" and calls[0].arguments == "{}"
    assert parse_tool_calls('{"name": "unknown", "parameters": {}}', NAMES) == (
        '{"name": "unknown", "parameters": {}}', [])
    assert parse_tool_calls("It is sunny.", NAMES) == ("It is sunny.", [])


def test_a_stream_sends_content_then_each_call_when_its_block_closes():
    text = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    stream, content, calls = ToolCallStream(NAMES), "", []
    for i in range(0, len(text), 3):  # three characters a piece, so tags are split
        more, done = stream.feed(text[i:i + 3])
        content += more
        calls += done
    more, done = stream.finish()
    content += more
    calls += done
    assert content == "Checking." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert stream.calls == 2


def test_a_stream_without_calls_is_all_content():
    stream = ToolCallStream(NAMES)
    sent = "".join(stream.feed(p)[0] for p in ("The answer", " is <b>", "42</b>."))
    assert sent + stream.finish()[0] == "The answer is <b>42</b>."


def test_the_template_picks_the_format():
    assert tool_call_style("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_call_style("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_call_style(CHATML) == "hermes"


def test_a_forced_call_grammar_accepts_a_call_and_nothing_else():
    llguidance = pytest.importorskip("llguidance")
    functions = [WEATHER["function"], TIME["function"]]
    lark = tool_calls_lark(functions, "hermes", parallel=True)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar) == (False, [])
    llama = llguidance.LLMatcher.grammar_from_lark(tool_calls_lark(functions, "llama3_json", parallel=False))
    assert llguidance.LLMatcher.validate_grammar_with_warnings(llama) == (False, [])


def test_a_template_without_tools_gets_them_in_the_system_turn_and_calls_written_out():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    chat = parse_messages(json.dumps({"messages": messages, "tools": [WEATHER]}))
    text = render_chat(CHATML, chat, ())
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_a_template_with_tools_renders_them_itself():
    template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}\n{% endfor %}"
                "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "get_time",
                                                                                     "arguments": "{}"}}]}]
    text = render_chat(template, parse_messages(json.dumps({"messages": messages, "tools": [WEATHER, TIME]})), ())
    assert text == "TOOL get_weather\nTOOL get_time\nuser: hi\nCALL get_time\n"


def test_tool_turns_that_are_malformed_are_refused():
    with pytest.raises(RequestError, match="tool_calls must be"):
        parse_messages(json.dumps([{"role": "user", "content": None, "tool_calls": [{"function": {}}]}]))
    with pytest.raises(RequestError, match="string 'content'"):
        parse_messages(json.dumps([{"role": "assistant", "content": None}]))
