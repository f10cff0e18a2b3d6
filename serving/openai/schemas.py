"""Request bodies of the OpenAI-compatible API, validated; anything outside them gets a 400 naming the field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, description="A model served by this front (see /v1/models).")
    max_tokens: int = Field(16, ge=1, le=32768, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, description="Seed for sampling, for repeatable outputs.")
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    stream: bool = False
    stop: str | list[str] | None = Field(None, description="Up to 4 strings that end the generation.")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[str] = Field(description="The prompt (one string, or a list holding one string).")

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)


def chat_prompt(messages: list[ChatMessage]) -> str:
    """A plain role-tagged transcript ending with the assistant's turn.

    The engine's own chat template (if its tokenizer has one) is not applied here: the front speaks
    text to Triton, and the tokenizer lives with the engine.
    """
    turns = [f"{m.role}: {m.content}" for m in messages]
    return "\n".join([*turns, "assistant:"])
