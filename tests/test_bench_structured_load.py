"""Issue 49's device check's parts on the CPU (tiny shape): the engine made from FP8 weights drawn directly (no bf16
checkpoint), the tokenizer with its end token where the shape says, and the verdict. The whole harness through
Triton and the front is bench/structured_load.py's CPU command (its docstring); the device run is
bench/device_structured_load.sh."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest
import torch

from bench.fp8_engine import build_fp8_engine
from bench.models import model_args
from bench.structured_load import kinds_of, schema_failure, tokenizer_folder, verdict
from bench.tensor_parallel import fp8_random_model
from bench.vocab_tokenizer import train
from serving.engine.runner import load_model


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """The tiny shape's vocabulary (512) learnt from a little text, packed as the device run carries it."""
    folder = tmp_path_factory.mktemp("tok")
    path = train(512, folder, max_bytes=300_000)
    packed = folder / "tokenizer.json.xz"
    packed.write_bytes(lzma.compress(path.read_bytes()))
    return packed


def test_the_engine_made_directly_holds_the_drawn_fp8_weights_and_stops_on_the_shapes_end_token(tmp_path, tiny_tokenizer):
    folder = tokenizer_folder("tiny", tmp_path, tokenizer=tiny_tokenizer, max_seq_len=64)
    engine = build_fp8_engine("tiny", tmp_path, device=torch.device("cpu"), max_batch_size=4, max_seq_len=64,
                              tokenizer_dir=folder)
    record = json.loads((engine / "engine.json").read_text())
    assert record["quantization"]["method"] == "fp8" and record["limits"]["max_batch_size"] == 4
    assert json.loads((engine / "generation_config.json").read_text())["eos_token_id"] == 1  # the tiny shape's
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(record["files"])
    assert not (tmp_path / "ckpt-fp8-direct").exists()  # the checkpoint it was built from is gone
    _, loaded, _ = load_model(engine, device="cpu")
    drawn = fp8_random_model(model_args("tiny"), torch.device("cpu"), dtype=torch.float32, seed=0)
    tokens = torch.tensor([[3, 7, 11, 5]])
    assert torch.equal(loaded(tokens), drawn(tokens))
    assert loaded.layers[0].attention.wqkv.weight.dtype == torch.float8_e4m3fn


def test_special_tokens_go_after_the_merges_at_llama3s_ids_when_asked(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(train(300, tmp_path, max_bytes=100_000, first_special=280)))
    assert tok.get_vocab_size() == 300
    assert (tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")) == (280, 281)
    with pytest.raises(ValueError, match="first_special=299"):
        train(300, tmp_path, first_special=299)


def test_a_tokenizer_of_another_vocabulary_is_refused_naming_what_the_shape_needs(tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"vocabulary 512.*llama-3.1-8b needs 128256, 128000, 128001.*--first-special"):
        tokenizer_folder("llama-3.1-8b", tmp_path, tokenizer=tiny_tokenizer, max_seq_len=64)


def test_the_verdict_needs_the_ratio_clean_answers_and_parsed_schemas():
    assert kinds_of(256)[1].count("schema") == kinds_of(256)[1].count("logprobs") == 25
    good = json.dumps({"name": "x", "age": 3, "role": "admin", "active": True, "tags": []})
    assert schema_failure(good, "stop") is None
    assert schema_failure(good, "length") and schema_failure(good[:-1], "length")

    def round_(tok_s: float, **extra) -> dict:
        return {"output_tok_s": tok_s, "error_count": 0, "schema_requests": 10, "schema_unparsed_count": 0,
                "logprob_answers_short": 0, **extra}

    report = {"plain": round_(100.0), "mixed": round_(90.0), "plain_again": round_(102.0)}
    assert verdict(report)["ratio"] == pytest.approx(90 / 101) and verdict(report)["passed"] is False
    report["mixed"] = round_(92.0)
    assert verdict(report)["passed"] is True and verdict(report)["plain_spread"] == pytest.approx(2 / 101)
    assert verdict({**report, "mixed": round_(95.0, schema_unparsed_count=1)})["passed"] is False
    assert verdict({"plain": round_(100.0), "mixed": round_(95.0)})["plain_rounds"] == 1
