"""Model configs (protobuf-JSON dicts) of the ``llm``, ``router`` and streaming router models.

The dicts are complete: the same dict is rendered to ``config.pbtxt`` and sent as a load override.
Every request input carries Triton's batch dim (``max_batch_size > 0``), so clients send ``[1, n]``;
``input_ids`` allows ragged batches so prompts of different lengths share one dynamic batch.
"""

from __future__ import annotations

from typing import Any

from serving.triton.errors import ConfigError
from serving.triton.models.params import QUEUE_SIZE_PARAMETER, batches_in_flight, check_parameters, flag
from serving.triton.models.routing_file import ROUTING_FILE, ROUTING_PARAMETER

# One request per call: the llm reads each input as one value (a batch of 2 is its INVALID_ARG), so a larger
# max_batch_size would declare what the engine refuses; Triton itself now refuses a batch of 2 with a 400.
ROUTER_MAX_BATCH_SIZE = 1
ROUTER_INSTANCES = 4  # each forwards any number of requests at once, each on a thread of its own
# Streams forwarded at once: one per instance. Two decoupled BLS calls of several responses each in one
# python stub can deadlock in the bundled python backend (`serving.triton.models.bls`).
STREAM_ROUTER_INSTANCES = 8


def _tensor(name: str, data_type: str, dims: list[int], *, optional: bool = False,
            ragged: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"name": name, "data_type": data_type, "dims": dims}
    if optional:
        t["optional"] = True
    if ragged:
        t["allow_ragged_batch"] = True
    return t


def llm_inputs() -> list[dict[str, Any]]:
    """Inputs of the llm model (the routers take the same, plus their own): one of ``input_ids`` and
    ``text_input``, ``max_tokens`` (required), the optional sampling settings."""
    return [
        _tensor("input_ids", "TYPE_INT32", [-1], optional=True, ragged=True),
        _tensor("text_input", "TYPE_STRING", [1], optional=True),
        _tensor("max_tokens", "TYPE_INT32", [1]),
        _tensor("temperature", "TYPE_FP32", [1], optional=True),
        _tensor("top_k", "TYPE_INT32", [1], optional=True),
        _tensor("top_p", "TYPE_FP32", [1], optional=True),
        _tensor("seed", "TYPE_INT64", [1], optional=True),
        _tensor("stop_token_ids", "TYPE_INT32", [-1], optional=True, ragged=True),
        _tensor("messages", "TYPE_STRING", [1], optional=True),  # a JSON chat, for the engine's chat template
        _tensor("stop", "TYPE_STRING", [-1], optional=True, ragged=True),  # stop strings
        _tensor("ignore_eos", "TYPE_BOOL", [1], optional=True),
        # served by in-flight paged engines (`serving.triton.models.requests`)
        _tensor("logprobs", "TYPE_BOOL", [1], optional=True),
        _tensor("top_logprobs", "TYPE_INT32", [1], optional=True),
        _tensor("prompt_logprobs", "TYPE_BOOL", [1], optional=True),
        _tensor("presence_penalty", "TYPE_FP32", [1], optional=True),
        _tensor("frequency_penalty", "TYPE_FP32", [1], optional=True),
        _tensor("repetition_penalty", "TYPE_FP32", [1], optional=True),
        _tensor("logit_bias_ids", "TYPE_INT32", [-1], optional=True, ragged=True),
        _tensor("logit_bias_values", "TYPE_FP32", [-1], optional=True, ragged=True),
        _tensor("min_tokens", "TYPE_INT32", [1], optional=True),
        _tensor("guided_decoding", "TYPE_STRING", [1], optional=True),  # a grammar (`guided.token_mask_for`)
    ]


def llm_outputs() -> list[dict[str, Any]]:
    return [
        _tensor("output_ids", "TYPE_INT32", [-1]),
        _tensor("text_output", "TYPE_STRING", [1]),
        _tensor("finish_reason", "TYPE_STRING", [1]),
        _tensor("prompt_tokens", "TYPE_INT32", [1]),
        _tensor("output_logprobs", "TYPE_STRING", [1]),  # JSON (`serving.triton.models.logprob_output`)
    ]


