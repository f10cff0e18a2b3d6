"""Request bodies of the OpenAI-compatible API, validated; anything outside them gets a 400 naming the field.

Types are strict (``max_tokens: true`` or ``stream: "yes"`` is refused, not coerced), and a parameter of
OpenAI's API is either honoured or refused with a 400 naming it: those the engine cannot honour are
accepted only at their no-op value (``best_of`` equal to ``n``, ``tools: []``, ``suffix: ""``...). Unknown
parameters are refused, as OpenAI's own API does. Honoured, in OpenAI's ranges: ``n`` (1 to MAX_CHOICES),
``logprobs`` (chat: true/false with ``top_logprobs`` 0 to 20; completions: 0 to 5), ``echo``, ``logit_bias``
(token id -> -100 to 100), ``presence_penalty`` and ``frequency_penalty`` (-2 to 2), and vLLM's extensions
``top_k``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids`` and ``ignore_eos``. A completion's
``prompt`` is a string, a list of token ids, or a list of either (one choice set per prompt); ``max_tokens: 0``
is allowed with ``echo`` (the prompt's log-probs alone: lm-evaluation-harness's likelihood requests).
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
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range of frequency_penalty and presence_penalty
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range of a logit_bias value
MAX_LOGIT_BIAS = 300  # entries of logit_bias at most
MAX_CHOICES = 16  # n at most
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's chat limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's completions limit
MAX_PROMPTS = 64  # prompts in one completions request at most


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
    max_tokens: StrictInt = Field(16, ge=0, le=32768, description="Tokens to generate at most (0 only with echo).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, strict=True, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                                   description="Seed for sampling, for repeatable outputs (a 64-bit integer).")
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES, description=f"Choices per prompt (at most {MAX_CHOICES}), "
                         "each its own seed: seed + index when a seed is given.")
    stream: StrictBool = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: include_usage.")
    stop: StrictStr | list[StrictStr] | None = Field(None, description="Up to 4 strings that end the generation.")
    user: StrictStr | None = None
    ignore_eos: StrictBool = Field(False, description="Go on past the model's end of sequence / end of turn "
                                   "(vLLM's extension); stop strings and max_tokens still end it.")
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], strict=False)
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], strict=False)
    logit_bias: dict[StrictStr, float] | None = Field(None, description="Token id (as a string) -> a bias from "
                                                      "-100 to 100 added to its logit.")
    # vLLM's extensions
    top_k: StrictInt = Field(0, ge=-1, description="Sample among the k likeliest tokens (0 or -1: all).")
    repetition_penalty: float = Field(1.0, gt=0.0, le=65536.0, description="Divides the logits of tokens already in "
                                      "the prompt or output (above 1: less repetition).")
    min_tokens: StrictInt = Field(0, ge=0, le=32768, description="No stop token or EOS before this many tokens.")
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64, description="Token ids that end the generation.")
    best_of: StrictInt | None = Field(None, ge=1, description="Only equal to n: choices are not ranked here.")
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
    suffix: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(bias)}")
        for token, value in bias.items():
            if not token.isdigit():
                raise ValueError(f"key {token!r} is not a token id (a whole number >= 0 written as a string)")
            if not LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]:
                raise ValueError(f"token {token}: bias {value:g} is outside [{LOGIT_BIAS_RANGE[0]:g}, "
                                 f"{LOGIT_BIAS_RANGE[1]:g}]")
        return bias

    @model_validator(mode="after")
    def _honoured_or_refused(self) -> _Common:
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", f"best_of={self.best_of} with n={self.n}: choices are not ranked by this "
                                         "server; leave best_of out (or equal to n)")
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

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(t), float(b)) for t, b in (self.logit_bias or {}).items())


# A prompt: its text, or its token ids
Prompt = str | list[int]


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] = Field(
        description="The prompt: a string, a list of token ids, or a list of either (one set of choices each).")
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                       description="Log-probs of each token and of this many alternatives.")
    echo: StrictBool = Field(False, description="The prompt first in the text (and its log-probs, with logprobs).")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list) -> list[Prompt]:
        prompts: list = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not prompts:
            raise ValueError("prompt must not be empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for p in prompts:
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p, list) and min(p) < 0:
                raise ValueError(f"token id {min(p)} is negative")
        return prompts

    @model_validator(mode="after")
    def _tokens_to_generate(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise unsupported("max_tokens", "max_tokens=0 is only allowed with echo: true (the prompt's log-probs)")
        return self

    @property
    def prompts(self) -> list[Prompt]:
        return self.prompt  # type: ignore[return-value]  # normalised by the validator


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
    logprobs: StrictBool = Field(False, description="Log-probs of each output token.")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS,
                                           description="Alternatives per token (0 to 20; needs logprobs: true).")

    @model_validator(mode="after")
    def _chat_limits(self) -> ChatCompletionRequest:
        if self.max_tokens == 0:
            raise unsupported("max_tokens", "max_tokens=0 is only allowed for completions with echo: true")
        if self.top_logprobs and not self.logprobs:
            raise unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        return self

