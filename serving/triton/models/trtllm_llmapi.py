"""An engine version's model (``<name>_v<N>``) served by TensorRT-LLM's LLM API (PyTorch backend, no engine build).

``<N>/artifact/`` holds the checkpoint and ``llm_args.json`` (the ``LLM()`` keyword arguments);
``initialize`` checks the recorded toolchain against this host, then creates ``tensorrt_llm.LLM``
(imported lazily: the module imports with numpy only). Every request of a batch becomes one
``llm.generate_async`` call, all awaited together, so the LLM's own in-flight batching schedules them.
Non-decoupled (the router's contract): one response per request from ``await result.aresult()``.
Decoupled configs stream: ``async for`` over ``generate_async(..., streaming=True)``, each response
carrying the new tokens since the previous one, the last one flagged final.

The request maps to ``SamplingParams`` (TensorRT-LLM's LLM API reference): ``stop_token_ids``, ``stop``
(strings; ``include_stop_str_in_output`` left False, so the text ends before the match), ``ignore_eos``,
``end_id`` (the checkpoint's EOS), ``add_special_tokens`` (False for a chat: the template writes them), the
penalties and ``min_tokens`` (``SamplingParams`` fields of the same names). A
``messages`` chat is rendered here with the checkpoint's own chat template (``trtllm_prompts``, as the torch
model does) and sent as text; ``prompt_tokens`` is ``len(RequestOutput.prompt_token_ids)``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np

from serving.triton.models.trtllm_prompts import Prompts
from serving.trtllm.requests import check_limits, cut_at_stop, finish_reason, parse_request

try:  # only inside Triton's python backend; tests install a fake module
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover
    pb_utils = None


def sampling_kwargs(req: Any, *, end_id: int | None) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments of one parsed request (unset fields left to TensorRT-LLM)."""
    kw: dict[str, Any] = {"max_tokens": req.max_tokens}
    for key in ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "min_tokens"):
        if getattr(req, key) is not None:
            kw[key] = getattr(req, key)
    if req.stop_token_ids:
        kw["stop_token_ids"] = list(req.stop_token_ids)
    if req.stop:
        kw["stop"] = list(req.stop)
    if req.ignore_eos:
        kw["ignore_eos"] = True
    if req.messages is not None:
        kw["add_special_tokens"] = False  # the chat template wrote them
    if end_id is not None:
        kw["end_id"] = end_id
    return kw


def _prompt_tokens(result: Any, prompt: Any) -> int:
    """``RequestOutput.prompt_token_ids`` (the LLM API's tokenization); the ids themselves for an id prompt."""
    ids = getattr(result, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    return len(prompt) if isinstance(prompt, list) else 0


class TritonPythonModel:
    """Router contract in, ``tensorrt_llm.LLM.generate_async`` inside."""

    def initialize(self, args: dict[str, str]) -> None:
        from serving.trtllm.commands import make_llm
        from serving.trtllm.toolchain import check_trtllm_toolchain, current_toolchain

        self.model_name = args["model_name"]
        self.version = str(args.get("model_version", ""))
        self.tag = f"[{self.model_name} v{self.version}]"
        vdir = Path(args["model_repository"]) / self.version
        self.info = json.loads((vdir / "version.json").read_text())
        config = json.loads(args.get("model_config", "{}"))
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        try:
            if params.get("check_toolchain", "true") != "false":
                check_trtllm_toolchain(self.info["toolchain"], current_toolchain(), kind="trtllm-llmapi",
                                       uses_fp8=bool(self.info.get("uses_fp8")))
            artifact = vdir / "artifact"
            llm_args = json.loads((artifact / "llm_args.json").read_text())
            self.llm = make_llm(llm_args, artifact)
        except Exception as exc:
            raise RuntimeError(f"{self.tag} {exc}") from exc
        source = Path(llm_args.get("tokenizer") or llm_args["model"])
        self.prompts = Prompts(source if source.is_absolute() else artifact / source)
        self.end_id = self.info.get("special_tokens", {}).get("end_id")

    def _error(self, message: str) -> Any:
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{self.tag} {message}"))

    def _sampling(self, req: Any) -> Any:
        from tensorrt_llm import SamplingParams

        return SamplingParams(**sampling_kwargs(req, end_id=self.end_id))

    @staticmethod
    def _response(tokens: list[int], text: str, reason: str, prompt_tokens: int | None = None) -> Any:
        tensors = [
            pb_utils.Tensor("output_ids", np.asarray([tokens], dtype=np.int32)),
            pb_utils.Tensor("text_output", np.asarray([[text.encode()]], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.asarray([[reason.encode()]], dtype=np.object_)),
        ]
        if prompt_tokens is not None:  # the final response only, as the torch model does
            tensors.append(pb_utils.Tensor("prompt_tokens", np.asarray([[prompt_tokens]], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    async def execute(self, requests: list[Any]) -> list[Any] | None:
        results = await asyncio.gather(*(self._one(r) for r in requests))
        return None if self.decoupled else list(results)

    def _parse(self, request: Any) -> Any:
        def get(name: str) -> Any:
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        req = parse_request(get)
        if req.prompt_ids is not None:
            check_limits(len(req.prompt_ids), req.max_tokens, max_input_len=int(self.info["max_input_len"]),
                         max_seq_len=int(self.info["max_seq_len"]))
        return req

    async def _one(self, request: Any) -> Any:
        sender = request.get_response_sender() if self.decoupled else None
        try:
            req = self._parse(request)
        except ValueError as exc:
            return self._finish(sender, self._error(str(exc)))
        try:
            prompt = (req.prompt_ids if req.prompt_ids is not None
                      else self.prompts.chat_text(req.messages) if req.messages is not None else req.text)
        except ValueError as exc:
            return self._finish(sender, self._error(str(exc)))
        eos = () if req.ignore_eos or self.end_id is None else (int(self.end_id),)
        stops = {int(t) for t in req.stop_token_ids} | set(eos)
        try:
            if sender is None:
                result = await self.llm.generate_async(prompt, sampling_params=self._sampling(req)).aresult()
                out = result.outputs[0]
                tokens = [int(t) for t in out.token_ids]
                text, cut = cut_at_stop(out.text or "", req.stop)
                reason = "stop" if cut else out.finish_reason or finish_reason(tokens, req.max_tokens, stops)
                return self._response(tokens, text, str(reason), _prompt_tokens(result, prompt))
            sent, text_sent = 0, 0
            result = None
            async for partial in self.llm.generate_async(prompt, sampling_params=self._sampling(req), streaming=True):
                result, out = partial, partial.outputs[0]
                tokens, text = [int(t) for t in out.token_ids], out.text or ""
                if len(tokens) > sent:
                    sender.send(self._response(tokens[sent:], text[text_sent:], ""))
                    sent, text_sent = len(tokens), len(text)
            reason = out.finish_reason or finish_reason(tokens, req.max_tokens, stops)
            sender.send(self._response([], "", str(reason), _prompt_tokens(result, prompt)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        except Exception as exc:  # noqa: BLE001 - a failed generation is this request's error
            return self._finish(sender, self._error(f"generation failed: {exc}"))

    @staticmethod
    def _finish(sender: Any, response: Any) -> Any:
        if sender is None:
            return response
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self) -> None:
        shutdown = getattr(getattr(self, "llm", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
