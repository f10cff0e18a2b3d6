"""Faulty engines for the gate tests, made by editing a converted engine checkpoint and building it again.

Each fault is one kind the quality gate must refuse: numerics beyond the precision's budget (weights
rounded to int8 per output channel and back), weights mapped wrong (two attention heads swapped, a layer
dropped), another tokenizer of the same vocabulary size. `degrade` adds noise to an HF checkpoint itself
(a checkpoint that got worse: only the comparison with production can see it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

Tensors = dict[str, torch.Tensor]


def edit_checkpoint(src: Path, dst: Path, edit: Callable[[Tensors, dict], None]) -> Path:
    """Copy engine checkpoint `src` to `dst` and apply `edit(tensors, model_args)` to every weight file's dict
    (names that file does not hold are simply absent)."""
    shutil.copytree(src, dst)
    args = json.loads((dst / "checkpoint.json").read_text())["model"]
    for path in sorted(dst.glob("weights-*.pt")):
        tensors = torch.load(path, weights_only=True)
        edit(tensors, args)
        torch.save(tensors, path)
    return dst


def int8_round(tensors: Tensors, args: dict) -> None:
    """Every matrix rounded to int8 with one scale per output row (symmetric), and back to its dtype."""
    for name, w in tensors.items():
        if w.ndim == 2:
            x = w.float()
            scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            tensors[name] = ((x / scale).round().clamp(-127, 127) * scale).to(w.dtype)


def swap_heads(layer: int = 0) -> Callable[[Tensors, dict], None]:
    """Swap the query weights of the first and the last attention head of `layer` (different KV groups)."""
    def edit(tensors: Tensors, args: dict) -> None:
        name = f"layers.{layer}.attention.wqkv.weight"
        if name in tensors:
            w, d = tensors[name].clone(), args["head_dim"]
            last = (args["n_heads"] - 1) * d
            w[0:d], w[last:last + d] = tensors[name][last:last + d], tensors[name][0:d]
            tensors[name] = w
    return edit


def drop_layer(layer: int) -> Callable[[Tensors, dict], None]:
    """The layer adds nothing to the residual stream: its attention output and MLP down projections zeroed."""
    def edit(tensors: Tensors, args: dict) -> None:
        for name in (f"layers.{layer}.attention.wo.weight", f"layers.{layer}.feed_forward.w2.weight"):
            if name in tensors:
                tensors[name] = torch.zeros_like(tensors[name])
    return edit


def swap_tokenizer_ids(checkpoint_dir: Path, text: str = "The capital of France is") -> None:
    """Another tokenizer of the same vocabulary size: the ids of the first two tokens of `text` exchanged."""
    from tokenizers import Tokenizer

    path = checkpoint_dir / "tokenizer.json"
    ids = Tokenizer.from_file(str(path)).encode(text).ids
    doc = json.loads(path.read_text())
    vocab = doc["model"]["vocab"]
    by_id = {v: k for k, v in vocab.items()}
    a, b = by_id[ids[0]], by_id[ids[1]]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(doc, ensure_ascii=False))


def degrade(hf_dir: Path, dst: Path, *, relative_noise: float, seed: int = 0) -> Path:
    """An HF checkpoint whose matrices carry Gaussian noise of `relative_noise` x each matrix's std."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, dst)
    g = torch.Generator().manual_seed(seed)
    for path in sorted(dst.glob("*.safetensors")):
        tensors = load_file(path)
        for name, w in tensors.items():
            if w.ndim == 2:
                x = w.float()
                tensors[name] = (x + torch.randn(x.shape, generator=g) * x.std() * relative_noise).to(w.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


def misscale(factor: float) -> Callable[[Tensors, dict], None]:
    """Every quantized weight's per-channel scales multiplied by `factor` (a wrong qmax, say): the
    quantized integers are right, their dequantized values are not."""
    def edit(tensors: Tensors, args: dict) -> None:
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name] = tensors[name] * factor
    return edit


def permute_router(layer: int = 0) -> Callable[[Tensors, dict], None]:
    """A mixture of experts' router rows of experts 0 and 1 of `layer` swapped: tokens routed to the wrong experts."""
    def edit(tensors: Tensors, args: dict) -> None:
        name = f"layers.{layer}.feed_forward.gate.weight"
        if name in tensors:
            tensors[name] = tensors[name][[1, 0, *range(2, args["n_experts"])]].clone()
    return edit


def swap_gate_up(layer: int = 0, expert: int = 0) -> Callable[[Tensors, dict], None]:
    """One expert's gate and up projections swapped (w1 <-> w3 of a Mixtral expert) in the stacked w13 of `layer`."""
    def edit(tensors: Tensors, args: dict) -> None:
        name = f"layers.{layer}.feed_forward.w13.weight"
        if name in tensors:
            inter, w = args["moe_intermediate_size"], tensors[name].clone()
            first = expert * 2 * inter
            gate, up = slice(first, first + inter), slice(first + inter, first + 2 * inter)
            w[gate], w[up] = tensors[name][up], tensors[name][gate]
            tensors[name] = w
    return edit


