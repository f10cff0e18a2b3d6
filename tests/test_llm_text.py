"""The llm model's text side without Triton: EOS ids, special tokens and the chat template read from an
engine folder; incremental detokenizing with stop strings (across special tokens, held back while a
stream could still match); the chat template rendered exactly as transformers renders it."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from serving.triton.models.chat import parse_messages, render_chat
from serving.triton.models.requests import RequestError
from serving.triton.models.text import TextStream, read_engine_text, stop_ids_for
from tasks.tiny_model import EOS_ID, SPECIAL_TOKENS, make_tokenizer

TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, 7]}))
    return out


@pytest.fixture(scope="module")
def tokenizer(folder):
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def feed(stream: TextStream, ids: list[int]) -> tuple[str, int | None]:
    """Token by token, as a stream: the text handed out along the way, and where a stop string ended it."""
    out, kept = "", None
    for i, token in enumerate(ids):
        keep = stream.add([token])
        out += stream.take(final=False)
        if keep is not None:
            kept = i + keep
            break
    return out + stream.take(final=True), kept


def test_engine_text_reads_eos_special_tokens_and_the_template(folder):
    text = read_engine_text(folder)
    assert text.eos_token_ids == (EOS_ID, 7)
    assert text.special_ids == frozenset({0, 1, 2})
    assert dict(text.special_tokens)["eos_token"] == SPECIAL_TOKENS[1]
    assert text.chat_template == TEMPLATE and text.chat_template_source == "tokenizer_config.json"
    assert stop_ids_for((9,), text.eos_token_ids, ignore_eos=False) == (9, EOS_ID, 7)
    assert stop_ids_for((9,), text.eos_token_ids, ignore_eos=True) == (9,)


def test_a_bad_eos_token_id_is_refused_naming_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id='two'"):
        read_engine_text(tmp_path)
    assert read_engine_text(tmp_path / "missing").eos_token_ids == ()


def test_streamed_text_equals_the_whole_decode_with_split_characters(tokenizer, folder):
    ids = tokenizer.encode("Café 🙂 and the river ran to the sea.", add_special_tokens=False).ids
    stream = TextStream(tokenizer, special_ids=read_engine_text(folder).special_ids)
    assert feed(stream, ids) == (tokenizer.decode(ids, skip_special_tokens=True), None)


def test_a_stop_string_matches_across_a_special_token_and_neither_is_in_the_text(tokenizer, folder):
    special = read_engine_text(folder).special_ids
    ids = tokenizer.encode("Paris is the capital", add_special_tokens=False).ids + [EOS_ID] + \
        tokenizer.encode("The sea", add_special_tokens=False).ids
    text, kept = feed(TextStream(tokenizer, special_ids=special, stop_strings=(SPECIAL_TOKENS[1],)), ids)
    assert text == "Paris is the capital" and kept == ids.index(EOS_ID) + 1
    text, kept = feed(TextStream(tokenizer, special_ids=special, stop_strings=("capital<|eos|>The",)), ids)
    assert text == "Paris is the " and kept is not None
    text, _ = feed(TextStream(tokenizer, special_ids=special, stop_strings=("is the",)), ids)
    assert text == "Paris "


def test_a_stream_holds_back_what_could_still_begin_a_stop_string(tokenizer, folder):
    ids = tokenizer.encode("one two three", add_special_tokens=False).ids
    stream = TextStream(tokenizer, special_ids=read_engine_text(folder).special_ids, stop_strings=("three!",))
    for token in ids:
        assert stream.add([token]) is None
    assert stream.take(final=False) == "one two "  # the last len("three!") - 1 characters wait
    assert stream.take(final=True) == "three"


def test_the_stopping_token_is_not_in_the_text_even_when_it_is_not_special(tokenizer):
    ids = tokenizer.encode("the sea", add_special_tokens=False).ids
    stream = TextStream(tokenizer, special_ids=frozenset(), stop_ids=(ids[-1],))
    assert feed(stream, ids)[0] == tokenizer.decode(ids[:-1])


def test_the_chat_template_renders_as_transformers_does(folder, tokenizer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "What is two plus two?"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    text = read_engine_text(folder)
    rendered = render_chat(text.chat_template, parse_messages(json.dumps(messages)), text.special_tokens)
    assert rendered == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.encode(rendered, add_special_tokens=False).ids == list(expected)


@pytest.mark.parametrize(("raw", "match"), [
    ("not json", "not JSON"),
    ("[]", "non-empty JSON list"),
    ('[{"role": "user"}]', r"\[0\] must be an object with a string 'content'"),
    ('[{"role": "robot", "content": "hi"}]', "role='robot'"),
])
def test_bad_messages_are_refused_naming_what_is_wrong(raw, match):
    with pytest.raises(RequestError, match=match):
        parse_messages(raw)


def test_a_template_that_raises_is_a_request_error():
    with pytest.raises(RequestError, match="chat template refused the messages: no system"):
        render_chat("{{ raise_exception('no system') }}", ({"role": "user", "content": "hi"},), ())
