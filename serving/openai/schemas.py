"""Request bodies of the OpenAI-compatible API, validated; anything outside them gets a 400 naming the field.

Types are strict (``max_tokens: true`` or ``stream: "yes"`` is refused, not coerced), and a parameter of
OpenAI's API is either honoured or refused with a 400 naming it: those the engine cannot honour are
accepted only at their no-op value (``logprobs: null``, ``echo: false``, ``best_of: 1``, ``tools: []``,
``frequency_penalty: 0``...). Unknown parameters are refused, as OpenAI's own API does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the engine's seed input is INT64

# parameter -> the values that ask for nothing (the engine cannot honour anything else)
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
}
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range of frequency_penalty and presence_penalty


UNSUPPORTED = "unsupported_parameter"  # the error type of a refused parameter; its ctx names it


def unsupported(param: str, message: str) -> PydanticCustomError:
    """The validation error of a known OpenAI parameter at a value this server cannot honour."""
    return PydanticCustomError(UNSUPPORTED, "{message}", {"param": param, "message": message})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = Field(False, description="Send a last chunk with the request's usage.")


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1, description="A model served by this front (see /v1/models).")
    max_tokens: StrictInt = Field(16, ge=1, le=32768, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, strict=True, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                                   description="Seed for sampling, for repeatable outputs (a 64-bit integer).")
    n: StrictInt = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    stream: StrictBool = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: include_usage.")
    stop: StrictStr | list[StrictStr] | None = Field(None, description="Up to 4 strings that end the generation.")
    user: StrictStr | None = None
    ignore_eos: StrictBool = Field(False, description="Go on past the model's end of sequence / end of turn "
                                   "(vLLM's extension); stop strings and max_tokens still end it.")
    # structured outputs (serving/openai/structured.py checks them): OpenAI's, and vLLM's extensions
    response_format: Any = Field(None, description='{"type": "text" | "json_object" | "json_schema", ...}')
    guided_json: Any = Field(None, description="A JSON Schema the output must match (vLLM's extension).")
    guided_regex: Any = Field(None, description="A regular expression the output must match (vLLM's extension).")
    guided_choice: Any = Field(None, description="Strings, one of which is the output (vLLM's extension).")
    # tool calls (serving/openai/tools.py checks them)
    tools: Any = Field(None, description="Functions the model may call (chat only).")
    tool_choice: Any = Field(None, description='"none", "auto", "required" or {"type": "function", ...}.')
    parallel_tool_calls: Any = Field(None, description="Whether a forced call may be several calls.")
    # OpenAI parameters accepted at their no-op value only (see NO_OP_VALUES)
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @model_validator(mode="after")
    def _honoured_or_refused(self) -> _Common:
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]):
                raise unsupported(name, f"{name}={value!r} must be a number from {PENALTY_RANGE[0]:g} "
                                                 f"to {PENALTY_RANGE[1]:g}")
        for name, no_ops in NO_OP_VALUES.items():
            value = getattr(self, name)
            if not any(value == v and type(value) is type(v) for v in no_ops) and value is not None:
                raise unsupported(name, f"{name}={value!r} is not supported by this server (the engine "
                                                 f"cannot honour it); leave it out")
        if self.stream_options is not None and not self.stream:
            raise unsupported("stream_options", "stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] = Field(description="The prompt (one string, or a list holding one string).")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str:
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError(f"exactly one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="Only text parts are supported (no images or audio).")
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = Field(None, description="null (or left out) only for an "
                                                       "assistant's tool calls.")
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="An assistant's calls (its content null).")
    tool_call_id: StrictStr | None = Field(None, description="The call a tool message answers.")

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only for an assistant message with tool_calls")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined as OpenAI does: without a separator)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=32768)

