"""Triton model repositories for the TensorRT-LLM kinds, generated from the spec.

Two layouts:

1. The upstream **inflight_batcher_llm set** (``write_inflight_batcher_repository``): ``preprocessing``,
   ``tensorrt_llm``, ``postprocessing``, ``ensemble`` and ``tensorrt_llm_bls``, with every parameter of
   ``tools/fill_template.py`` filled from the spec (``template_values``). The configs are generated here
   (protobuf-JSON dicts rendered by ``pbtxt.to_pbtxt``), not copied; the python ``model.py`` files of
   preprocessing / postprocessing / tensorrt_llm_bls come from TensorRT-LLM's
   ``triton_backend/all_models/inflight_batcher_llm`` (argument ``backend_models_dir``).
   Source of names, types and parameters: NVIDIA/TensorRT-LLM
   ``triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt`` and
   ``triton_backend/tools/fill_template.py`` (formerly triton-inference-server/tensorrtllm_backend).

2. The **gray-release layout** (``stage_trtllm_version``), so the ``router`` works unchanged in front of
   either kind. Each version is a model ``<name>_v<N>`` keeping the llm contract
   (``model_configs.llm_config``); its ``model.py`` is chosen by kind:

   - trtllm-engine: ``<name>_v<N>/1/model.py`` = ``models/trtllm_adapter.py``, a BLS adapter that maps
     the router's inputs to the ``tensorrt_llm`` backend model ``<name>_trtllm_v<N>`` (one per engine,
     because the engine path is a model-level parameter) and back; tokenizer files in ``1/tokenizer``.
   - trtllm-llmapi: ``<name>_v<N>/1/model.py`` = ``models/trtllm_llmapi.py`` serving
     ``1/artifact`` (checkpoint + ``llm_args.json``) with ``tensorrt_llm.LLM``.

   The toolchain recorded in the artifact is checked against the target before anything is written.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from serving.triton.errors import RepositoryError
from serving.triton.pbtxt import to_pbtxt
from serving.triton.repository import (
    DEFAULT_SETTINGS,
    MODELS_DIR,
    STAGING_PREFIX,
    engine_model_name,
    init_repository,
    next_version,
    place_tree,
    served_versions,
    set_served_versions,
    stage_version_model,
    write_atomic,
)

DEFAULT_NAMES = {"preprocessing": "preprocessing", "tensorrt_llm": "tensorrt_llm",
                 "postprocessing": "postprocessing", "ensemble": "ensemble", "tensorrt_llm_bls": "tensorrt_llm_bls"}
_DTYPE_TO_TRITON = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32"}


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def template_values(options: Any, *, engine_dir: str, tokenizer_dir: str, max_queue_delay_us: int = 2000,
                    max_queue_size: int = 64, preprocessing_instance_count: int = 1,
                    postprocessing_instance_count: int = 1, bls_instance_count: int = 1,
                    tensorrt_llm_model_name: str = "tensorrt_llm", logits_datatype: str = "TYPE_FP32",
                    accumulate_tokens: bool = False) -> dict[str, str | None]:
    """Every ``fill_template.py`` parameter of the five templates -> its value (None: left unset).

    An unset parameter is omitted from the generated config, which the backend treats like an unfilled
    ``${...}`` placeholder: its default applies.
    """
    return {
        # shared
        "triton_max_batch_size": str(options.max_batch_size),
        "decoupled_mode": _b(options.decoupled_mode),
        "max_queue_delay_microseconds": str(max_queue_delay_us),
        "max_queue_size": str(max_queue_size),
        "logits_datatype": logits_datatype,
        "tokenizer_dir": tokenizer_dir,
        "engine_dir": engine_dir,
        # tensorrt_llm
        "triton_backend": "tensorrtllm",
        "encoder_input_features_data_type": _DTYPE_TO_TRITON[options.dtype],
        "prompt_embedding_table_data_type": _DTYPE_TO_TRITON[options.dtype],
        "max_beam_width": str(options.max_beam_width),
        "batching_strategy": options.batching_strategy,
        "encoder_engine_dir": None,
        "max_tokens_in_paged_kv_cache": None,
        "max_attention_window_size": None,
        "sink_token_length": None,
        "batch_scheduler_policy": options.batch_scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": str(options.kv_cache_free_gpu_mem_fraction),
        "cross_kv_cache_fraction": None,
        "kv_cache_host_memory_bytes": None,
        "kv_cache_onboard_blocks": None,
        "enable_trt_overlap": None,
        "exclude_input_in_output": "true",
        "cancellation_check_period_ms": "100",
        "stats_check_period_ms": "100",
        "iter_stats_max_iterations": "1000",
        "request_stats_max_iterations": "0",
        "enable_kv_cache_reuse": _b(options.enable_kv_cache_reuse),
        "normalize_log_probs": "true",
        "enable_chunked_context": _b(options.enable_chunked_context),
        "gpu_device_ids": None,
        "participant_ids": None,
        "num_nodes": None,
        "lora_cache_optimal_adapter_size": None,
        "lora_cache_max_adapter_size": None,
        "lora_cache_gpu_memory_fraction": None,
        "lora_cache_host_memory_bytes": None,
        "lora_prefetch_dir": None,
        "decoding_mode": None,
        "lookahead_window_size": None,
        "lookahead_ngram_size": None,
        "lookahead_verification_set_size": None,
        "medusa_choices": None,
        "eagle_choices": None,
        "gpu_weights_percent": None,
        "enable_context_fmha_fp32_acc": None,
        "multi_block_mode": None,
        "cuda_graph_mode": None,
        "cuda_graph_cache_size": None,
        "speculative_decoding_fast_logits": None,
        "guided_decoding_backend": None,
        "xgrammar_tokenizer_info_path": None,
        # preprocessing / postprocessing
        "add_special_tokens": "true",
        "multimodal_model_path": None,
        "max_num_images": None,
        "hf_model_path": None,
        "skip_special_tokens": "true",
        "preprocessing_instance_count": str(preprocessing_instance_count),
        "postprocessing_instance_count": str(postprocessing_instance_count),
        # tensorrt_llm_bls
        "accumulate_tokens": _b(accumulate_tokens),
        "tensorrt_llm_model_name": tensorrt_llm_model_name,
        "tensorrt_llm_draft_model_name": None,
        "multimodal_encoders_name": None,
        "bls_instance_count": str(bls_instance_count),
    }


# Which template parameters are config *parameters* of which model (the rest fill fields or types).
MODEL_PARAMETERS = {
    "tensorrt_llm": {  # config parameter key -> template value name
        "max_beam_width": "max_beam_width", "gpt_model_type": "batching_strategy", "gpt_model_path": "engine_dir",
        "encoder_model_path": "encoder_engine_dir", "max_tokens_in_paged_kv_cache": "max_tokens_in_paged_kv_cache",
        "max_attention_window_size": "max_attention_window_size", "sink_token_length": "sink_token_length",
        "batch_scheduler_policy": "batch_scheduler_policy",
        "kv_cache_free_gpu_mem_fraction": "kv_cache_free_gpu_mem_fraction",
        "cross_kv_cache_fraction": "cross_kv_cache_fraction", "kv_cache_host_memory_bytes": "kv_cache_host_memory_bytes",
        "kv_cache_onboard_blocks": "kv_cache_onboard_blocks", "enable_trt_overlap": "enable_trt_overlap",
        "exclude_input_in_output": "exclude_input_in_output",
        "cancellation_check_period_ms": "cancellation_check_period_ms",
        "stats_check_period_ms": "stats_check_period_ms", "iter_stats_max_iterations": "iter_stats_max_iterations",
        "request_stats_max_iterations": "request_stats_max_iterations",
        "enable_kv_cache_reuse": "enable_kv_cache_reuse", "normalize_log_probs": "normalize_log_probs",
        "enable_chunked_context": "enable_chunked_context", "gpu_device_ids": "gpu_device_ids",
        "participant_ids": "participant_ids", "num_nodes": "num_nodes",
        "lora_cache_optimal_adapter_size": "lora_cache_optimal_adapter_size",
        "lora_cache_max_adapter_size": "lora_cache_max_adapter_size",
        "lora_cache_gpu_memory_fraction": "lora_cache_gpu_memory_fraction",
        "lora_cache_host_memory_bytes": "lora_cache_host_memory_bytes", "lora_prefetch_dir": "lora_prefetch_dir",
        "decoding_mode": "decoding_mode", "lookahead_window_size": "lookahead_window_size",
        "lookahead_ngram_size": "lookahead_ngram_size",
        "lookahead_verification_set_size": "lookahead_verification_set_size", "medusa_choices": "medusa_choices",
        "eagle_choices": "eagle_choices", "gpu_weights_percent": "gpu_weights_percent",
        "enable_context_fmha_fp32_acc": "enable_context_fmha_fp32_acc", "multi_block_mode": "multi_block_mode",
        "cuda_graph_mode": "cuda_graph_mode", "cuda_graph_cache_size": "cuda_graph_cache_size",
        "speculative_decoding_fast_logits": "speculative_decoding_fast_logits", "tokenizer_dir": "tokenizer_dir",
        "guided_decoding_backend": "guided_decoding_backend",
        "xgrammar_tokenizer_info_path": "xgrammar_tokenizer_info_path",
    },
    "preprocessing": {"tokenizer_dir": "tokenizer_dir", "add_special_tokens": "add_special_tokens",
                      "multimodal_model_path": "multimodal_model_path", "gpt_model_path": "engine_dir",
                      "max_num_images": "max_num_images", "hf_model_path": "hf_model_path"},
    "postprocessing": {"tokenizer_dir": "tokenizer_dir", "skip_special_tokens": "skip_special_tokens"},
    "tensorrt_llm_bls": {"accumulate_tokens": "accumulate_tokens", "tensorrt_llm_model_name": "tensorrt_llm_model_name",
                         "tensorrt_llm_draft_model_name": "tensorrt_llm_draft_model_name",
                         "multimodal_encoders_name": "multimodal_encoders_name"},
}


def _params(model: str, values: dict[str, str | None]) -> dict[str, dict[str, str]]:
    return {key: {"string_value": values[src]} for key, src in MODEL_PARAMETERS[model].items()
            if values.get(src) is not None}


def _t(name: str, data_type: str, dims: list[int], *, optional: bool = False, ragged: bool = False,
       scalar: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"name": name, "data_type": data_type, "dims": dims}
    if scalar:
        t["reshape"] = {"shape": []}
    if optional:
        t["optional"] = True
    if ragged:
        t["allow_ragged_batch"] = True
    return t


def _batching(values: dict[str, str | None]) -> dict[str, Any]:
    return {"preferred_batch_size": [int(values["triton_max_batch_size"])],
            "max_queue_delay_microseconds": int(values["max_queue_delay_microseconds"]),
            "default_queue_policy": {"max_queue_size": int(values["max_queue_size"])}}


def tensorrt_llm_config(values: dict[str, str | None], *, name: str = "tensorrt_llm") -> dict[str, Any]:
    """The ``tensorrt_llm`` (C++ backend) model: the inputs/outputs enginewright and the ensemble use."""
    sc = {"optional": True, "scalar": True}
    return {
        "name": name,
        "backend": values["triton_backend"],
        "max_batch_size": int(values["triton_max_batch_size"]),
        "model_transaction_policy": {"decoupled": values["decoupled_mode"] == "true"},
        "dynamic_batching": _batching(values),
        "input": [
            _t("input_ids", "TYPE_INT32", [-1], optional=True, ragged=True),
            _t("encoder_input_features", values["encoder_input_features_data_type"], [-1, -1], optional=True,
               ragged=True),
            _t("input_lengths", "TYPE_INT32", [1], scalar=True),
            _t("request_output_len", "TYPE_INT32", [1], scalar=True),
            _t("end_id", "TYPE_INT32", [1], **sc), _t("pad_id", "TYPE_INT32", [1], **sc),
            _t("stop_words_list", "TYPE_INT32", [2, -1], optional=True, ragged=True),
            _t("bad_words_list", "TYPE_INT32", [2, -1], optional=True, ragged=True),
            _t("embedding_bias", "TYPE_FP32", [-1], optional=True, ragged=True),
            _t("beam_width", "TYPE_INT32", [1], **sc), _t("temperature", "TYPE_FP32", [1], **sc),
            _t("runtime_top_k", "TYPE_INT32", [1], **sc), _t("runtime_top_p", "TYPE_FP32", [1], **sc),
            _t("len_penalty", "TYPE_FP32", [1], **sc), _t("repetition_penalty", "TYPE_FP32", [1], **sc),
            _t("min_tokens", "TYPE_INT32", [1], **sc), _t("presence_penalty", "TYPE_FP32", [1], **sc),
            _t("frequency_penalty", "TYPE_FP32", [1], **sc), _t("seed", "TYPE_UINT64", [1], **sc),
            _t("return_log_probs", "TYPE_BOOL", [1], **sc), _t("return_context_logits", "TYPE_BOOL", [1], **sc),
            _t("return_generation_logits", "TYPE_BOOL", [1], **sc),
            _t("exclude_input_in_output", "TYPE_BOOL", [1], **sc), _t("stop", "TYPE_BOOL", [1], **sc),
            _t("streaming", "TYPE_BOOL", [1], **sc), _t("num_return_sequences", "TYPE_INT32", [1], **sc),
            _t("prompt_embedding_table", values["prompt_embedding_table_data_type"], [-1, -1], optional=True,
               ragged=True),
            _t("prompt_vocab_size", "TYPE_INT32", [1], **sc),
        ],
        "output": [
            _t("output_ids", "TYPE_INT32", [-1, -1]), _t("sequence_length", "TYPE_INT32", [-1]),
            _t("cum_log_probs", "TYPE_FP32", [-1]), _t("output_log_probs", "TYPE_FP32", [-1, -1]),
            _t("context_logits", values["logits_datatype"], [-1, -1]),
            _t("generation_logits", values["logits_datatype"], [-1, -1, -1]),
            _t("batch_index", "TYPE_INT32", [1]), _t("sequence_index", "TYPE_INT32", [1]),
        ],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],  # the backend places the engine on its GPUs
        "parameters": {"FORCE_CPU_ONLY_INPUT_TENSORS": {"string_value": "no"}, **_params("tensorrt_llm", values)},
    }


def preprocessing_config(values: dict[str, str | None], *, name: str = "preprocessing") -> dict[str, Any]:
    """Inputs and outputs the upstream preprocessing ``model.py`` looks up at initialize (all of them)."""
    o = {"optional": True}
    return {
        "name": name, "backend": "python", "max_batch_size": int(values["triton_max_batch_size"]),
        "dynamic_batching": _batching(values),
        "input": [
            _t("QUERY", "TYPE_STRING", [1]), _t("DECODER_QUERY", "TYPE_STRING", [1], **o),
            _t("IMAGE_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], **o), _t("IMAGE_URL", "TYPE_STRING", [1], **o),
            _t("IMAGES", "TYPE_STRING", [-1], **o), _t("VIDEO_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], **o),
            _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]), _t("BAD_WORDS_DICT", "TYPE_STRING", [-1], **o),
            _t("STOP_WORDS_DICT", "TYPE_STRING", [-1], **o), _t("EMBEDDING_BIAS_WORDS", "TYPE_STRING", [-1], **o),
            _t("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", [-1], **o), _t("END_ID", "TYPE_INT32", [1], **o),
            _t("PAD_ID", "TYPE_INT32", [1], **o), _t("PROMPT_TABLE_EXTRA_ID", "TYPE_UINT64", [1], **o),
        ],
        "output": [
            _t("INPUT_ID", "TYPE_INT32", [-1]), _t("REQUEST_INPUT_LEN", "TYPE_INT32", [1]),
            _t("DECODER_INPUT_ID", "TYPE_INT32", [-1]), _t("REQUEST_DECODER_INPUT_LEN", "TYPE_INT32", [1]),
            _t("BAD_WORDS_IDS", "TYPE_INT32", [2, -1]), _t("STOP_WORDS_IDS", "TYPE_INT32", [2, -1]),
            _t("EMBEDDING_BIAS", "TYPE_FP32", [-1]), _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", [-1]),
            _t("OUT_END_ID", "TYPE_INT32", [1]), _t("OUT_PAD_ID", "TYPE_INT32", [1]),
            _t("OUT_PROMPT_TABLE_EXTRA_IDS", "TYPE_UINT64", [-1]), _t("PIXEL_VALUES", "TYPE_FP16", [-1, -1, -1, -1]),
            _t("ASPECT_RATIO_IDS", "TYPE_INT64", [-1]), _t("ASPECT_RATIO_MASK", "TYPE_INT64", [-1, -1]),
            _t("CROSS_ATTENTION_MASK", "TYPE_INT64", [-1, -1, -1]), _t("IMAGE_SIZES", "TYPE_INT64", [-1, 2]),
            _t("IS_VIDEO_INPUT", "TYPE_BOOL", [1]), _t("ATTENTION_MASK", "TYPE_INT64", [-1]),
            _t("IMAGE_GRID_THW", "TYPE_INT64", [3]), _t("VISION_INPUT_ID", "TYPE_INT32", [-1]),
        ],
        "parameters": _params("preprocessing", values),
        "instance_group": [{"count": int(values["preprocessing_instance_count"]), "kind": "KIND_CPU"}],
    }


def postprocessing_config(values: dict[str, str | None], *, name: str = "postprocessing") -> dict[str, Any]:
    return {
        "name": name, "backend": "python", "max_batch_size": int(values["triton_max_batch_size"]),
        "dynamic_batching": {},
        "input": [_t("TOKENS_BATCH", "TYPE_INT32", [-1, -1]), _t("SEQUENCE_LENGTH", "TYPE_INT32", [-1])],
        "output": [_t("OUTPUT", "TYPE_STRING", [-1])],
        "parameters": _params("postprocessing", values),
        "instance_group": [{"count": int(values["postprocessing_instance_count"]), "kind": "KIND_CPU"}],
    }


# ensemble / BLS request inputs: (name, type, dims, optional)
_CLIENT_INPUTS = [
    ("text_input", "TYPE_STRING", [1], False), ("max_tokens", "TYPE_INT32", [1], False),
    ("bad_words", "TYPE_STRING", [-1], True), ("stop_words", "TYPE_STRING", [-1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True), ("end_id", "TYPE_INT32", [1], True),
    ("pad_id", "TYPE_INT32", [1], True), ("top_k", "TYPE_INT32", [1], True), ("top_p", "TYPE_FP32", [1], True),
    ("temperature", "TYPE_FP32", [1], True), ("length_penalty", "TYPE_FP32", [1], True),
    ("repetition_penalty", "TYPE_FP32", [1], True), ("min_tokens", "TYPE_INT32", [1], True),
    ("presence_penalty", "TYPE_FP32", [1], True), ("frequency_penalty", "TYPE_FP32", [1], True),
    ("seed", "TYPE_UINT64", [1], True), ("return_log_probs", "TYPE_BOOL", [1], True),
    ("return_context_logits", "TYPE_BOOL", [1], True), ("return_generation_logits", "TYPE_BOOL", [1], True),
    ("beam_width", "TYPE_INT32", [1], True), ("stream", "TYPE_BOOL", [1], True),
    ("embedding_bias_words", "TYPE_STRING", [-1], True), ("embedding_bias_weights", "TYPE_FP32", [-1], True),
]


def _client_io(values: dict[str, str | None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    inputs = [_t(n, t, d, optional=o) for n, t, d, o in _CLIENT_INPUTS]
    outputs = [_t("text_output", "TYPE_STRING", [-1]), _t("cum_log_probs", "TYPE_FP32", [-1]),
               _t("output_log_probs", "TYPE_FP32", [-1, -1]),
               _t("context_logits", values["logits_datatype"], [-1, -1]),
               _t("generation_logits", values["logits_datatype"], [-1, -1, -1]),
               _t("batch_index", "TYPE_INT32", [1]), _t("sequence_index", "TYPE_INT32", [1])]
    return inputs, outputs


def _map(d: dict[str, str]) -> list[dict[str, str]]:
    """A protobuf map<string, string> as repeated key/value entries (what ``to_pbtxt`` renders)."""
    return [{"key": k, "value": v} for k, v in d.items()]


def ensemble_config(values: dict[str, str | None], names: dict[str, str] = DEFAULT_NAMES) -> dict[str, Any]:
    """preprocessing -> tensorrt_llm -> postprocessing, mapping the client names to each step's."""
    inputs, outputs = _client_io(values)
    pre = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
           "STOP_WORDS_DICT": "stop_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
           "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights", "END_ID": "end_id", "PAD_ID": "pad_id"}
    pre_out = {"REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "INPUT_ID": "_INPUT_ID",
               "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
               "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "EMBEDDING_BIAS": "_EMBEDDING_BIAS",
               "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID"}
    llm_in = {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
              "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_PREPROCESSOR_END_ID",
              "pad_id": "_PREPROCESSOR_PAD_ID", "embedding_bias": "_EMBEDDING_BIAS",
              "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS",
              "exclude_input_in_output": "exclude_input_in_output", "runtime_top_k": "top_k",
              "runtime_top_p": "top_p", "temperature": "temperature", "len_penalty": "length_penalty",
              "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
              "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
              "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
              "return_generation_logits": "return_generation_logits", "beam_width": "beam_width",
              "streaming": "stream"}
    llm_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
               "cum_log_probs": "cum_log_probs", "output_log_probs": "output_log_probs",
               "context_logits": "context_logits", "generation_logits": "generation_logits",
               "batch_index": "batch_index", "sequence_index": "sequence_index"}
    return {
        "name": names["ensemble"], "platform": "ensemble", "max_batch_size": int(values["triton_max_batch_size"]),
        "input": inputs, "output": outputs,
        "ensemble_scheduling": {"step": [
            {"model_name": names["preprocessing"], "model_version": -1, "input_map": _map(pre),
             "output_map": _map(pre_out)},
            {"model_name": names["tensorrt_llm"], "model_version": -1, "input_map": _map(llm_in),
             "output_map": _map(llm_out)},
            {"model_name": names["postprocessing"], "model_version": -1,
             "input_map": _map({"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"}),
             "output_map": _map({"OUTPUT": "text_output"})},
        ]},
    }


