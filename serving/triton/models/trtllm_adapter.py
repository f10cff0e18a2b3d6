"""An engine version's model (``<name>_v<N>``) backed by a TensorRT engine: a BLS adapter in front of the ``tensorrt_llm`` backend.

The router's contract holds unchanged (``docs/triton.md``); this model maps it to the backend's names
(``docs/tensorrt-llm.md``, "Name mapping"): ``max_tokens`` -> ``request_output_len``, ``top_k`` ->
``runtime_top_k``, ``top_p`` -> ``runtime_top_p``, ``stop_token_ids`` -> ``stop_words_list`` [2, n],
``seed`` -> UINT64, plus ``input_lengths``, ``end_id``/``pad_id`` from the checkpoint and
``exclude_input_in_output`` = true; ``stop`` strings -> more ``stop_words_list`` entries (token ids, multi-token
words allowed), ``ignore_eos`` -> ``end_id`` = -1 (what TensorRT-LLM's executor sends for
``SamplingParams(ignore_eos=True)``); back: ``output_ids[0, :sequence_length]`` -> ``output_ids``,
detokenized ``text_output`` (cut before a stop string), ``finish_reason``, ``prompt_tokens``. Text and chat
prompts are tokenized here (``trtllm_prompts``: the chat template, ``tokenizers``, lazily).

Per-version facts live in ``<N>/version.json`` (written by ``stage_trtllm_version``): target model,
limits, special tokens and the toolchain the engine was built with, checked against this host at load.
All requests of a batch are forwarded concurrently (async BLS), so the backend's in-flight batcher sees them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np

from serving.triton.models.trtllm_prompts import Prompts
from serving.trtllm.requests import (
    IGNORED_END_ID,
    check_limits,
    cut_at_stop,
    finish_reason,
    generated_tokens,
    parse_request,
    stop_words,
    stop_words_list,
)

try:  # only inside Triton's python backend; tests install a fake module
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover
    pb_utils = None


def _output(response: Any, name: str) -> np.ndarray | None:
    for t in response.output_tensors():
        if t.name() == name:
            return t.as_numpy()
    return None


class TritonPythonModel:
    """Router contract in, ``tensorrt_llm`` backend out, one engine version per Triton version."""

    def initialize(self, args: dict[str, str]) -> None:
        self.model_name = args["model_name"]
        self.version = str(args.get("model_version", ""))
        self.tag = f"[{self.model_name} v{self.version}]"
        vdir = Path(args["model_repository"]) / self.version
        self.info = json.loads((vdir / "version.json").read_text())
        config = json.loads(args.get("model_config", "{}"))
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        # a decoupled engine model (issue 7's streaming llm config) gets one final response per request
        self.engine_decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        if params.get("check_toolchain", "true") != "false":
            from serving.trtllm.toolchain import check_trtllm_toolchain, current_toolchain

            try:
                check_trtllm_toolchain(self.info["toolchain"], current_toolchain(), kind="trtllm-engine")
            except Exception as exc:
                raise RuntimeError(f"{self.tag} {exc}") from exc
        self.target = self.info["target_model"]
        self.decoupled = bool(self.info.get("decoupled", False))
        self.input_in_output = bool(self.info.get("input_in_output", False))
        self.end_id = int(self.info["special_tokens"]["end_id"])
        self.pad_id = int(self.info["special_tokens"].get("pad_id", self.end_id))
        self.prompts = Prompts(vdir / "tokenizer")
        loader = getattr(pb_utils, "load_model", None)
        ready = getattr(pb_utils, "is_model_ready", None)
        if loader is not None and ready is not None and not ready(model_name=self.target):
            loader(model_name=self.target)  # explicit model control: the engine model comes up with its adapter

    def _error(self, message: str) -> Any:
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"{self.tag} {message}"))

    async def execute(self, requests: list[Any]) -> list[Any] | None:
        responses = list(await asyncio.gather(*(self._one(r) for r in requests)))
        if not self.engine_decoupled:
            return responses
        for request, response in zip(requests, responses):
            request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _backend_inputs(self, ids: list[int], req: Any) -> list[Any]:
        T = pb_utils.Tensor
        inputs = [T("input_ids", np.asarray([ids], dtype=np.int32)),
                  T("input_lengths", np.asarray([[len(ids)]], dtype=np.int32)),
                  T("request_output_len", np.asarray([[req.max_tokens]], dtype=np.int32)),
                  T("end_id", np.asarray([[IGNORED_END_ID if req.ignore_eos else self.end_id]], dtype=np.int32)),
                  T("pad_id", np.asarray([[self.pad_id]], dtype=np.int32)),
                  T("exclude_input_in_output", np.asarray([[not self.input_in_output]], dtype=bool))]
        for name, value, dtype in (("temperature", req.temperature, np.float32), ("runtime_top_k", req.top_k, np.int32),
                                   ("runtime_top_p", req.top_p, np.float32), ("seed", req.seed, np.uint64),
                                   ("presence_penalty", req.presence_penalty, np.float32),
                                   ("frequency_penalty", req.frequency_penalty, np.float32),
                                   ("repetition_penalty", req.repetition_penalty, np.float32),
                                   ("min_tokens", req.min_tokens, np.int32)):
            if value is not None:
                inputs.append(T(name, np.asarray([[value]], dtype=dtype)))
        words = stop_words(req.stop_token_ids, req.stop, self.prompts.encode_stop)
        if words:
            inputs.append(T("stop_words_list", np.asarray([stop_words_list(words)], dtype=np.int32)))
        return inputs

    async def _call(self, inputs: list[Any]) -> tuple[list[int], int] | str:
        bls = pb_utils.InferenceRequest(model_name=self.target, requested_output_names=["output_ids", "sequence_length"],
                                        inputs=inputs)
        responses = []
        if self.decoupled:
            async for r in await bls.async_exec(decoupled=True):
                if r.has_error() or r.output_tensors():
                    responses.append(r)
        else:
            responses.append(await bls.async_exec())
        ids: list[int] = []
        for r in responses:
            if r.has_error():
                return f"{self.target}: {r.error().message()}"
            out, seq = _output(r, "output_ids"), _output(r, "sequence_length")
            if out is None or seq is None:
                return f"{self.target}: response without output_ids/sequence_length"
            ids.extend(int(t) for t in out.reshape(-1, out.shape[-1])[0][: int(seq.reshape(-1)[0])])
        return ids, len(ids)

    async def _one(self, request: Any) -> Any:
        def get(name: str) -> Any:
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        try:
            req = parse_request(get)
            ids = self.prompts.ids(req)
            check_limits(len(ids), req.max_tokens, max_input_len=int(self.info["max_input_len"]),
                         max_seq_len=int(self.info["max_seq_len"]))
        except ValueError as exc:
            return self._error(str(exc))
        try:
            result = await self._call(self._backend_inputs(ids, req))
        except Exception as exc:  # noqa: BLE001 - a failed call is this request's error
            return self._error(f"forwarding to {self.target} failed: {exc}")
        if isinstance(result, str):
            return self._error(result)
        tokens = generated_tokens(result[0], result[1], prompt_len=len(ids), input_in_output=self.input_in_output)
        stops = {*req.stop_token_ids, *(() if req.ignore_eos else (self.end_id,))}
        reason = finish_reason(tokens, req.max_tokens, stops)
        names = getattr(request, "requested_output_names", None)
        requested = set(names() if callable(names) else ())
        text = ""
        if "text_output" in requested or req.prompt_ids is None or req.stop:
            text, cut = cut_at_stop(self.prompts.decode(tokens), req.stop)
            reason = "stop" if cut else reason
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("output_ids", np.asarray([tokens], dtype=np.int32)),
            pb_utils.Tensor("text_output", np.asarray([[text.encode()]], dtype=np.object_)),
            pb_utils.Tensor("finish_reason", np.asarray([[reason.encode()]], dtype=np.object_)),
            pb_utils.Tensor("prompt_tokens", np.asarray([[len(ids)]], dtype=np.int32)),
        ])

    def finalize(self) -> None:
        """The tensorrt_llm model stays loaded: a config change reloads this model's versions, and the
        new instances need it; ``remove_trtllm_model`` unloads it when its version is removed."""
