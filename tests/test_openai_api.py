"""Log-probs, choices, sampling parameters and errors in OpenAI's terms, end to end: the tiny float32 model as a
paged engine (in flight, decoupled) in a real Triton behind its routers, `enginewright serve`, and the official
`openai` client. Log-probs are HF transformers' own log-softmax of the same checkpoint within 1e-4."""

from __future__ import annotations

import httpx
import openai
import pytest
from triton_support import openai_front, serve_only_version, start_triton

pytestmark = pytest.mark.slow

MODEL = "tiny-api"
PROMPT = "The capital of France is"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the HF checkpoint, Triton) for one paged float32 engine of the tiny model with a chat template."""
    from serving.engine import EngineLimits, build_engine, convert_checkpoint
    from serving.engine.kv_cache import KVCacheConfig
    from serving.triton.repository import init_repository
    from tasks.tiny_model import make_tiny_model

    work = tmp_path_factory.mktemp("api")
    hf = make_tiny_model(work / "hf")
    ckpt = convert_checkpoint(hf, work / "ckpt", dtype="float32")
    engine = build_engine(ckpt, work / "engine", limits=EngineLimits(dtype="float32", max_batch_size=8,
                                                                      max_input_len=128, max_seq_len=256),
                          kv_cache=KVCacheConfig(block_size=16, num_blocks=160, max_num_tokens=256,
                                              prefix_caching=True)).path
    (engine / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    repo = init_repository(work / "repository")
    server = start_triton(repo, log_path=work / "triton.log")
    try:
        serve_only_version(server, repo, MODEL, engine)
        yield hf, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def front(served, tmp_path_factory):
    with openai_front(served[1].grpc_url, [MODEL], tmp_path_factory.mktemp("front") / "serve.log") as base:
        yield base


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(served):
    """(tokenizer, log-softmax of a token sequence [S, V]) of the HF checkpoint in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = served
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return tokenizer, log_softmax


def test_chat_logprobs_and_top_logprobs_are_hfs_log_softmax(client, hf):
    tokenizer, log_softmax = hf
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 6
    prompt = tokenizer(PROMPT + "\n", add_special_tokens=False)["input_ids"]  # the template's rendering
    ids = list(prompt)
    for _ in range(6):  # HF's greedy tokens
        ids.append(int(log_softmax(ids)[-1].argmax()))
    reference = log_softmax(ids)
    ids = ids[len(prompt):]
    for k, item in enumerate(content):
        row = reference[len(prompt) - 1 + k]
        assert item.token == tokenizer.decode([ids[k]])
        assert abs(item.logprob - float(row[ids[k]])) < 1e-4
        assert len(item.top_logprobs) == 5
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)  # greedy: the likeliest
    assert "".join(c.token for c in content) == done.choices[0].message.content


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_as_lm_eval_asks(client, hf):
    """lm-evaluation-harness's likelihood request: token ids, echo, logprobs=1, max_tokens=0."""
    tokenizer, log_softmax = hf
    ids = tokenizer("The capital of France is Paris", add_special_tokens=False)["input_ids"]
    done = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=0, temperature=0)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = log_softmax(ids)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - float(reference[j - 1, ids[j]])) < 1e-4
        assert max(lp.top_logprobs[j].values()) == pytest.approx(float(reference[j - 1].max()), abs=1e-4)
    assert done.choices[0].text == tokenizer.decode(ids)
    assert done.usage.completion_tokens == 0 and done.usage.prompt_tokens == len(ids)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_echo_with_generated_tokens_and_a_stream_carry_the_same_logprobs(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    lp = whole.choices[0].logprobs
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_n_choices_each_with_its_own_seed_stream(client):
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3,
              "extra_body": {"ignore_eos": True}}
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1, "three seeds drew three times the same text"
    assert first.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=4, n=2, stream=True, temperature=0))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_logit_bias_penalties_and_min_tokens_reach_the_sampler(client, hf):
    tokenizer, log_softmax = hf
    forced = tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                     logit_bias={str(forced): 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert done.choices[0].logprobs.tokens == [tokenizer.decode([forced])] * 3
    greedy = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    plain = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    # negative penalties reward what was said: repeats
    again = client.completions.create(**greedy, frequency_penalty=-2.0, presence_penalty=-2.0,
                                      extra_body={"ignore_eos": True, "repetition_penalty": 0.5})
    assert len(set(again.choices[0].logprobs.tokens)) < len(set(plain)) / 2, (again.choices[0].logprobs.tokens, plain)
    first = int(log_softmax(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])[-1].argmax())
    stopped = client.completions.create(**greedy, extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    held = client.completions.create(**greedy, extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3


@pytest.mark.parametrize(("route", "body", "param"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"n": 17}, "n"),
    ("chat", {"logit_bias": {"99999": 5}}, "logit_bias"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"prompt": "word " * 400}, "prompt"),
])
def test_refusals_name_the_openai_parameter_and_nothing_internal(front, route, body, param):
    if route == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    else:
        body = {"model": MODEL, "prompt": "hi", **body}
    reply = httpx.post(f"{front}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert param in error["message"], error
    for internal in ("text_input", "input_ids", "logit_bias_ids", "invalid request", f"{MODEL}_v", "/tmp"):
        assert internal not in error["message"], error
