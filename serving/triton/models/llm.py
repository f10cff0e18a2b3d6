"""The ``llm`` Triton python-backend model: one engine version, served as a Triton model of its own.

Copied into the repository as ``<name>_v<N>/1/model.py`` beside ``1/engine/`` (the engine files): one Triton model per engine version.
``initialize`` loads the engine on the instance's device (KIND_GPU -> cuda, else cpu) and raises with
the model name if it cannot; ``execute`` parses each request (``serving.triton.models.requests``) and hands
it to the engine (in flight through the intake thread, below), answering a bad one with an error response,
never by raising. Text is
tokenized/detokenized lazily with ``tokenizers`` from the engine folder.

Stopping and text (``serving.triton.models.text``, read once at load): the engine folder's
``generation_config.json`` ``eos_token_id`` ends every request by default (``finish_reason`` "stop"),
besides the request's ``stop_token_ids``; ``ignore_eos`` turns that off. ``messages`` (a JSON chat) is
rendered with the folder's chat template (``serving.triton.models.chat``). Stop strings (``stop``) are
matched on the text with special tokens; the text returned never holds the stopping token or string,
and the ids end with the token that stopped it. Every final response carries ``prompt_tokens``.

Two kinds, chosen by the config (``model_transaction_policy { decoupled: true }``, written by
``llm_config`` when the parameter ``decoupled`` is "true"), both batching in flight:

- decoupled: responses go out as the tokens come (``stream`` true) or once; called over gRPC streaming,
  ``/generate`` or decoupled BLS.
- plain (HTTP ``/infer`` and plain BLS work): one FINAL response a request, sent through its response
  sender (the python backend allows that for a non-decoupled model whose ``execute`` returns None).
  ``in_flight`` "false" is the static path instead: Triton's dynamic batcher hands ``execute`` a batch,
  which runs one batched ``runner.generate`` per compatible group (greedy requests share one call) and
  returns one response per request, so a request waits for the slowest of its batch and for the batch
  before it (and Triton 2.51's batcher, which splits batches where the requests' optional inputs differ,
  could leave requests queued behind such a split for 0.5 s while the instance was busy).

In flight, an ``EngineThread`` owns the runner and runs
``serving.engine.scheduler.Scheduler``; ``execute`` reads each request's inputs and queues it for the intake
thread (``serving.triton.models.intake``), which hands it to the scheduler between the engine's launches with a
callback that answers through the request's response sender: with ``stream`` true the new tokens
(``output_ids`` [1, k]), the last response flagged FINAL and carrying ``finish_reason``; otherwise one
FINAL response with every token. Responses are built and sent (``outbox.Outbox.send_next``) by the
engine thread itself, while it waits for the GPU and whenever it is idle, so no sender thread
competes with it for the GIL; a stream's tokens that wait meanwhile go out together in its next
response (k > 1 under load, 1 otherwise). ``execute`` returns at once. Startup errors of the
thread (engine load, warm-up, graph capture) are carried back and raised by ``initialize``; a
request that fails gets a TritonError response; ``finalize`` stops the intake and the scheduler (queued and
pending requests get an error) and joins their threads. Parameters: ``load_priority`` (default "idle": the engine's load, torch's import included, runs on a thread of Linux's
idle CPU policy, so a version loading beside a live one takes only the cores the live one leaves:
``serving.triton.models.load_priority``), ``warmup`` ("false" to skip
capturing graphs and running the first, cold prefills at load; on a CPU none run: a SmolLM2 engine's cost 3.1 s
of CPU a load there and its first request was no faster for it), ``gil_switch_interval_ms`` (default
0.5: how long another Python thread, such as the one running ``execute``, may hold the GIL while the
engine thread waits for it), ``exclusive_launch`` (default "true": on CUDA the request intake waits while
the engine thread launches a step, instead of making each of its launches wait for the GIL, and steps
aside between two requests when a launch waits; ``SchedulerLoop.launching``), ``execute_waits_launches``
(default "false": "true" makes ``execute`` itself wait while a step launches before it reads its requests,
so Triton's thread takes no interpreter time from a launch either, and arrivals queue in Triton meanwhile),
``stream_interval_ms`` (default 0: the least time between two middle responses of one stream; the
first and the final response are never held back; see ``outbox``), ``idle_senders`` (default one per
four CPUs, 1 to 4: how many threads send at once while the engine is idle, such as the final responses of requests
that ended together; see ``outbox``), ``busy_senders`` (default as ``idle_senders``: how many threads send
while a step computes on the GPU, for engines whose streams outpace one sender; see ``outbox``), ``admit_gap_ms`` (default 3: an idle engine admits a burst of
arriving requests once none has come for this long, so the burst is prefilled together; 0 admits
at once; see ``serving.engine.scheduler``), ``admit_every_steps`` (default 8: while requests are live,
waiting ones are admitted, in one prefill, at most once every this many decode steps, unless they
outnumber the live ones; see ``serving.engine.scheduler``), ``prefix_caching`` ("true" / "false": the engine's
prefix caching for this load, whatever its build says; unset or "auto": as built), ``cuda_alloc_conf`` (PyTorch's
``PYTORCH_CUDA_ALLOC_CONF`` for this model's process, e.g. "expandable_segments:True"), ``max_queue_size``
(written by ``llm_config`` from the release's ``triton.max_queue_size``: requests waiting for admission at
most, more are refused as an overload that clients retry; a model in flight has no dynamic batcher).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from serving.engine.heap import freeze_heap
from serving.triton.models.intake import Full, Intake
from serving.triton.models.load_priority import load_at_priority
from serving.triton.models.outbox import Outbox
from serving.triton.models.params import (
    QUEUE_SIZE_PARAMETER,
    batches_in_flight,
    check_parameters,
    choice,
    count,
    cuda_alloc_conf,
    flag,
    milliseconds,
    queue_size,
    speculative,
)
from serving.triton.models.request_timing import FirstTokenTimes, IntakeStats
from serving.triton.models.requests import (
    INVALID_REQUEST,
    BatchItem,
    LlmRequest,
    RequestError,
    check_limits,
    check_text_size,
    check_vocab,
    parse_request,
    plan_batches,
)
from serving.triton.models.text import EngineText, TextStream, read_engine_text, stop_ids_for

try:  # only present inside Triton's python backend; unit tests install a fake module
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - exercised outside Triton
    pb_utils = None

ENGINE_OPTION_PARAMETERS = ("decode_gemm",)  # passed to the loader as `overrides`
DEFAULT_ENGINE_LOADER = "serving.engine.runner:load_engine"


def resolve(spec: str) -> Callable[..., Any]:
    """``"package.module:attr"`` -> the attribute (used for the ``engine_loader`` parameter)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"parameter engine_loader={spec!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(module_name), attr)