def bls_config(values: dict[str, str | None], *, name: str = "tensorrt_llm_bls") -> dict[str, Any]:
    inputs, outputs = _client_io(values)
    return {
        "name": name, "backend": "python", "max_batch_size": int(values["triton_max_batch_size"]),
        "model_transaction_policy": {"decoupled": values["decoupled_mode"] == "true"},
        "input": inputs, "output": outputs, "parameters": _params("tensorrt_llm_bls", values),
        "instance_group": [{"count": int(values["bls_instance_count"]), "kind": "KIND_CPU"}],
    }


def inflight_batcher_configs(values: dict[str, str | None],
                             names: dict[str, str] = DEFAULT_NAMES) -> dict[str, dict[str, Any]]:
    """The five configs of the set, keyed by template folder name."""
    if values.get("tensorrt_llm_model_name") != names["tensorrt_llm"]:
        values = {**values, "tensorrt_llm_model_name": names["tensorrt_llm"]}
    return {
        "preprocessing": preprocessing_config(values, name=names["preprocessing"]),
        "tensorrt_llm": tensorrt_llm_config(values, name=names["tensorrt_llm"]),
        "postprocessing": postprocessing_config(values, name=names["postprocessing"]),
        "ensemble": ensemble_config(values, names),
        "tensorrt_llm_bls": bls_config(values, name=names["tensorrt_llm_bls"]),
    }


