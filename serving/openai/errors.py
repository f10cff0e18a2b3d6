"""An engine's refusal in OpenAI's terms: the OpenAI parameter it concerns, no Triton input name, no internal
model name, no server path.

The ``llm`` model words its refusals for Triton's clients ("input 'top_logprobs'=21 must be from 0 to 20"),
behind the tags the llm and the routers add ("tiny_v1: invalid request: tiny_v1 v1: ..."). `client_error`
takes the tags off, names each Triton input by the OpenAI parameter a client sent (`TRITON_TO_OPENAI`), makes
that the error's ``param``, and leaves no absolute path or ``<model>_v<N>`` name in the message.
"""

from __future__ import annotations

import re

from serving.triton.models.requests import INVALID_REQUEST

# Triton input -> the OpenAI parameter a client of the front sets it with (None: chat and completions differ)
TRITON_TO_OPENAI: dict[str, str | None] = {
    "text_input": "prompt", "input_ids": "prompt", "messages": "messages", "max_tokens": "max_tokens",
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "logprobs": "logprobs",
    "top_logprobs": None, "prompt_logprobs": "echo", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "logit_bias_ids": "logit_bias", "logit_bias_values": "logit_bias", "min_tokens": "min_tokens",
    "guided_decoding": "response_format",
}
_INPUT = re.compile(r"\b(?:inputs?|in) '(\w+)'")
_TAG = re.compile(r"^[\w.-]+ v\d+: ")  # the llm's "<model> v<version>: "
_VERSION_MODEL = re.compile(r"\b[\w.-]+_v\d+\b")  # an engine version's Triton model
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.@+-]+/)*[\w.@+-]+")  # an absolute path


def openai_param(triton_input: str, *, chat: bool) -> str:
    mapped = TRITON_TO_OPENAI.get(triton_input, triton_input)
    if mapped is None:  # top_logprobs: chat's own parameter; completions set it with logprobs
        return "top_logprobs" if chat else "logprobs"
    return "messages" if chat and mapped == "prompt" else mapped


def scrubbed(message: str, model: str) -> str:
    """`message` without an engine version's model name (`model` instead) or an absolute server path."""
    return _PATH.sub("(a path on the server)", _VERSION_MODEL.sub(repr(model).strip("'"), message))


def client_error(message: str, *, chat: bool, model: str) -> tuple[str, str | None]:
    """(message, param) of an engine refusal, in OpenAI's terms (see the module doc)."""
    text = message.rsplit(f"{INVALID_REQUEST}: ", 1)[-1]
    text = _TAG.sub("", text)
    named = [m.group(1) for m in _INPUT.finditer(text) if m.group(1) in TRITON_TO_OPENAI]
    prompt_param = "messages" if chat else "prompt"
    if "needs a chat template" in text:
        return (f"model {model!r} has no chat template, so it cannot answer chat completions: send its prompt to "
                "/v1/completions instead"), "messages"
    text = _INPUT.sub(lambda m: f"'{openai_param(m.group(1), chat=chat)}'" if m.group(1) in TRITON_TO_OPENAI
                      else m.group(0), text)
    if named:
        param: str | None = openai_param(named[0], chat=chat)
    elif text.startswith("prompt") or "the prompt" in text:
        param = prompt_param
    else:
        param = None
    return scrubbed(text, model), param
