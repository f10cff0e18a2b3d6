"""Load an engine folder and generate: batched prefill of unequal prompts, then a decode loop.

The engine speaks token ids, not text: prompts are lists of token ids and generations are lists of
token ids (the tokenizer files in the engine folder are for the caller).

`EngineRunner.generate` packs the prompts back to back and prefills them in one forward (per-prompt
causal attention, nothing spent on padding; prompt b goes into cache row b), then decodes one token
per step for the whole batch, each row at its own position (greedy without log-probs: on the
decode state in place, each step's graph picking the next tokens). On CUDA the decode step replays CUDA
graphs captured per (batch bucket, KV-length bucket) (`cuda_graphs.DecodeGraphs`), and attention
reads only the filled prefix of the cache; `compile_decode()` puts the step under torch.compile
first. On the CPU the same `decode_step` runs eagerly. The loop keeps tokens on the device and
syncs with the host only every `STOP_CHECK_EVERY` steps (when stop tokens are given) and at the end.
Requests with more prompts than `max_batch_size` are split into chunks of `max_batch_size` and run
one after the other. Not thread-safe: one runner serves one loop (`scheduler.Scheduler` for
in-flight batching drives the same pieces).

Imports: stdlib and torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.engine.build import EngineInfo, check_toolchain, read_engine_info
from serving.engine.convert import DTYPES
from serving.engine.decode_state import DecodeState
from serving.engine.errors import EngineFormatError, EngineLimitError
from serving.engine.model import Transformer, decode_step, packed_index, prefill_packed
from serving.engine.quantize import check_device as check_quantization_device
from serving.engine.quantize import install_quantized_linears
from serving.engine.sampling import SamplingParams, chosen_logprobs, sample

DecodeFn = Callable[[Transformer, torch.Tensor, torch.Tensor, int], torch.Tensor]
STOP_CHECK_EVERY = 8  # decode steps between host checks of "every row has stopped"


@dataclass
class Generation:
    """New tokens of one prompt (the stop token included when finish_reason == "stop")."""

    token_ids: list[int]
    logprobs: list[float]  # raw model log-prob of each chosen token
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per position, when requested
    finish_reason: str = "length"  # "length" | "stop"


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineLimitError(f"device={str(device)!r} requested but CUDA is not available here")
    return dev


class EngineRunner:
    """A loaded engine: weights on `device`, static KV caches sized by the engine's limits."""

    def __init__(self, info: EngineInfo, model: Transformer, device: torch.device, *,
                 cuda_graphs: bool = True) -> None:
        self.info = info
        self.model = model
        self.device = device
        self.decode_fn: DecodeFn = decode_step
        self.state = DecodeState.zeros(info.limits.max_batch_size, device)  # in-flight decode inputs
        self.graphs = None
        if device.type == "cuda" and cuda_graphs:
            from serving.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, state=self.state)

    # -- setup ------------------------------------------------------------------------------
    def compile_decode(self, mode: str = "auto", *, pdl: bool = True, **compile_kwargs) -> None:
        """Compile the decode step: on CUDA, graphs of the torch.compile'd step (`mode` "dynamic": one
        compile for all buckets; "static": one per bucket, tuned; "auto": batch 1 static for small
        models without tuned batch-1 kernels, the rest dynamic; `pdl`: with programmatic dependent
        launch; see `DecodeGraphs`); on the CPU, torch.compile(decode_step, dynamic=True, fullgraph=True)."""
        if self.graphs is not None:
            from serving.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, kv_block=self.graphs.kv_block, compile=mode, state=self.state,
                                       pdl=pdl)
            return
        kwargs = {"dynamic": True, "fullgraph": True, **compile_kwargs}
        self.decode_fn = torch.compile(decode_step, **kwargs)

    def eager_graphs(self) -> None:
        """Back to CUDA graphs of the eager decode step (after a compile failed)."""
        from serving.engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, kv_block=self.graphs.kv_block, state=self.state)

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, kv_needed: int) -> torch.Tensor:
        """One decode step of cache rows [0, len(tokens)) -> logits [b, V] (float32, or bf16 where the LM
        head's kernel wrote them); `kv_needed` must exceed every position. The result may be a view that the
        next call overwrites."""
        if self.graphs is not None:
            return self.graphs.step(tokens, input_pos, kv_needed)
        return self.decode_fn(self.model, tokens, input_pos, kv_needed)

    def decode_inplace(self, b: int, kv_needed: int) -> torch.Tensor:
        """One decode step of cache rows [0, b) on `self.state` as it stands -> logits [b, V] (as `decode`'s);
        afterwards the state holds each row's greedy next token and active rows' positions have moved
        on (`DecodeState.advance`). On CUDA one graph replay, no copies. Rows past b that the graph's
        batch bucket includes must be parked (position 0, not active)."""
        if self.graphs is not None:
            return self.graphs.replay(b, kv_needed)
        logits = self.decode_fn(self.model, self.state.tokens[:b], self.state.positions[:b], kv_needed)
        self.state.advance(logits.argmax(dim=-1))
        return logits

    def _load_rows(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Rows [0, len(tokens)) of the decode state start from `tokens` at `positions`, all active; every
        other row is parked (position 0, not active)."""
        self.state.reset()
        bsz = tokens.shape[0]
        self.state.tokens[:bsz].copy_(tokens)
        self.state.positions[:bsz].copy_(positions)
        self.state.active[:bsz].fill_(1)

    def prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[int]) -> torch.Tensor:
        """Prefill `prompts` into cache `rows` (packed, no padding) -> float32 last-token logits [N, V]."""
        index = packed_index(prompts, list(rows))
        if self.device.type == "cuda":
            index = index.pin_memory().to(self.device, non_blocking=True)
        return prefill_packed(self.model, index, [len(p) for p in prompts])

    @torch.no_grad()
    def warm_up_prefill(self, typical_len: int = 128) -> list[tuple[int, int]]:
        """Run, before serving, the prefills a first burst of requests would run cold: a full batch of
        `typical_len`-token prompts, one prompt of `max_input_len` tokens, and two of unequal lengths
        (the per-prompt attention path). On a GPU each kernel's first call loads it, and the first large
        batch grows the allocator: in a fresh process (a Triton model load starts one), the first 64
        requests of the served benchmark waited about 150 ms more for their first token than the rest.
        Writes only cache rows, which are free before serving (a prefill rewrites a row before anything
        reads it). Returns the (prompts, tokens) of each prefill run."""
        lim = self.info.limits
        short = min(typical_len, lim.max_input_len)
        shapes = [[short] * lim.max_batch_size, [lim.max_input_len], [max(1, short // 2), short]]
        ran = []
        for lengths in shapes:
            prompts = [[1] * n for n in lengths[:lim.max_batch_size]]
            self.prefill(prompts, range(len(prompts))).argmax(dim=-1)  # and the scheduler's pick from the logits
            ran.append((len(prompts), sum(map(len, prompts))))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return ran

    # -- checks -----------------------------------------------------------------------------
    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, top_logprobs: int) -> None:
        lim, vocab = self.info.limits, self.info.model.vocab_size
        if max_new_tokens < 1:
            raise EngineLimitError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if not 0 <= top_logprobs <= vocab:
            raise EngineLimitError(f"top_logprobs={top_logprobs} must be in [0, vocab_size={vocab}]")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise EngineLimitError(f"prompt {i} is empty; a prompt needs at least one token")
            if len(p) > lim.max_input_len:
                raise EngineLimitError(f"prompt {i} has {len(p)} tokens > limits.max_input_len={lim.max_input_len}")
            if len(p) + max_new_tokens > lim.max_seq_len:
                raise EngineLimitError(f"prompt {i}: {len(p)} tokens + max_new_tokens={max_new_tokens} = "
                                       f"{len(p) + max_new_tokens} > limits.max_seq_len={lim.max_seq_len}")
            self._check_token_ids(p, f"prompt {i}")

    def _check_token_ids(self, prompt: Sequence[int], what: str) -> None:
        vocab = self.info.model.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise EngineLimitError(f"{what} has token ids {bad[:5]} outside [0, vocab_size={vocab})")

    # -- public API -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] = (),
                 top_logprobs: int = 0, logprobs: bool = True,
                 events: list | None = None) -> list[Generation]:
        """New tokens for each prompt; greedy when `sampling` is None. Chunks of max_batch_size.

        `logprobs=False` skips the log-softmax per step (Generation.logprobs is then empty);
        `events` (CUDA only), when a list, receives a CUDA event recorded at the start of each chunk,
        after its first token and after each decode step (for the benchmark's TTFT/TPOT).
        """
        self._check_prompts(prompts, max_new_tokens, top_logprobs)
        if sampling is not None and sampling.shapes_logits:
            raise EngineLimitError(f"{sampling} asks for penalties, logit_bias or min_tokens: the paged engine serves "
                                   "them (engine.paged), the static runner does not")
        generator = None
        if sampling is not None and sampling.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling.seed)
        n = self.info.limits.max_batch_size
        out: list[Generation] = []
        for start in range(0, len(prompts), n):
            out += self._generate_batch(prompts[start:start + n], max_new_tokens, sampling, stop_token_ids,
                                        top_logprobs, generator, logprobs or top_logprobs > 0, events)
        return out

    @torch.no_grad()
    def prefill_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Teacher-forced float32 logits of every position of `prompt`: [S, V] on the CPU.

        Accepts up to limits.max_seq_len tokens (a prompt plus its continuation, for validation).
        """
        lim = self.info.limits
        if not 1 <= len(prompt) <= lim.max_seq_len:
            raise EngineLimitError(f"prefill_logits: {len(prompt)} tokens, need 1..limits.max_seq_len="
                                   f"{lim.max_seq_len}")
        self._check_token_ids(prompt, "prefill_logits prompt")
        tokens = torch.tensor([list(prompt)], dtype=torch.long, device=self.device)  # [1, S]
        seqlen = tokens.shape[1]
        input_pos = torch.arange(seqlen, device=self.device).unsqueeze(0)  # [1, S]
        h = self.model(tokens, input_pos, seqlen)  # [1, S, D]
        return self.model.logits(h[0]).cpu()

    # -- the loop ---------------------------------------------------------------------------
    @torch.no_grad()
    def _generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                        sampling: SamplingParams | None, stop_token_ids: Sequence[int], top_n: int,
                        generator: torch.Generator | None, want_logprobs: bool = True,
                        events: list | None = None) -> list[Generation]:
        dev, bsz = self.device, len(prompts)
        lengths = [len(p) for p in prompts]
        timed = events is not None and dev.type == "cuda"

        def mark() -> None:
            if timed:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                events.append(ev)

        mark()
        stop_ids = torch.tensor(list(stop_token_ids), dtype=torch.long, device=dev)
        done = torch.zeros(bsz, dtype=torch.bool, device=dev)
        logits = self.prefill(prompts, range(bsz))  # [B, V]
        input_pos = torch.tensor(lengths, dtype=torch.long, device=dev)  # [B]: where the next token goes
        longest = max(lengths)
        steps: list[torch.Tensor] = []
        chosen: list[torch.Tensor] = []
        tops: list[tuple[torch.Tensor, torch.Tensor]] = []
        # greedy without log-probs: each step's graph picks the next tokens itself (`decode_inplace`)
        in_place = not want_logprobs and (sampling is None or sampling.is_greedy)
        for step in range(max_new_tokens):
            if in_place and step > 0:
                next_tokens = self.state.tokens[:bsz].clone()  # [B]
            else:
                next_tokens = sample(logits, sampling, generator)  # [B]
            if want_logprobs:
                lp, top_v, top_i = chosen_logprobs(logits, next_tokens, top_n)
                chosen.append(lp)
                if top_v is not None:
                    tops.append((top_v, top_i))
            steps.append(next_tokens)
            mark()
            if len(stop_token_ids):
                done |= torch.isin(next_tokens, stop_ids)
                if (step + 1) % STOP_CHECK_EVERY == 0 and bool(done.all()):
                    break
            if step + 1 == max_new_tokens:
                break
            if in_place:
                if step == 0:
                    self._load_rows(next_tokens, input_pos)
                self.decode_inplace(bsz, longest + step + 1)
            else:
                logits = self.decode(next_tokens, input_pos, longest + step + 1)  # [B, V]
                input_pos = input_pos + 1

        token_mat = torch.stack(steps, dim=1).cpu().tolist()  # [B, T]
        lp_mat = torch.stack(chosen, dim=1).cpu().tolist() if chosen else [[] for _ in range(bsz)]
        if tops:
            top_v_mat = torch.stack([v for v, _ in tops], dim=1).cpu().tolist()  # [B, T, N]
            top_i_mat = torch.stack([i for _, i in tops], dim=1).cpu().tolist()
        stop_set = set(stop_token_ids)
        results = []
        for b in range(bsz):
            ids = token_mat[b]
            end, reason = len(ids), "length"
            for t, tok in enumerate(ids):
                if tok in stop_set:
                    end, reason = t + 1, "stop"
                    break
            top = [dict(zip(top_i_mat[b][t], top_v_mat[b][t])) for t in range(end)] if tops else []
            results.append(Generation(token_ids=ids[:end], logprobs=lp_mat[b][:end], top_logprobs=top,
                                      finish_reason=reason))
        return results


def load_engine(engine_dir: Path, *, device: str = "auto", cuda_graphs: bool = True,
                decode_attention: str = "auto", decode_gemm: str = "auto") -> EngineRunner:
    """Read, check (toolchain) and load an engine folder onto `device` ("auto": cuda if available).

    On CUDA the decode step replays CUDA graphs unless `cuda_graphs=False`. `decode_attention`:
    "triton" (the fused split-K kernel of `decode_attention.py`), "matmul", or "auto" (triton for bf16 /
    fp16 on CUDA when Triton is importable). `decode_gemm`: "triton" (the tuned skinny kernels of
    `skinny_gemm.py` for the shapes they were tuned on, F.linear for the rest), "torch", or "auto" (as
    for attention)."""
    info, model, dev = load_model(engine_dir, device=device)
    model.setup_caches(info.limits.max_batch_size, info.limits.max_seq_len)
    dtype = model.tok_embeddings.weight.dtype
    model.decode_attention_impl = pick_decode_attention(decode_attention, dev, dtype)
    model.decode_gemm_impl = pick_decode_gemm(decode_gemm, dev, dtype)
    return EngineRunner(info, model, dev, cuda_graphs=cuda_graphs)


def load_model(engine_dir: Path, *, device: str = "auto") -> tuple[EngineInfo, Transformer, torch.device]:
    """Read, check (toolchain, quantization) and load an engine folder's weights onto `device`, without
    caches (`load_engine` adds the static ones, `paged_runner.load_paged_engine` the paged pools)."""
    info = read_engine_info(Path(engine_dir))
    dev = resolve_device(device)
    check_toolchain(info, device=dev)
    check_quantization_device(info.quantization.method, dev, where=f"engine {str(info.path)!r}")
    state: dict[str, torch.Tensor] = {}
    for name in info.weight_files:
        state.update(torch.load(info.path / name, map_location="cpu", weights_only=True, mmap=True))
    with torch.device("meta"):
        model = Transformer(info.model)
    install_quantized_linears(model, info.quantization, n_layers=info.model.n_layers,
                              tie_word_embeddings=info.model.tie_word_embeddings, dtype=DTYPES[info.limits.dtype])
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # a quantization record that does not match the weights
        raise EngineFormatError(f"engine {str(info.path)!r}: its weights do not match engine.json (quantization "
                                f"{info.quantization.method!r}): {exc}") from None
    return info, model.to(dev).eval().requires_grad_(False), dev


def pick_decode_attention(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" -> "triton" for a half-precision model on CUDA when Triton is importable, else "matmul".

    float32 engines are the exactness reference and keep the matmul path: in the one H200 run of the
    fused kernel under torch.compile, the float32 compiled-vs-eager token check failed and could not be
    re-run (docs/decisions.md)."""
    if choice not in ("auto", "triton", "matmul"):
        raise EngineLimitError(f"decode_attention={choice!r}: expected 'auto', 'triton' or 'matmul'")
    if choice == "matmul" or (choice == "auto" and (device.type != "cuda" or dtype == torch.float32)):
        return "matmul"
    from serving.engine.decode_attention import triton_available

    has_triton = triton_available()
    if has_triton and device.type == "cuda":
        return "triton"
    if choice == "triton":
        raise EngineLimitError(f"decode_attention='triton' needs CUDA and Triton (device {device}, Triton "
                               f"{'importable' if has_triton else 'not importable'})")
    return "matmul"


def pick_decode_gemm(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" -> "triton" for a half-precision model on a GPU of the kind the kernels were tuned on
    (compute capability 9.0) when Triton is importable, else "torch"."""
    if choice not in ("auto", "triton", "torch"):
        raise EngineLimitError(f"decode_gemm={choice!r}: expected 'auto', 'triton' or 'torch'")
    if choice == "torch" or (choice == "auto" and (device.type != "cuda" or dtype == torch.float32)):
        return "torch"
    from serving.engine.skinny_gemm import TUNED_CAPABILITY, triton_available, tuned_for

    if triton_available() and tuned_for(device):
        return "triton"
    if choice == "triton":
        where = (f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
                 if device.type == "cuda" else f"device {device}")
        raise EngineLimitError(
            f"decode_gemm='triton' needs Triton and a GPU of compute capability "
            f"{'.'.join(map(str, TUNED_CAPABILITY))} (the kernels' table was tuned on an H200); here: {where}, "
            f"Triton {'importable' if triton_available() else 'not importable'}. Use decode_gemm='torch', or "
            f"tune this GPU with `python3 -m serving.bench gemms`")
    return "torch"