def fill_template_commands(values: dict[str, str | None], templates_dir: str = "all_models/inflight_batcher_llm",
                           tool: str = "tools/fill_template.py") -> dict[str, list[str]]:
    """The equivalent upstream ``fill_template.py -i <model>/config.pbtxt k:v,...`` command per model."""
    used = {
        "preprocessing": ["tokenizer_dir", "add_special_tokens", "triton_max_batch_size",
                          "preprocessing_instance_count", "max_queue_delay_microseconds", "max_queue_size",
                          "engine_dir", "multimodal_model_path", "max_num_images", "hf_model_path"],
        "postprocessing": ["tokenizer_dir", "triton_max_batch_size", "postprocessing_instance_count",
                           "skip_special_tokens"],
        "ensemble": ["triton_max_batch_size", "logits_datatype"],
        "tensorrt_llm_bls": ["triton_max_batch_size", "decoupled_mode", "bls_instance_count", "accumulate_tokens",
                             "tensorrt_llm_model_name", "tensorrt_llm_draft_model_name", "logits_datatype",
                             "multimodal_encoders_name", "prompt_embedding_table_data_type"],
        "tensorrt_llm": ["triton_backend", "triton_max_batch_size", "decoupled_mode", "max_queue_delay_microseconds",
                         "max_queue_size", "encoder_input_features_data_type", "logits_datatype",
                         "prompt_embedding_table_data_type",
                         *sorted(set(MODEL_PARAMETERS["tensorrt_llm"].values()))],
    }
    out = {}
    for model, keys in used.items():
        pairs = ",".join(f"{k}:{values[k]}" for k in keys if values.get(k) is not None)
        out[model] = ["python3", tool, "-i", f"{templates_dir}/{model}/config.pbtxt", pairs]
    return out


