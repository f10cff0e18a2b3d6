"""Greedy tokens of the reference forward (`model.Transformer.forward`: whole sequences, causal, no cache), the
plain computation the engine's steps are held to in the CPU tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def reference_greedy(runner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
    """Each prompt's greedy continuation, recomputing the whole sequence for every token (tiny models only)."""
    model, out = runner.model, []
    for prompt in prompts:
        seq, new = list(prompt), []
        for _ in range(max_new_tokens):
            hidden = model(torch.tensor([seq], device=runner.device))[0, -1]  # [D]
            token = int(model.logits(hidden).argmax())
            new.append(token)
            seq.append(token)
            if token in stop_token_ids:
                break
        out.append(new)
    return out


@torch.no_grad()
def reference_logits(runner, prompt: Sequence[int]) -> torch.Tensor:
    """Float32 logits of every position of `prompt` [S, V], on the CPU."""
    return runner.model.logits(runner.model(torch.tensor([list(prompt)], device=runner.device))[0]).cpu()


class ReferenceEngine:
    """`generate` and `prefill_logits` of a runner's weights through the reference forward: what the runtime's
    own `generate` / `prefill_logits` must give (greedy tokens equal; log-probs within float32 rounding)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def prefill_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        return reference_logits(self.runner, prompt)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, top_logprobs: int = 0,
                 stop_token_ids: Sequence[int] = (), logprobs: bool = True) -> list:
        from serving.engine.runner import Generation

        out = []
        for prompt, new in zip(prompts, reference_greedy(self.runner, prompts, max_new_tokens, stop_token_ids)):
            lps = reference_logits(self.runner, list(prompt) + new)[len(prompt) - 1:-1].log_softmax(-1)  # [N, V]
            top = [dict(zip(*(v.tolist() for v in reversed(row.topk(top_logprobs))))) for row in lps] if top_logprobs else []
            out.append(Generation(token_ids=new, logprobs=[float(lps[i, t]) for i, t in enumerate(new)] if logprobs else [],
                                  top_logprobs=top, finish_reason="stop" if new and new[-1] in stop_token_ids else "length"))
        return out


@torch.no_grad()
def decode_step_logits(runner, prompts: Sequence[Sequence[int]], tokens: Sequence[int], *,
                       reference: bool = False) -> torch.Tensor:
    """Float32 logits [B, V] of one decode-only step (`cuda_graphs.paged_decode_logits`, eager, through the GEMMs
    the layers picked for the model's options, or with `reference` through their dequantizing references): each
    prompt prefilled into blocks lent for the call by one mixed step, then `tokens[b]` decoded at position
    len(prompts[b])."""
    from serving.engine.cuda_graphs import paged_decode_logits
    from serving.engine.kv_cache import blocks_for

    bs, dev = runner.config.block_size, runner.device
    tables = [runner.allocator.take(blocks_for(len(p) + 1, bs)) for p in prompts]
    assert all(t is not None for t in tables), "the pool cannot lend the blocks"
    try:
        runner.forward([(list(p), 0, t) for p, t in zip(prompts, tables)], list(range(len(prompts))))
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], device=dev)  # [B, W]
        pos = torch.tensor([len(p) for p in prompts], device=dev)
        slots = table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        return paged_decode_logits(runner.model, torch.tensor(list(tokens), device=dev), pos, slots, table, pos + 1,
                                   runner.cache, runner.rope_cos, runner.rope_sin, reference=reference).float()
    finally:
        for table in tables:
            runner.allocator.give_back(table)