def config_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    """The ``parameters`` map of a model config as plain strings."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


class Log:
    """Log lines prefixed with the model name and version (Triton's logger when available)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._logger = getattr(pb_utils, "Logger", None)

    def info(self, msg: str) -> None:
        if self._logger is not None:
            self._logger.log_info(f"[{self.prefix}] {msg}")
        else:
            print(f"[{self.prefix}] {msg}", flush=True)

    def verbose(self, msg: str) -> None:
        if self._logger is not None:
            self._logger.log_verbose(f"[{self.prefix}] {msg}")

    def error(self, msg: str) -> None:
        if self._logger is not None:
            self._logger.log_error(f"[{self.prefix}] {msg}")
        else:
            print(f"[{self.prefix}] ERROR {msg}", flush=True)


def engine_sampling(req: LlmRequest) -> Any:
    """The engine's ``SamplingParams`` for a request, ``None`` for plain greedy."""
    s = req.sampling
    if s.is_greedy and not s.shapes_logits:
        return None
    from serving.engine import SamplingParams  # lazy: the engine package imports torch

    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                          presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                          repetition_penalty=s.repetition_penalty, logit_bias=s.logit_bias, min_tokens=s.min_tokens)


class EngineHost:
    """Owns the engine runner and the tokenizer; runs planned batches synchronously."""

    def __init__(self, runner: Any, engine_dir: Path, log: Log, text: EngineText) -> None:
        self.runner = runner
        self.engine_dir = engine_dir
        self.text = text
        self.has_tokenizer = (engine_dir / "tokenizer.json").is_file()
        self.log = log
        limits = runner.info.limits
        self.max_batch_size = int(limits.max_batch_size)
        self.max_input_len = int(limits.max_input_len)
        self.max_seq_len = int(limits.max_seq_len)
        vocab = getattr(getattr(runner.info, "model", None), "vocab_size", None)
        self.vocab_size = int(vocab) if vocab else None
        self._tokenizer: Any = None
        self.executions = 0
        self.largest_batch = 0

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            path = self.engine_dir / "tokenizer.json"
            if not path.is_file():
                raise RequestError(f"text input/output needs {path.name} in the engine folder, and this engine has none")
            from tokenizers import Tokenizer  # lazy: not importable at module import in serving/

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def prompt_ids(self, req: LlmRequest) -> tuple[int, ...]:
        if req.prompt_ids is not None:
            return req.prompt_ids
        if req.messages is not None:
            return self.chat_ids(req.messages)
        check_text_size(req.text or "", max_input_len=self.max_input_len)  # before any tokenizing
        # encode_batch releases the GIL while it tokenizes (encode does not): the engine thread runs meanwhile
        ids = tuple(self.tokenizer.encode_batch([req.text or ""])[0].ids)
        if not ids:
            raise RequestError("input 'text_input' tokenizes to no tokens")
        return ids

    def chat_ids(self, messages_json: str) -> tuple[int, ...]:
        """A chat's prompt: the engine's chat template with the assistant's turn opened, tokenized
        without added special tokens (the template writes them), as HF's apply_chat_template does."""
        from serving.triton.models.chat import parse_messages, render_chat

        messages = parse_messages(messages_json)
        if self.text.chat_template is None:
            raise RequestError("input 'messages' needs a chat template, and this engine has none (chat_template.jinja, "
                               "or chat_template in tokenizer_config.json, in its folder): send 'text_input' instead")
        prompt = render_chat(self.text.chat_template, messages, self.text.special_tokens)
        return tuple(self.tokenizer.encode_batch([prompt], add_special_tokens=False)[0].ids)

    def text_stream(self, req: LlmRequest) -> TextStream | None:
        """The request's detokenizer and stop-string matcher, when it wants text or has stop strings."""
        text_possible = req.text is not None or self.has_tokenizer  # an id-only engine answers ids alone
        if not ((req.want_text and text_possible) or req.stop_strings):
            return None
        return TextStream(self.tokenizer, special_ids=self.text.special_ids, stop_ids=req.stop_token_ids,
                          stop_strings=req.stop_strings)

    def run(self, batch: list[BatchItem], reqs: dict[int, LlmRequest]) -> dict[int, tuple[list[int], str]]:
        """One ``generate`` call for a planned batch -> {request index: (new token ids, finish reason)}."""
        first = reqs[batch[0].index]
        max_new = max(item.max_tokens for item in batch)
        gens = self.runner.generate([list(item.prompt_ids) for item in batch], max_new_tokens=max_new,
                                    sampling=engine_sampling(first), stop_token_ids=first.stop_token_ids)
        self.executions += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        out: dict[int, tuple[list[int], str]] = {}
        for item, gen in zip(batch, gens):
            ids = list(gen.token_ids)
            reason = str(getattr(gen, "finish_reason", "length"))
            if len(ids) > item.max_tokens:
                ids, reason = ids[: item.max_tokens], "length"
            out[item.index] = (ids, reason)
        return out

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if callable(close):
            close()
        self.runner = None