def edited_runner(engine_dir: Path, edit: Callable[[Tensors, dict], None]):
    """The engine loaded, with `edit` applied to its weights in memory: what `edit_checkpoint` and a rebuild
    would load, without writing the checkpoint twice (the gates take a runner beside its engine folder)."""
    from serving.engine import load_engine

    runner = load_engine(engine_dir)
    tensors = dict(runner.model.state_dict())
    edit(tensors, runner.info.model.to_dict())
    runner.model.load_state_dict(tensors, strict=True)
    return runner


def add_noise(relative: float, seed: int = 0) -> Callable[[Tensors, dict], None]:
    """Gaussian noise of `relative` x each matrix's std on every matrix (a checkpoint that got worse)."""
    def edit(tensors: Tensors, args: dict) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, w in tensors.items():
            if w.ndim == 2:
                x = w.float()
                tensors[name] = (x + torch.randn(x.shape, generator=g) * x.std() * relative).to(w.dtype)
    return edit


class SlowedRunner:
    """A loaded engine that does each `generate` call `factor` times (returning the last): `factor` x slower
    whatever the machine's load, since the extra work is the engine's own."""

    def __init__(self, runner, factor: int = 2) -> None:
        self.runner, self.factor = runner, factor
        self.info, self.device = runner.info, runner.device

    def generate(self, *args, **kwargs):
        for _ in range(self.factor - 1):
            self.runner.generate(*args, **kwargs)
        return self.runner.generate(*args, **kwargs)


# -- faults of the engine's envelope: each shows only where the old gates did not look -----------------------
def rope_stuck_past(runner, position: int):
    """RoPE wrong past `position`: every later position is rotated as `position` - 1 (a table cut short).
    Prompts and sequences shorter than `position` are untouched. The runner's tables (`rope_cos`/`rope_sin`, which
    its mixed and decode-only steps share)."""
    runner.rope_cos[position:] = runner.rope_cos[position - 1]
    runner.rope_sin[position:] = runner.rope_sin[position - 1]
    return runner


def _wrap_decode(runner, change):
    """The runner's decode-only steps (`cuda_graphs.DecodeGraphs.step`: every step once each request is past its
    prompt) with `change` applied to their logits [B, V]; steps with a prompt chunk in them and teacher-forced
    logits are untouched."""
    graphs = runner.decode
    real = graphs.step

    def step(chunks, *args, **kwargs):
        return change(real(chunks, *args, **kwargs).clone())

    graphs.step = step
    return runner


def rows_interfering(runner, width: int):
    """In a batch of more than `width` rows, the rows past `width` get row 0's decode logits added to theirs
    (state leaking across rows): a batch of up to `width` rows is exact."""
    def change(logits):
        if logits.shape[0] > width:
            logits[width:] += logits[0]
        return logits
    return _wrap_decode(runner, change)


def decode_swaps_top2(runner):
    """Every decode step's two best logits exchanged in every row: the prompt path (first token, teacher-forced
    logits) stays right; each later token is the reference's second choice, within its top-N."""
    def change(logits):
        top = logits.topk(2, dim=-1)
        logits.scatter_(1, top.indices, top.values.flip(-1))
        return logits
    return _wrap_decode(runner, change)


def scale_logits(hf_dir: Path, dst: Path, *, factor: float) -> Path:
    """An HF checkpoint whose LM head (the embedding, when tied) is multiplied by `factor`: every logit scaled,
    the model sharper (> 1) or flatter (< 1) than it was; its argmax, hence its greedy text, unchanged."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, dst)
    for path in sorted(dst.glob("*.safetensors")):
        tensors = load_file(path)
        name = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
        if name in tensors:
            tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
            save_file(tensors, path, metadata={"format": "pt"})
    return dst


class ProportionallySlowedRunner:
    """A loaded engine whose every `generate` call takes 1 / (1 - `slowdown`) times its own duration (it sleeps the
    rest): its throughput is (1 - slowdown) x the same engine's whatever the machine's load, since the sleep
    follows each call's own time. Everything else is the engine's."""

    def __init__(self, runner, slowdown: float) -> None:
        self.runner, self.stretch = runner, 1.0 / (1.0 - slowdown) - 1.0
        self.info, self.device = runner.info, runner.device

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def generate(self, *args, **kwargs):
        import time

        start = time.perf_counter()
        out = self.runner.generate(*args, **kwargs)
        time.sleep((time.perf_counter() - start) * self.stretch)
        return out
