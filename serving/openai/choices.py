"""A request's engine calls: one per (prompt, choice), each with its own seed, and how their pieces make choices.

``n`` choices of a prompt are ``n`` engine requests sent at once (each computes the prompt: they are admitted
together, before a prefix cache holds its blocks); choice ``c`` of a request with ``seed`` samples with ``seed + c``, so
each choice is its own repeatable stream. ``max_tokens: 0`` (with ``echo``) asks the engine for one token and
drops it: the answer is the prompt and its log-probs. Streams of several choices are merged as their pieces come
(`merged`), each chunk naming its choice's index.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from serving.openai.backend import BackendError, Piece, Prompt, Sampling
from serving.openai.responses import Choice, Entry, Shape, token_text

INT64_SPAN = 1 << 64


@dataclass(frozen=True)
class Job:
    """One engine call: choice `choice` of prompt `prompt_index`."""

    prompt_index: int
    choice: int
    prompt: Prompt
    sampling: Sampling
    echo: bool = False  # completions: the prompt first in the text
    drop_output: bool = False  # max_tokens 0: the token the engine made is not part of the answer

    def index(self, n: int) -> int:
        return self.prompt_index * n + self.choice

    def _echo_text(self, prompt_entries: list[Entry]) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        return b"".join(bytes(e["bytes"]) for e in prompt_entries).decode("utf-8", "replace")

    def gathered(self, piece: Piece, n: int) -> Choice:
        """The choice of a call answered at once."""
        choice = Choice(index=self.index(n), prompt_tokens=piece.prompt_tokens or 0)
        logprobs = piece.logprobs or {}
        if self.echo:
            choice.prompt_entries = logprobs.get("prompt", [])
            choice.prompt_text = self._echo_text(choice.prompt_entries)
        if self.drop_output:
            choice.finish_reason = "length"
            return choice
        choice.text, choice.tokens, choice.finish_reason = piece.text, len(piece.token_ids), piece.finish_reason
        choice.entries = logprobs.get("tokens", [])
        return choice

    def chunks(self, piece: Piece, choice: Choice, shape: Shape) -> list[dict[str, Any]]:
        """The stream chunks of one more piece of this call (`choice` gathers it)."""
        out = []
        logprobs = piece.logprobs or {}
        choice.prompt_tokens = piece.prompt_tokens or choice.prompt_tokens
        if self.echo and not choice.prompt_text:
            choice.prompt_entries = logprobs.get("prompt", [])
            choice.prompt_text = self._echo_text(choice.prompt_entries)
            out.append(shape.chunk(choice.index, choice.prompt_text, None, prompt_entries=choice.prompt_entries))
        if self.drop_output:
            choice.finish_reason = "length"
            return out
        entries = logprobs.get("tokens", [])
        if piece.text or entries:
            offset = len(choice.prompt_text) + sum(len(token_text(e)) for e in choice.entries)
            out.append(shape.chunk(choice.index, piece.text, None, entries=entries, offset=offset))
        choice.text += piece.text
        choice.entries += entries
        choice.tokens += len(piece.token_ids)
        choice.finish_reason = piece.finish_reason or choice.finish_reason
        return out


def jobs_for(req: Any, prompts: list[Prompt], chat: bool, guided_decoding: str | None = None) -> list[Job]:
    """The engine calls of a validated request (`schemas.CompletionRequest` or `schemas.ChatCompletionRequest`);
    `guided_decoding`: the grammar every choice must match (`structured.guided_decoding`)."""
    max_tokens = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    echo = not chat and req.echo
    jobs = []
    for p, prompt in enumerate(prompts):
        prompt_logprobs = echo and (req.logprobs is not None or not isinstance(prompt, str))
        for c in range(req.n):
            seed = None if req.seed is None else _wrapped(req.seed + c)
            sampling = Sampling(
                max_tokens=max(max_tokens, 1), temperature=req.temperature, top_p=req.top_p, seed=seed,
                stop=tuple(req.stop or ()), ignore_eos=req.ignore_eos, top_k=max(req.top_k, 0),
                logprobs=bool(req.logprobs) if chat else req.logprobs is not None and max_tokens > 0,
                top_logprobs=(req.top_logprobs or 0) if chat else (req.logprobs or 0),
                prompt_logprobs=prompt_logprobs, presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0, repetition_penalty=req.repetition_penalty,
                logit_bias=req.logit_bias_pairs, min_tokens=req.min_tokens,
                stop_token_ids=tuple(req.stop_token_ids or ()), guided_decoding=guided_decoding)
            jobs.append(Job(p, c, prompt, sampling, echo=echo, drop_output=max_tokens == 0))
    return jobs


def _wrapped(seed: int) -> int:
    """A seed kept in int64 (the engine's seed input)."""
    return (seed + (1 << 63)) % INT64_SPAN - (1 << 63)


async def merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """(stream index, piece) of every stream as the pieces come; a stream's failure is raised at once (the others
    are cancelled)."""
    queue: asyncio.Queue[tuple[int, Piece | None, BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put((k, piece, None))
            await queue.put((k, None, None))
        except BackendError as exc:
            await queue.put((k, None, exc))

    tasks = [asyncio.create_task(pump(k, stream)) for k, stream in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            k, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece is None:
                left -= 1
            else:
                yield k, piece
    finally:
        for task in tasks:
            task.cancel()
