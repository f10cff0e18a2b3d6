"""Prompts and stop words of the two TensorRT-LLM models, read from the checkpoint's tokenizer files the way
the torch ``llm`` model reads them from its engine folder (``text.read_engine_text``, ``chat.render_chat``).

- ``text_input`` is tokenized with the tokenizer's special tokens (BOS where its post-processor adds one);
- ``messages`` (JSON) is rendered with the chat template (``add_generation_prompt=True``) and tokenized
  without adding special tokens: the template writes them itself (transformers' ``apply_chat_template``);
- ``stop`` strings become token-id stop words (encoded without special tokens); the text returned is cut
  before the first stop string as well, since a model may spell a string with other tokens.

Imports: stdlib and numpy at import time; ``tokenizers`` and jinja2 lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serving.triton.models.chat import parse_messages, render_chat
from serving.triton.models.text import EngineText, read_engine_text
from serving.trtllm.requests import GenRequest


class Prompts:
    """One tokenizer folder: its tokenizer (loaded on first use), chat template and special tokens."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.text: EngineText = read_engine_text(self.tokenizer_dir)
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            path = self.tokenizer_dir / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"text needs {path}, and the checkpoint's tokenizer files have no tokenizer.json: "
                                 "send 'input_ids'")
            from tokenizers import Tokenizer  # lazy: not importable at module import in serving/

            self._tokenizer = Tokenizer.from_file(str(path))
        return self._tokenizer

    def chat_text(self, messages: str) -> str:
        """The rendered chat of the ``messages`` input; ValueError when there is no template."""
        if not self.text.chat_template:
            raise ValueError(f"input 'messages' needs a chat template, and {self.tokenizer_dir} has none "
                             "(chat_template.jinja, or chat_template in tokenizer_config.json): send 'text_input'")
        return render_chat(self.text.chat_template, parse_messages(messages), self.text.special_tokens)

    def ids(self, req: GenRequest) -> list[int]:
        """The prompt's token ids, whichever of ``input_ids`` / ``text_input`` / ``messages`` it came as."""
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        if req.messages is not None:
            ids = self.tokenizer.encode(self.chat_text(req.messages), add_special_tokens=False).ids
        else:
            ids = self.tokenizer.encode(req.text or "").ids
        if not ids:
            raise ValueError("the prompt tokenizes to no tokens")
        return [int(t) for t in ids]

    def encode_stop(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False).ids]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
