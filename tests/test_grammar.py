"""The grammar engine (serving/engine/grammar.py): what it refuses, and that its masks force valid output.

The masks are driven with random logits on the example model's real tokenizer (SmolLM2, 49,152 tokens): a
sampler that sees only the allowed tokens must produce a document the schema accepts, whatever the logits.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from serving.engine.grammar import (
    Guide,
    GuideError,
    MaskWorker,
    check_guide,
    grammar_tokenizer,
    make_matchers,
)

pytest.importorskip("llguidance")

PERSON = {"type": "object", "title": "Person",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 120},
                         "role": {"enum": ["admin", "viewer"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at /uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' at /properties/a/not"),
    ({"type": "string", "format": "credit-card"}, "format 'credit-card' at /format"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if' at /if"),
])
def test_a_keyword_the_engine_would_not_enforce_is_refused_by_name(schema, named):
    with pytest.raises(GuideError, match=re.escape(named)) as info:
        check_guide(Guide("json_schema", schema))
    assert info.value.param == "response_format"


@pytest.mark.parametrize("guide, words", [
    (Guide("json_schema", ["not", "a", "schema"]), "must be a JSON Schema object"),
    (Guide("json_schema", {"type": "strin"}), "strin"),
    (Guide("regex", "a(b", param="guided_regex"), "guided_regex"),
    (Guide("choice", [], param="guided_choice"), "guided_choice must be a list"),
])
def test_a_guide_that_is_not_valid_is_refused_naming_its_parameter(guide, words):
    with pytest.raises(GuideError, match=re.escape(words)) as info:
        check_guide(guide)
    assert info.value.param == guide.param


def test_a_pydantic_schema_with_refs_and_annotations_is_accepted():
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(description="the city")

    class Person(BaseModel):
        name: str
        home: Address
        tags: list[str]

    check_guide(Guide("json_schema", Person.model_json_schema()))


def test_guide_travels_as_json():
    guide = Guide("choice", ["yes", "no"], param="guided_choice")
    assert Guide.from_json(guide.to_json()) == guide
    with pytest.raises(GuideError, match="guided_decoding must be"):
        Guide.from_json('{"kind": "xml"}')


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]


def drive(guide: Guide, checkpoint, *, seed: int, max_tokens: int = 80) -> str:
    """Random logits, masked; the text the matcher allowed, up to its end (EOS)."""
    from tokenizers import Tokenizer

    path = str(checkpoint / "tokenizer.json")
    tok = Tokenizer.from_file(path)
    vocab, eos = tok.get_vocab_size(), tok.token_to_id("<|im_end|>")
    worker = MaskWorker()
    try:
        (matcher,) = make_matchers(guide, tokenizer=grammar_tokenizer(path, vocab, (eos,)), worker=worker,
                                   vocab_size=vocab)
        generator = torch.Generator().manual_seed(seed)
        bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        out = []
        for _ in range(max_tokens):
            matcher.fill_next_token_bitmask(bitmask, 0)
            logits = torch.randn(vocab, generator=generator).masked_fill(~unpack(bitmask, vocab)[0], float("-inf"))
            token = int(logits.argmax())
            assert matcher.accept_token(token), matcher.error
            if token == eos:
                assert matcher.is_terminated()
                break
            out.append(token)
        return tok.decode(out)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("seed", range(3))
def test_masks_force_a_document_the_schema_accepts(smollm2_checkpoint, seed):
    text = drive(Guide("json_schema", PERSON), smollm2_checkpoint, seed=seed, max_tokens=120)
    doc = json.loads(text)
    assert set(doc) == {"name", "age", "role"} and doc["role"] in ("admin", "viewer")
    assert isinstance(doc["age"], int) and 0 <= doc["age"] <= 120 and len(doc["name"]) <= 12


def test_masks_force_a_choice_and_a_regex(smollm2_checkpoint):
    assert drive(Guide("choice", ["sunny", "rainy", "snowy"]), smollm2_checkpoint, seed=0) in ("sunny", "rainy",
                                                                                                "snowy")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", drive(Guide("regex", "[0-9]{3}-[a-z]{2}"), smollm2_checkpoint,
                                                     seed=1))


def test_json_object_opens_an_object(smollm2_checkpoint):
    from tokenizers import Tokenizer

    path = str(smollm2_checkpoint / "tokenizer.json")
    tok = Tokenizer.from_file(path)
    vocab = tok.get_vocab_size()
    worker = MaskWorker()
    try:
        (matcher,) = make_matchers(Guide("json_object"), tokenizer=grammar_tokenizer(path, vocab, (2,)),
                                   worker=worker, vocab_size=vocab)
        bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = unpack(bitmask, vocab)[0]
        assert allowed[tok.token_to_id("{")] and not allowed[tok.token_to_id("[")]
        assert all(tok.decode([i]).startswith("{") for i in allowed.nonzero().flatten().tolist())
    finally:
        worker.shutdown()
