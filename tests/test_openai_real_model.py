"""The real model through the whole serving path: SmolLM2-135M-Instruct (float32 engine, CPU) in a real
Triton (decoupled llm, router, streaming router), `enginewright serve` under uvicorn, the official
`openai` client at temperature 0. Its chat answers must be HF transformers' own (`apply_chat_template`
+ greedy `generate`) token for token, end at the model's end of turn with `finish_reason: "stop"`, come
as a stream of more than one chunk, and carry the right `usage`."""

from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest
from triton_support import openai_front, serve_only_version, start_triton

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTIONS = ("What is the capital of France?", "What is 2 + 2?", "Say hello in French.")
MAX_TOKENS = 48


@dataclass(frozen=True)
class Reference:
    prompt_ids: list[int]
    answer_ids: list[int]  # new tokens, the end-of-turn token included
    text: str


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def references(smollm2_checkpoint) -> dict[str, Reference]:
    """HF's templated greedy answers, in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    out = {}
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(chat(question), add_generation_prompt=True, return_dict=True,
                                            return_tensors="pt")["input_ids"]
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        answer = generated[0, ids.shape[1]:].tolist()
        assert answer[-1] == model.generation_config.eos_token_id, f"HF did not end its turn: {question!r}"
        out[question] = Reference(ids[0].tolist(), answer, tokenizer.decode(answer, skip_special_tokens=True))
    return out


@pytest.fixture(scope="module")
def triton(smollm2_checkpoint, tmp_path_factory):
    """One Triton serving one float32 SmolLM2 engine, decoupled, behind its router and streaming router."""
    from serving.engine import EngineLimits, build_engine, convert_checkpoint
    from serving.triton.repository import init_repository

    work = tmp_path_factory.mktemp("smollm2")
    ckpt = convert_checkpoint(smollm2_checkpoint, work / "ckpt", dtype="float32")
    engine = work / "engine"
    build_engine(ckpt, engine, limits=EngineLimits(dtype="float32", max_batch_size=2, max_input_len=256,
                                                   max_seq_len=512))
    repo = init_repository(work / "repository")
    server = start_triton(repo, log_path=work / "triton.log")
    try:
        serve_only_version(server, repo, MODEL, engine)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(triton, tmp_path_factory):
    with openai_front(triton.grpc_url, [MODEL], tmp_path_factory.mktemp("front") / "serve.log") as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_answers_are_hfs_templated_greedy_answers_and_stop_at_the_end_of_turn(client, references, question):
    ref = references[question]
    done = client.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].message.content == ref.text
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.prompt_tokens == len(ref.prompt_ids)
    assert done.usage.completion_tokens == len(ref.answer_ids)
    assert done.usage.total_tokens == len(ref.prompt_ids) + len(ref.answer_ids)
    if "France" in question:
        assert "Paris" in ref.text


def test_a_chat_streams_token_by_token_through_the_router(client, references):
    ref = references[QUESTIONS[0]]
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[0]), max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 1, pieces
    assert "".join(pieces) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_matches_a_special_token_in_a_stream(client, references):
    """With EOS ignored, `stop=["<|im_end|>"]` ends the answer where the model ended its turn: the stop
    string is matched on the text with special tokens, and is not part of the answer."""
    ref = references[QUESTIONS[1]]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=chat(QUESTIONS[1]), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stop=["<|im_end|>"], extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model=MODEL, messages=chat(QUESTIONS[1]), max_tokens=len(ref.answer_ids) + 4,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].finish_reason == "length"  # without the stop string it talks on past its turn
    assert plain.usage.completion_tokens == len(ref.answer_ids) + 4