def _copy_model_sources(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise RepositoryError(f"backend_models_dir: {src} is missing (expected TensorRT-LLM's "
                              "triton_backend/all_models/inflight_batcher_llm/<model>/1)")
    shutil.copytree(src, dst, dirs_exist_ok=True)


def write_inflight_batcher_repository(root: Path, values: dict[str, str | None], *,
                                      names: dict[str, str] = DEFAULT_NAMES,
                                      backend_models_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """Write the five models (config.pbtxt + ``1/``) under ``root``; return their configs.

    With ``backend_models_dir`` (TensorRT-LLM's ``triton_backend/all_models/inflight_batcher_llm``) the
    python models' ``1/`` folders are copied from there; without it only configs are written.
    """
    root = init_repository(root)
    configs = inflight_batcher_configs(values, names)
    for template, config in configs.items():
        model_dir = root / config["name"]
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        if backend_models_dir is not None and template in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
            _copy_model_sources(Path(backend_models_dir) / template / "1", model_dir / "1")
        write_atomic(model_dir / "config.pbtxt", to_pbtxt(config))
    return configs


# ---------------------------------------------------------------- gray-release layout


def trtllm_model_name(name: str, version: int) -> str:
    """The ``tensorrt_llm`` backend model holding engine ``version`` behind router ``name``."""
    return f"{name}_trtllm_v{version}"


def _rename_into_place(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError as exc:
        raise RepositoryError(f"cannot rename {tmp} to {final}: {exc}") from exc


def stage_trtllm_version(
    root: Path,
    name: str,
    artifact_dir: Path,
    *,
    target_toolchain: dict[str, Any] | None = None,
    version: int | None = None,
    repository_mount: str | None = None,
    max_queue_delay_us: int = 2000,
    max_queue_size: int = 64,
    link: bool = True,
    verify: bool = True,
) -> int:
    """Stage a TensorRT-LLM artifact as the model ``<name>_v<version>`` (default: the next version).

    Refuses (``TrtllmToolchainMismatchError``, both sides named) an artifact whose recorded toolchain
    does not match ``target_toolchain`` (default: detected here with ``current_toolchain()``).
    ``repository_mount`` is the repository's path inside the Triton container (default: ``root``): the
    engine path written into the ``tensorrt_llm`` config is absolute.
    Its device kind is ``cpu``: the adapter and the LLM-API model place their work on GPUs themselves.
    """
    from serving.trtllm.artifacts import read_artifact, verify_artifact
    from serving.trtllm.options import TrtllmOptions
    from serving.trtllm.toolchain import check_trtllm_toolchain, current_toolchain

    root = init_repository(root)
    artifact = verify_artifact(artifact_dir) if verify else read_artifact(artifact_dir)
    options = TrtllmOptions.from_mapping({**artifact.meta["options"], "kind": artifact.kind})
    check_trtllm_toolchain(artifact.toolchain, target_toolchain or current_toolchain(), kind=artifact.kind,
                           uses_fp8=options.uses_fp8)
    version = next_version(root, name, version)
    mount = Path(repository_mount) if repository_mount else root
    sidecar: dict[str, Any] = {
        "kind": artifact.kind, "fingerprint": artifact.fingerprint, "toolchain": artifact.toolchain,
        "max_batch_size": int(artifact.limits["max_batch_size"]), "max_input_len": int(artifact.limits["max_input_len"]),
        "max_seq_len": int(artifact.limits["max_seq_len"]), "special_tokens": artifact.special_tokens,
        "uses_fp8": options.uses_fp8, "source": str(Path(artifact_dir).resolve()), "staged_at": time.time(),
        # the adapter and the LLM-API model place their work on GPUs themselves, and answer in `execute`:
        # Triton's dynamic batcher gives them their batches
        "dynamic_batching": True,
        "settings": {**DEFAULT_SETTINGS, "device_kind": "cpu", "max_queue_size": max_queue_size,
                     "max_queue_delay_us": max_queue_delay_us},
    }
    created: list[Path] = []
    try:
        if artifact.kind == "trtllm-engine":
            target = trtllm_model_name(name, version)
            if (root / target).exists():
                raise RepositoryError(f"model folder {root / target} already exists")
            tmp_target = root / f"{STAGING_PREFIX}{target}-{secrets.token_hex(4)}"
            created.append(tmp_target)
            place_tree(Path(artifact_dir) / "engine", tmp_target / "1" / "engine", link=link)
            values = template_values(options, engine_dir=str(mount / target / "1" / "engine"),
                                     tokenizer_dir=str(mount / engine_model_name(name, version) / "1" / "tokenizer"),
                                     max_queue_delay_us=max_queue_delay_us, max_queue_size=max_queue_size)
            (tmp_target / "config.pbtxt").write_text(to_pbtxt(tensorrt_llm_config(values, name=target)))
            _rename_into_place(tmp_target, root / target)
            created[-1] = root / target
            sidecar.update(target_model=target, decoupled=options.decoupled_mode, input_in_output=False)
            model_source, payload = MODELS_DIR / "trtllm_adapter.py", {"tokenizer": Path(artifact_dir) / "tokenizer"}
        else:
            model_source, payload = MODELS_DIR / "trtllm_llmapi.py", {"artifact": Path(artifact_dir)}
        stage_version_model(root, name, version, model_source=model_source, payload=payload, sidecar=sidecar,
                            link=link)
    except BaseException:
        for path in created:
            shutil.rmtree(path, ignore_errors=True)
        raise
    if not served_versions(root, name):
        set_served_versions(root, name, [version])
    return version


def remove_trtllm_model(control: Any, root: Path, name: str, version: int, *, timeout_s: float = 60.0) -> None:
    """Unload and delete ``<name>_trtllm_v<version>`` (after its adapter version was removed)."""
    target = trtllm_model_name(name, version)
    if control is not None:
        control.unload_model(target, timeout_s=timeout_s)
    path = Path(root) / target
    if path.is_dir():
        aside = path.parent / f".removing-{target}-{secrets.token_hex(4)}"
        os.rename(path, aside)
        shutil.rmtree(aside)