def _error_response(message: str, *, invalid_arg: bool = False, cancelled: bool = False,
                    unavailable: bool = False) -> Any:
    """An error response; a rejected request gets INVALID_ARG (HTTP 400), a cancelled one CANCELLED, one
    refused for a full queue UNAVAILABLE (503; its words make it an overload), anything else INTERNAL (500)."""
    code = (getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid_arg
            else getattr(pb_utils.TritonError, "CANCELLED", None) if cancelled
            else getattr(pb_utils.TritonError, "UNAVAILABLE", None) if unavailable else None)
    if invalid_arg:
        message = f"{INVALID_REQUEST}: {message}"
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _requested_outputs(request: Any) -> tuple[str, ...]:
    names = getattr(request, "requested_output_names", None)
    return tuple(names()) if callable(names) else ()


def _getter(request: Any) -> Callable[[str], np.ndarray | None]:
    def get(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return get


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request ``execute`` read and queued for the intake thread: its inputs as Python values (the request's
    tensors are freed when ``execute`` returns), where its responses go, and when Triton handed it over."""

    request: Any  # the pb_utils request: asked later whether its client cancelled it
    sender: Any
    req: LlmRequest
    received: float  # monotonic


def allocator_counters() -> str:
    """The CUDA caching allocator's counters that reveal synchronizing work: cudaMalloc retries after freeing
    its cache, and the device allocations and frees it made."""
    import torch  # lazy: only a CUDA engine asks

    stats = torch.cuda.memory_stats()
    names = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
    return ", ".join(f"{name}={stats.get(name, 0)}" for name in names)


class EngineThread:
    """The engine loop on its own thread: warm up (the first steps' kernels, the decode graphs), then the
    scheduler forever."""

    def __init__(self, runner: Any, log: Log, *, device_id: int | None, warmup: bool,
                 while_waiting: Callable[[], bool] | None = None, drain: Callable[[], None] | None = None,
                 work_while: Callable[[Callable[[], bool]], None] | None = None, admit_gap_s: float = 0.0,
                 admit_every_steps: int = 1, exclusive_launch: bool = True,
                 max_queue_size: int | None = None) -> None:
        self.runner = runner
        self.max_queue_size = max_queue_size
        self.exclusive_launch = exclusive_launch
        self.admit_every_steps = admit_every_steps
        self.admit_gap_s = admit_gap_s
        self.while_waiting = while_waiting
        self.drain = drain
        self.work_while = work_while
        self.log = log
        self.device_id = device_id
        self.warmup = warmup
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.scheduler: Any = None
        self.thread = threading.Thread(target=self._main, name=f"engine-{log.prefix}", daemon=True)

    def start(self, timeout_s: float = 900.0) -> None:
        """Start the thread and wait until it serves; re-raise its startup error here."""
        self.thread.start()
        if not self.ready.wait(timeout_s):
            raise RuntimeError(f"engine thread not ready after {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error

    def _main(self) -> None:
        try:
            if self.device_id is not None:
                import torch  # lazy: the engine's load imported it

                torch.cuda.set_device(self.device_id)
            started = time.monotonic()
            if self.warmup and self.runner.device.type == "cuda":  # a CPU has no kernels to compile, no graphs
                self.runner.warm_up_prefill()
            self.scheduler = self.runner.scheduler(
                on_error=self.log.error, while_waiting=self.while_waiting, drain=self.drain,
                admit_gap_s=self.admit_gap_s, admit_every_steps=self.admit_every_steps)
            self.scheduler.work_while = self.work_while
            self.scheduler.exclusive_launch = self.exclusive_launch
            if self.max_queue_size is not None:
                self.scheduler.limit_waiting(self.max_queue_size, QUEUE_SIZE_PARAMETER)
            self.log.info(f"engine thread ready in {time.monotonic() - started:.2f} s (warmup={self.warmup} on "
                          f"{self.runner.device.type}, "
                          f"admit_every_steps={self.admit_every_steps})")
        except BaseException as exc:  # noqa: BLE001 - carried back to initialize
            self.error = exc
            self.ready.set()
            return
        freeze_heap()  # the loaded model out of the full collections' walk (serving.engine.heap)
        self.ready.set()
        self.scheduler.run_forever()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.scheduler is not None:
            self.scheduler.stop(timeout_s=0)
        self.thread.join(timeout_s)


class TritonPythonModel:
    """Triton entry points for one instance of one engine version."""

    def initialize(self, args: dict[str, str]) -> None:
        self.model_name = args["model_name"]
        self.version = args.get("model_version", "?")
        self.tag = f"{self.model_name} v{self.version}"  # what every error message and log line is prefixed with
        self.log = Log(self.tag)
        config = json.loads(args["model_config"])
        params = config_parameters(config)
        try:
            check_parameters(params)
        except ValueError as exc:
            raise RuntimeError(f"[{self.model_name} v{self.version}] {exc}") from exc
        engine_dir = Path(args["model_repository"]) / str(self.version) / "engine"
        device = params.get("device") or ("cuda" if args.get("model_instance_kind") == "GPU" else "cpu")
        alloc_conf = cuda_alloc_conf(params)
        if alloc_conf is not None:  # read when CUDA first allocates in this (the model's own) process
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
        # Read when torch loads OpenMP, below (the model file does not import torch). The engine shares the host's
        # cores with Triton and the other models: an OpenMP worker that spins while it waits for the next parallel
        # region takes a core from all of them (docs/triton.md: the demo's candidate at 1.7x the live version's
        # time per token on two cores).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        device_id = int(args.get("model_instance_device_id", "0")) if device == "cuda" else None
        if device_id is not None:
            import torch  # lazy: only GPU instances pick a device

            torch.cuda.set_device(device_id)
        started = time.monotonic()
        # the parameters that are engine options (`serving.engine.options.EngineOptions`), for the loader to resolve
        overrides: dict[str, Any] = {name: value for name in ENGINE_OPTION_PARAMETERS
                                     if (value := choice(params, name))}
        if (drafting := speculative(params)) is not None:
            overrides["speculative"] = drafting
        options: dict[str, Any] = {"overrides": overrides} if overrides else {}
        if (prefix_caching := choice(params, "prefix_caching")) in ("true", "false"):
            options["prefix_caching"] = prefix_caching == "true"
        load_priority = choice(params, "load_priority") or "idle"

        def load() -> Any:
            if device_id is not None:  # the current device is the thread's own
                import torch

                torch.cuda.set_device(device_id)
            loader = resolve(params.get("engine_loader") or DEFAULT_ENGINE_LOADER)  # imports torch on a CPU
            return loader(engine_dir, device=device, **options)

        try:
            runner = load_at_priority(load, priority=load_priority, name=f"{self.tag} load", log=self.log.error)
        except Exception as exc:
            raise RuntimeError(
                f"[{self.model_name} v{self.version}] cannot load the engine in {engine_dir} on device "
                f"{device!r}: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            text = read_engine_text(engine_dir)
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"[{self.model_name} v{self.version}] cannot read the engine folder's tokenizer "
                               f"and generation settings: {exc}") from exc
        self.host = EngineHost(runner, engine_dir, self.log, text)
        self.token_bytes: Any = None  # logprob_output.TokenBytes, made by the first request asking for log-probs
        uses_decoupled = getattr(pb_utils, "using_decoupled_model_transaction_policy", None)
        self.decoupled = bool(uses_decoupled(config)) if callable(uses_decoupled) else flag(params, "decoupled")
        self.in_flight = batches_in_flight(params, decoupled=self.decoupled)
        self.serves_extras = self.in_flight  # `requests.EXTRA_INPUT_NAMES`: served by the in-flight scheduler
        self.execute_waits_launches = flag(params, "execute_waits_launches")
        self.engine_thread: EngineThread | None = None
        self.outbox: Outbox | None = None
        self.intake: Intake[Arrival] | None = None
        self.intake_stats = IntakeStats()
        self.first_tokens = FirstTokenTimes()
        if self.in_flight:
            # without a short switch interval another thread can hold the GIL for 5 ms (CPython's
            # default) while the engine thread waits to launch the next step
            sys.setswitchinterval(milliseconds(params, "gil_switch_interval_ms") / 1e3)
            self.outbox = Outbox(f"{self.model_name}-v{self.version}", self.log.error,
                                 stream_interval_s=milliseconds(params, "stream_interval_ms") / 1e3,
                                 idle_senders=count(params, "idle_senders"),
                                 busy_senders=count(params, "busy_senders"))
            self.engine_thread = EngineThread(runner, self.log, device_id=device_id,
                                              warmup=flag(params, "warmup"),
                                              while_waiting=self.outbox.send_next, drain=self.outbox.drain,
                                              work_while=(self.outbox.send_while
                                                          if self.outbox.busy_senders > 1 else None),
                                              admit_gap_s=milliseconds(params, "admit_gap_ms") / 1e3,
                                              admit_every_steps=count(params, "admit_every_steps"),
                                              exclusive_launch=flag(params, "exclusive_launch"),
                                              max_queue_size=queue_size(params))
            try:
                self.engine_thread.start()
            except BaseException as exc:
                raise RuntimeError(f"[{self.model_name} v{self.version}] engine thread failed to start: "
                                   f"{type(exc).__name__}: {exc}") from exc
            scheduler = self.engine_thread.scheduler
            self.intake = Intake(self._submit, self._refuse, between_launches=scheduler.between_launches,
                                 launch_waits=scheduler.launch_waits, on_error=self.log.error,
                                 name=f"{self.model_name}-v{self.version}", limit=queue_size(params),
                                 limit_setting=QUEUE_SIZE_PARAMETER)
            self.intake.start()
        self.log.info(
            f"engine {getattr(runner.info, 'fingerprint', '?')} loaded from {engine_dir} on {device} in "
            f"{time.monotonic() - started:.2f} s (load_priority={load_priority}, "
            f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, max_batch_size={self.host.max_batch_size}, "
            f"max_input_len={self.host.max_input_len}, max_seq_len={self.host.max_seq_len}, "
            f"decoupled={self.decoupled}, in_flight={self.in_flight}, eos_token_ids={list(text.eos_token_ids)}, "
            f"chat_template={text.chat_template_source or 'none'})"
        )

    def _parse(self, index: int, request: Any) -> tuple[LlmRequest, BatchItem]:
        return self._prepare(index, parse_request(_getter(request), _requested_outputs(request)))

    def _prepare(self, index: int, req: LlmRequest) -> tuple[LlmRequest, BatchItem]:
        """A parsed request against this engine: its stop ids, prompt ids (tokenized or rendered) and limits."""
        req = dataclasses.replace(req, stop_token_ids=stop_ids_for(req.stop_token_ids, self.host.text.eos_token_ids,
                                                                   ignore_eos=req.ignore_eos))
        extra = req.extra_input()
        if extra is not None and not self.serves_extras:
            raise RequestError(f"input {extra!r} is served by engines batching in flight; "
                               "this one has in_flight false")
        ids = self.host.prompt_ids(req)
        check_limits(ids, req.max_tokens, max_input_len=self.host.max_input_len,
                     max_seq_len=self.host.max_seq_len, vocab_size=self.host.vocab_size)
        if self.host.vocab_size is not None:
            check_vocab(req, self.host.vocab_size)
        return req, BatchItem(index, ids, req.max_tokens, req.group_key())

    def _response(self, req: LlmRequest, item: BatchItem, ids: list[int], reason: str) -> Any:
        """A plain request's one response: stop strings applied to the whole generation."""
        text = ""
        stream = self.host.text_stream(req)
        if stream is not None:
            keep = stream.add(ids)
            if keep is not None:
                ids, reason = ids[:keep], "stop"
            text = stream.take(final=True)
        return pb_utils.InferenceResponse(output_tensors=self._tensors(req, ids, reason, text, len(item.prompt_ids)))

    def _tensors(self, req: LlmRequest, ids: list[int], reason: str, text: str, prompt_tokens: int,
                 logprobs: str | None = None) -> list[Any]:
        """A response's tensors: `finish_reason` and `prompt_tokens` only on the final one (a BYTES tensor
        costs the sender more than the token ids), the text when the request wants it, the log-probs (JSON)
        when it asked for them."""
        tensors = [pb_utils.Tensor("output_ids", np.asarray([ids], dtype=np.int32))]
        if logprobs is not None:
            tensors.append(pb_utils.Tensor("output_logprobs", np.asarray([[logprobs.encode()]], dtype=np.object_)))
        if reason:
            tensors.append(pb_utils.Tensor("finish_reason", np.asarray([[reason.encode()]], dtype=np.object_)))
            tensors.append(pb_utils.Tensor("prompt_tokens", np.asarray([[prompt_tokens]], dtype=np.int32)))
        if req.want_text and (req.text is not None or self.host.has_tokenizer):
            tensors.append(pb_utils.Tensor("text_output", np.asarray([[text.encode("utf-8")]], dtype=np.object_)))
        return tensors

    def _or_answered(self, sender: Any, work: Callable[[], Any]) -> Any:
        """`work()`, or None once its failure is answered on `sender`: a RequestError as an invalid argument
        (HTTP 400), anything else as an internal error (500); never raised (one request never stops the rest)."""
        try:
            return work()
        except RequestError as exc:
            sender.send(_error_response(f"{self.tag}: {exc}", invalid_arg=True),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # noqa: BLE001
            self.log.error(f"request: {type(exc).__name__}: {exc}")
            sender.send(_error_response(f"{self.tag}: internal error: {exc}"),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _queue(self, request: Any, received: float) -> None:
        """In flight, on Triton's thread: read one request and queue it for the intake; answer a malformed one."""
        sender = request.get_response_sender()
        req = self._or_answered(sender, lambda: parse_request(_getter(request), _requested_outputs(request)))
        if req is None:
            return
        try:
            self.intake.put(Arrival(request, sender, req, received))
        except (Full, RuntimeError) as exc:  # overloaded or unloading: the client may retry elsewhere or later
            sender.send(_error_response(f"{self.tag}: {exc}", unavailable=True),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _refuse(self, arrival: Arrival, message: str) -> None:
        """A queued request the intake will not start (unloading) gets its error."""
        arrival.sender.send(_error_response(f"{self.tag}: {message}", unavailable=True),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _submit(self, arrival: Arrival) -> None:
        """In flight, on the intake thread: hand one request to the scheduler; answer errors on its sender."""
        from serving.engine.scheduler import (
            GenRequest,
            RequestCancelled,
            SchedulerFull,
            SchedulerStopped,
        )

        started = time.perf_counter()
        request, sender, received = arrival.request, arrival.sender, arrival.received
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        tag = self.tag
        prepared = self._or_answered(sender, lambda: self._prepare(0, arrival.req))
        if prepared is None:
            return
        req, item = prepared
        extras = self._or_answered(sender, lambda: self._extras(req, item))
        if extras is None:
            return
        trail, token_mask = extras
        outbox = self.outbox
        text_stream = self.host.text_stream(req)
        prompt_tokens = len(item.prompt_ids)
        stopped = False  # by a stop string: the scheduler is told to drop the request, its failure ignored
        submitted: float | None = None  # monotonic: handed to the scheduler
        emitted: float | None = None  # its first token delivered by the engine
        answered = False  # its first response sent (one stream is never in two sends at once)

        def send_tokens(ids: list[int], reason: str | None, text: str) -> None:
            nonlocal answered
            tensors = self._tensors(req, ids, reason or "", text, prompt_tokens,
                                    trail.take(len(ids)) if trail is not None else None)
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=final if reason else 0)
            if not answered and submitted is not None and emitted is not None:
                answered = True
                self.first_tokens.add(received, submitted, emitted, time.monotonic())

        def send_error(message: str, cancelled: bool) -> None:
            sender.send(_error_response(message, cancelled=cancelled), flags=final)

        scheduler = self.engine_thread.scheduler

        def on_cancel() -> None:  # the client went away: free the slot (the failure is the final response)
            self.log.info(f"request {gen.request_id}: cancelled by its client")
            scheduler.cancel(gen)

        stream = outbox.open(send_tokens, send_error, streaming=req.stream,
                             is_cancelled=getattr(request, "is_cancelled", None), on_cancel=on_cancel)

        def emit(ids: list[int], reason: str | None) -> None:  # on the scheduler thread: detokenize, enqueue
            nonlocal stopped, emitted
            if stopped:
                return  # a step launched past the stop string
            if emitted is None:
                emitted = time.monotonic()
            text = ""
            if trail is not None:
                trail.emitted(ids)
            if text_stream is not None:
                keep = text_stream.add(ids)
                if keep is not None:
                    if reason is None:
                        stopped = True
                        scheduler.cancel(gen)  # frees its slot at the next step
                    if trail is not None:
                        trail.drop_last(len(ids) - keep)
                    ids, reason = ids[:keep], "stop"
                text = text_stream.take(final=reason is not None)
            outbox.emit(stream, ids, reason, text)

        def fail(exc: BaseException) -> None:
            if stopped:
                return  # the cancellation that ended a request stopped by a stop string
            if isinstance(exc, RequestCancelled):
                outbox.fail(stream, f"{tag}: {exc}", cancelled=True)
            else:
                outbox.fail(stream, f"{tag}: generate failed: {type(exc).__name__}: {exc}")

        if trail is None and token_mask is None:
            gen = GenRequest(list(item.prompt_ids), req.max_tokens, emit, fail, engine_sampling(req), req.stop_token_ids)
        else:
            gen = GenRequest(list(item.prompt_ids), req.max_tokens, emit, fail, engine_sampling(req),
                               req.stop_token_ids, token_mask=token_mask, top_logprobs=req.top_logprobs,
                               on_logprobs=trail.on_logprobs if trail is not None else None,
                               on_prompt_logprobs=(trail.on_prompt_logprobs
                                                   if trail is not None and req.prompt_logprobs else None))
        try:
            submitted = time.monotonic()
            scheduler.submit(gen)
        except (SchedulerFull, SchedulerStopped) as exc:  # overloaded (the OpenAI front's 429) or stopped (503)
            outbox.discard(stream)
            sender.send(_error_response(f"{tag}: {exc}", unavailable=True), flags=final)
        except Exception as exc:  # noqa: BLE001 - limits the parse did not catch, or stopping
            outbox.discard(stream)
            sender.send(_error_response(f"{tag}: {exc}", invalid_arg=True), flags=final)
        self.intake_stats.add(time.perf_counter() - started)

    def _extras(self, req: LlmRequest, item: BatchItem) -> tuple[Any, Any]:
        """The request's `LogprobTrail` (when it asked for log-probs) and token mask (for `guided_decoding`)."""
        trail = token_mask = None
        if req.wants_logprobs:
            from serving.triton.models.logprob_output import LogprobTrail, TokenBytes

            if self.token_bytes is None:
                self.token_bytes = TokenBytes(self.host.tokenizer)
            trail = LogprobTrail(item.prompt_ids, self.token_bytes, prompt=req.prompt_logprobs)
        if req.guided_decoding is not None:
            from serving.triton.models.guided import token_mask_for

            token_mask = token_mask_for(req.guided_decoding, self.host.tokenizer,
                                        self.host.vocab_size or self.host.tokenizer.get_vocab_size(),
                                        eos_ids=req.stop_token_ids or self.host.text.eos_token_ids,
                                        chat_template=self.host.text.chat_template)
        return trail, token_mask

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if getattr(self, "in_flight", False):
            received = time.monotonic()
            if getattr(self, "execute_waits_launches", False):  # Triton's thread reads no request while a step launches
                self.engine_thread.scheduler.wait_out_launch()
            for request in requests:
                self._queue(request, received)
            return None
        started = time.monotonic()
        responses: list[Any] = [None] * len(requests)
        reqs: dict[int, LlmRequest] = {}
        items: list[BatchItem] = []
        for i, request in enumerate(requests):
            try:
                reqs[i], item = self._parse(i, request)
                items.append(item)
            except RequestError as exc:
                responses[i] = _error_response(f"{self.model_name} v{self.version}: {exc}", invalid_arg=True)
            except Exception as exc:  # noqa: BLE001 - never crash the instance on one request
                self.log.error(f"request {i}: {type(exc).__name__}: {exc}")
                responses[i] = _error_response(f"{self.model_name} v{self.version}: internal error: {exc}")
        batches = plan_batches(items, max_batch_size=self.host.max_batch_size, max_seq_len=self.host.max_seq_len)
        for batch in batches:
            try:
                results = self.host.run(batch, reqs)
                for item in batch:
                    ids, reason = results[item.index]
                    responses[item.index] = self._response(reqs[item.index], item, ids, reason)
            except Exception as exc:  # noqa: BLE001 - a failed batch answers its requests
                self.log.error(f"generate failed for a batch of {len(batch)}: {type(exc).__name__}: {exc}")
                for item in batch:
                    responses[item.index] = _error_response(
                        f"{self.model_name} v{self.version}: generate failed: {type(exc).__name__}: {exc}")
        self.log.verbose(f"execute: {len(requests)} requests in {len(batches)} generate calls "
                         f"(sizes {[len(b) for b in batches]}) in {time.monotonic() - started:.3f} s")
        return responses

    def finalize(self) -> None:
        intake = getattr(self, "intake", None)
        if intake is not None:
            intake.stop()  # what is still queued gets its error; nothing new is taken
            self.intake_stats.turns = intake.turns
            self.intake = None
        engine_thread = getattr(self, "engine_thread", None)
        if engine_thread is not None:
            stats = getattr(engine_thread.scheduler, "stats", None)
            engine_thread.stop()
            self.log.info(f"engine thread joined (alive={engine_thread.thread.is_alive()}); scheduler {stats}")
            if engine_thread.device_id is not None:
                self.log.info(f"allocator: {allocator_counters()}")
            self.engine_thread = None
        outbox = getattr(self, "outbox", None)
        if outbox is not None:
            outbox.flush()  # the engine thread has stopped: whatever it had not sent yet
            outbox.close()
            self.log.info(f"responses sent: {outbox.stats}; intake: {self.intake_stats}; first tokens: {self.first_tokens.stats()}")
            self.outbox = None
        host = getattr(self, "host", None)
        if host is not None:
            self.log.info(f"finalize after {host.executions} generate calls (largest batch {host.largest_batch})")
            host.close()
            self.host = None
