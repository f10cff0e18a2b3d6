"""Inference client for the ``llm`` / ``router`` models over Triton's HTTP/JSON protocol (stdlib only)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from serving.triton.errors import InferenceError, TritonUnreachableError
from serving.triton.rest import call


@dataclass(frozen=True)
class InferResult:
    """One answer: new token ids, the version the router chose (None when calling a version directly)."""

    output_ids: list[int]
    routed_version: int | None = None
    text: str | None = None
    finish_reason: str | None = None
    model_version: str | None = None


def _sampling_inputs(temperature: float | None, top_k: int | None, top_p: float | None,
                     seed: int | None) -> list[dict[str, Any]]:
    out = []
    for name, dtype, value in (("temperature", "FP32", temperature), ("top_k", "INT32", top_k),
                               ("top_p", "FP32", top_p), ("seed", "INT64", seed)):
        if value is not None:
            out.append({"name": name, "datatype": dtype, "shape": [1, 1], "data": [value]})
    return out


def _post(http_url: str, model: str, version: int | None, endpoint: str, body: dict[str, Any], *,
          timeout_s: float, setting: str) -> dict[str, Any]:
    """POST ``body`` to ``/v2/models/<model>[/versions/<v>]/<endpoint>``; the JSON answer, or raise."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version is not None else "") + f"/{endpoint}"
    try:
        resp = call(http_url, "POST", path, body=body, timeout_s=timeout_s, setting=setting)
    except TimeoutError as exc:
        raise TritonUnreachableError(str(exc)) from exc
    if resp.status != 200:
        what = "inference" if endpoint == "infer" else endpoint
        raise InferenceError(
            f"{what} on model {model!r}" + (f" version {version}" if version is not None else "")
            + f" at {http_url} (setting {setting}) failed with {resp.status}: {resp.error_message()}",
            status=resp.status,
        )
    return resp.json()


def infer(http_url: str, model: str, inputs: list[dict[str, Any]], outputs: list[str], *,
          version: int | None = None, timeout_s: float = 60.0, setting: str = "triton.http_url") -> dict[str, Any]:
    """POST one inference; return ``{output name: data list}`` plus ``model_version``; raise on error."""
    body = {"inputs": inputs, "outputs": [{"name": n} for n in outputs]}
    doc = _post(http_url, model, version, "infer", body, timeout_s=timeout_s, setting=setting)
    result: dict[str, Any] = {o["name"]: o.get("data", []) for o in doc.get("outputs", [])}
    result["model_version"] = doc.get("model_version")
    return result


def _result(raw: dict[str, Any]) -> InferResult:
    routed = raw.get("routed_version")
    text = raw.get("text_output")
    reason = raw.get("finish_reason")
    return InferResult(
        output_ids=[int(x) for x in raw.get("output_ids", [])],
        routed_version=int(routed[0]) if routed else None,
        text=text[0] if text else None,
        finish_reason=reason[0] if reason else None,
        model_version=raw.get("model_version"),
    )


ENGINE_MODEL = re.compile(r".+(_v\d+|_engine)")  # <name>_v<N>, or the old layout's <name>_engine


def is_engine_model(model: str) -> bool:
    """``model`` names an engine version's model (``<name>_v<N>``), not a router."""
    return ENGINE_MODEL.fullmatch(model) is not None


def _outputs(model_is_router: bool, text: bool) -> list[str]:
    names = ["output_ids", "finish_reason"] + (["text_output"] if text else [])
    return names + (["routed_version"] if model_is_router else [])


def infer_ids(http_url: str, model: str, prompt_ids: list[int], *, max_tokens: int, version: int | None = None,
              timeout_s: float = 60.0, routed: bool | None = None, temperature: float | None = None,
              top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
              stop_token_ids: list[int] | None = None, setting: str = "triton.http_url") -> InferResult:
    """Generate from token ids. ``routed`` (default: the model is not an engine model, `is_engine_model`)
    asks for ``routed_version``."""
    inputs = [
        {"name": "input_ids", "datatype": "INT32", "shape": [1, len(prompt_ids)], "data": list(prompt_ids)},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [max_tokens]},
        *_sampling_inputs(temperature, top_k, top_p, seed),
    ]
    if stop_token_ids:
        inputs.append({"name": "stop_token_ids", "datatype": "INT32", "shape": [1, len(stop_token_ids)],
                       "data": list(stop_token_ids)})
    is_router = not is_engine_model(model) if routed is None else routed
    raw = infer(http_url, model, inputs, _outputs(is_router, False), version=version, timeout_s=timeout_s,
                setting=setting)
    return _result(raw)


def generate_ids(http_url: str, model: str, prompt_ids: list[int], *, max_tokens: int, version: int | None = None,
                 timeout_s: float = 60.0, setting: str = "triton.http_url") -> InferResult:
    """Generate from token ids through Triton's ``/generate`` endpoint, which (unlike ``/infer``) also
    answers a decoupled model: the in-flight batching llm called directly (one response, every token)."""
    body = {"input_ids": list(prompt_ids), "max_tokens": max_tokens}
    doc = _post(http_url, model, version, "generate", body, timeout_s=timeout_s, setting=setting)
    ids = doc.get("output_ids", [])
    return InferResult(output_ids=[int(x) for x in (ids if isinstance(ids, list) else [ids])],
                       finish_reason=doc.get("finish_reason"), model_version=doc.get("model_version"))


def generate_text(http_url: str, model: str, text: str, *, max_tokens: int, version: int | None = None,
                  timeout_s: float = 60.0, setting: str = "triton.http_url") -> InferResult:
    """Generate from text through ``/generate`` (which answers a decoupled model too); the engine folder's
    tokenizer tokenizes it in Triton."""
    body = {"text_input": text, "max_tokens": max_tokens}
    doc = _post(http_url, model, version, "generate", body, timeout_s=timeout_s, setting=setting)
    ids = doc.get("output_ids", [])
    return InferResult(output_ids=[int(x) for x in (ids if isinstance(ids, list) else [ids])],
                       text=doc.get("text_output"), finish_reason=doc.get("finish_reason"),
                       model_version=doc.get("model_version"))


def infer_text(http_url: str, model: str, text: str, *, max_tokens: int, version: int | None = None,
               timeout_s: float = 60.0, routed: bool | None = None, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               setting: str = "triton.http_url") -> InferResult:
    """Generate from text (tokenized by the engine's tokenizer); ``InferResult.text`` holds the new text."""
    inputs = [
        {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [text]},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [max_tokens]},
        *_sampling_inputs(temperature, top_k, top_p, seed),
    ]
    is_router = not is_engine_model(model) if routed is None else routed
    raw = infer(http_url, model, inputs, _outputs(is_router, True), version=version, timeout_s=timeout_s,
                setting=setting)
    return _result(raw)
