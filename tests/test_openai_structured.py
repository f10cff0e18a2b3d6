"""Structured outputs and tool calls through the whole serving path, on the real example model: SmolLM2-135M-
Instruct (float32 paged engine, CPU) in a real Triton (decoupled llm, router, streaming router), `enginewright
serve`, and the official `openai` client: `chat.completions.parse` with a pydantic model, a tool-call round
trip (whole and streamed), and the 400s naming the OpenAI parameter."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "smollm2-structured"
COUNTRIES = ("France", "Japan", "Brazil", "Kenya", "Canada", "Italy", "Egypt", "India", "Mexico", "Norway",
             "Peru", "Spain", "Chile", "Greece", "Poland", "Turkey", "Vietnam", "Ghana", "Sweden", "Argentina")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32}},
                   "required": ["city"], "additionalProperties": False}}}


class Capital(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def base(smollm2_checkpoint, tmp_path_factory):
    """One float32 paged SmolLM2 engine in a real Triton (decoupled, behind its router and streaming router) and
    `enginewright serve` in front: the gate's own serving path (tasks/lm_eval_gate.served_engines)."""
    from serving.engine import EngineLimits, build_engine, convert_checkpoint
    from serving.engine.kv_cache import KVCacheConfig
    from tasks.lm_eval_gate import served_engines

    work = tmp_path_factory.mktemp("structured")
    ckpt = convert_checkpoint(smollm2_checkpoint, work / "ckpt", dtype="float32")
    engine = work / "engine"
    build_engine(ckpt, engine, limits=EngineLimits(dtype="float32", max_batch_size=4, max_input_len=512,
                                                   max_seq_len=768),
                 kv_cache=KVCacheConfig(block_size=16, num_blocks=200, max_num_tokens=512))
    with served_engines({MODEL: engine}, work / "serving") as served:
        yield served.base_url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def test_parse_with_a_pydantic_model_returns_a_valid_object_for_every_prompt(client):
    """20 of 20: the grammar, not the model's skill, makes each answer a `Capital`. Four at a time, the engine's
    batch: each row keeps its own grammar state in the batch (and the engine steps four rows for the CPU of one)."""
    from concurrent.futures import ThreadPoolExecutor

    def parse(country: str):
        done = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": f"Give the capital of {country} as JSON."}],
            response_format=Capital, max_tokens=96, temperature=0)
        assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
        return done.choices[0].message.parsed

    with ThreadPoolExecutor(max_workers=4) as pool:
        parsed = list(pool.map(parse, COUNTRIES))
    assert len(parsed) == 20 and all(isinstance(p, Capital) for p in parsed)


def test_json_object_and_vllms_choice_and_regex(client):
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object?"}],
                                          response_format={"type": "json_object"}, max_tokens=64, temperature=0)
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(done.choices[0].message.content), dict)
    else:  # out of tokens inside the object: still a prefix of one
        assert done.choices[0].message.content.startswith("{")
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8, temperature=0,
        extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A year?"}], max_tokens=8, temperature=0,
        extra_body={"guided_regex": "[12][0-9]{3}"})
    assert len(regex.choices[0].message.content) == 4 and regex.choices[0].message.content.isdigit()


def test_a_tool_call_round_trip_returns_the_call_then_a_final_answer(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=64, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert set(json.loads(call.function.arguments)) == {"city"}
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees C and sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=48, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_a_named_function_is_called_and_streamed_as_tool_call_deltas(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome, please."}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64, temperature=0,
        stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].function.name == "get_weather" and deltas[0].id
    assert set(json.loads(deltas[0].function.arguments)) == {"city"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "a string"}}},
     "response_format", "JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}}}},
     "response_format", "uniqueItems"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "get_time"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "guided_regex"),
])
def test_what_the_engine_cannot_enforce_is_a_400_naming_the_parameter(base, body, param, words):
    reply = httpx.post(f"{base}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
