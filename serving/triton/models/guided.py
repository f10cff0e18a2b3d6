"""A request's grammar (``guided_decoding``) as the engine's token mask: `token_mask_for`.

The grammar engine behind it belongs to structured outputs (issue 49; /work/helpers/api_contract.md): until it
lands, every ``guided_decoding`` input is refused with a 400 naming the input, never ignored.

Imports: stdlib only (the grammar engine lazily, inside functions).
"""

from __future__ import annotations

from typing import Any

from serving.triton.models.requests import RequestError


def token_mask_for(spec: str, tokenizer: Any, vocab_size: int) -> Any:
    """The `serving.engine.sampling.TokenMaskSource` enforcing the grammar `spec` (JSON text) over the engine's
    `tokenizer` (a `tokenizers.Tokenizer`) and `vocab_size` logits; RequestError naming what it cannot enforce."""
    raise RequestError(f"input 'guided_decoding' ({len(spec)} characters) is not served by this engine: no grammar "
                       "engine is installed")