def _string_params(params: dict[str, str]) -> dict[str, dict[str, str]]:
    return {k: {"string_value": str(v)} for k, v in sorted(params.items())}


def llm_config(
    model_name: str,
    *,
    versions: list[int],
    max_batch_size: int,
    device_kind: str,
    max_queue_size: int = 64,
    max_queue_delay_us: int = 2000,
    instance_count: int = 1,
    parameters: dict[str, str] | None = None,
    dynamic_batching: bool | None = None,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """Complete config of an llm model serving ``versions`` (one engine version's model: ``[1]``).

    An engine of ``tensor_parallel`` N > 1 is one instance (rank 0, which starts ranks 1..N-1 as its own worker
    processes: ``serving.engine.parallel_workers``); on GPUs it owns GPUs 0..N-1, its instance placed on GPU 0
    (``gpus: [0]``; Triton would otherwise start one instance per GPU, each wanting N).

    ``parameters["decoupled"] == "true"`` makes it a decoupled model (responses streamed; adds the optional
    ``stream`` BOOL input). Decoupled models are called over gRPC streaming (``async_stream_infer``); BLS
    callers need ``exec(decoupled=True)``. Both kinds batch in flight on the model's engine thread unless
    ``parameters["in_flight"]`` is "false", and then have no dynamic batcher: ``max_queue_size`` is written as
    the parameter of that name, the engine's limit of requests waiting for admission (more are refused as an
    overload, which clients retry). Triton 2.51's dynamic batcher splits batches where the requests' optional
    inputs differ and could then leave the requests behind a split queued for 0.5 s; in flight it would only
    add its ``max_queue_delay_us``. The static path (``in_flight`` "false") keeps it: there it is the batching.
    ``dynamic_batching`` decides instead of the parameters where the model.py is not this package's llm (the
    TensorRT-LLM adapters answer in ``execute``: True).
    """
    if device_kind not in ("KIND_CPU", "KIND_GPU"):
        raise ConfigError(f"device_kind={device_kind!r} must be KIND_CPU or KIND_GPU")
    if not versions:
        raise ConfigError(f"model {model_name!r}: versions=[] would serve nothing")
    if max_batch_size < 1 or max_queue_size < 1:
        raise ConfigError(f"model {model_name!r}: max_batch_size={max_batch_size} and "
                          f"max_queue_size={max_queue_size} must be >= 1")
    params = dict(parameters or {})
    try:
        check_parameters(params)
    except ValueError as exc:
        raise ConfigError(f"model {model_name!r}: {exc}") from exc
    if tensor_parallel > 1 and instance_count != 1:
        raise ConfigError(f"model {model_name!r}: instance_count={instance_count} with an engine of tensor_parallel="
                          f"{tensor_parallel}: one instance drives all its ranks; set instance_count 1")
    decoupled = flag(params, "decoupled")
    batcher = not batches_in_flight(params, decoupled=decoupled) if dynamic_batching is None else dynamic_batching
    given = params.get(QUEUE_SIZE_PARAMETER)
    if given is not None and given != str(max_queue_size):
        raise ConfigError(f"model {model_name!r}: parameter {QUEUE_SIZE_PARAMETER}={given!r} is written from "
                          f"max_queue_size={max_queue_size} (a release's triton.max_queue_size): set that instead")
    if not batcher:
        params[QUEUE_SIZE_PARAMETER] = str(max_queue_size)
    config: dict[str, Any] = {
        "name": model_name,
        "backend": "python",
        "max_batch_size": max_batch_size,
        "input": llm_inputs() + ([_tensor("stream", "TYPE_BOOL", [1], optional=True)] if decoupled else []),
        "output": llm_outputs(),
        "instance_group": [{"kind": device_kind, "count": instance_count}
                           | ({"gpus": [0]} if tensor_parallel > 1 and device_kind == "KIND_GPU" else {})],
        "version_policy": {"specific": {"versions": sorted(versions)}},
        "parameters": _string_params(params),
    }
    if batcher:
        config["dynamic_batching"] = {
            "max_queue_delay_microseconds": max_queue_delay_us,
            "default_queue_policy": {"max_queue_size": max_queue_size},
        }
    if decoupled:
        config["model_transaction_policy"] = {"decoupled": True}
    return config


def check_weights(what: str, weights: dict[int, int]) -> None:
    """ConfigError naming ``what`` unless ``weights`` has versions >= 1, weights >= 0 and a positive sum."""
    if not weights or sum(weights.values()) <= 0 or any(w < 0 or v < 1 for v, w in weights.items()):
        raise ConfigError(f"{what}: weights={weights!r} need versions >= 1, weights >= 0, a positive sum")


def _router_params(*, target_model: str, seed: int | None) -> dict[str, str]:
    """The config parameters both routers share; the weights are in the routing file, not here."""
    params = {"target_model": target_model, ROUTING_PARAMETER: ROUTING_FILE}
    if seed is not None:
        params["seed"] = str(seed)
    return params


def router_config(
    name: str,
    *,
    target_model: str | None = None,
    max_batch_size: int = ROUTER_MAX_BATCH_SIZE,
    seed: int | None = None,
    instance_count: int = ROUTER_INSTANCES,
) -> dict[str, Any]:
    """Complete config of the router ``name``. It does not change with the weights (the routing file
    holds them, with ``target_decoupled``), so a weight change reloads nothing.

    No dynamic batching and several instances: a non-decoupled python model answers a batch only when its
    slowest request is done (an ``async`` execute runs in the background only for decoupled models, and
    decoupled models cannot be called over HTTP ``/infer``), so batching in the router made requests to the
    live version wait for a slow candidate (measured: live TTFT median 0.83 s beside a slow canary).
    Each instance forwards one request at a time; the llm's own dynamic batcher still groups the BLS calls.
    """
    params = _router_params(target_model=target_model or f"{name}_v{{version}}", seed=seed)
    return _router_model(name, params, max_batch_size=max_batch_size, instance_count=instance_count,
                         extra_inputs=[], extra_outputs=[])


def stream_router_config(name: str, *, target_model: str, counters_model: str,
                         seed: int | None = None) -> dict[str, Any]:
    """Complete config of the streaming router ``name`` (``<release>_stream``), decoupled, in front of the
    decoupled llm ``target_model``; it routes by, and counts into, the router ``counters_model``'s routing
    file and counter files. `STREAM_ROUTER_INSTANCES` instances, each forwarding one stream at a time."""
    params = _router_params(target_model=target_model, seed=seed)
    params["counters_model"] = counters_model
    config = _router_model(name, params, max_batch_size=ROUTER_MAX_BATCH_SIZE,
                            instance_count=STREAM_ROUTER_INSTANCES,
                           extra_inputs=[_tensor("stream", "TYPE_BOOL", [1], optional=True)], extra_outputs=[])
    config["model_transaction_policy"] = {"decoupled": True}
    return config


def _router_model(name: str, params: dict[str, str], *, max_batch_size: int, instance_count: int,
                  extra_inputs: list[dict[str, Any]], extra_outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """What both routers' configs share: the llm's inputs (all optional) plus ``extra_inputs`` and
    ``routing_key``, its outputs plus ``routed_version`` and ``extra_outputs``, CPU instances, version 1."""
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": max_batch_size,
        "input": llm_inputs() + [*extra_inputs, _tensor("routing_key", "TYPE_STRING", [1], optional=True)],
        "output": llm_outputs() + [_tensor("routed_version", "TYPE_INT32", [1]), *extra_outputs],
        "instance_group": [{"kind": "KIND_CPU", "count": instance_count}],
        "version_policy": {"specific": {"versions": [1]}},
        "parameters": _string_params(params),
    }
