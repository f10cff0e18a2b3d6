"""tasks.tiny_model: offline, deterministic, HF-loadable tiny checkpoints with a BPE tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks.tiny_model import ARCHS, BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, make_tiny_model


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_byte_identical_other_seed_differs(tmp_path):
    a = digests(make_tiny_model(tmp_path / "a", seed=3))
    b = digests(make_tiny_model(tmp_path / "b", seed=3))
    c = digests(make_tiny_model(tmp_path / "c", seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]
    sharded = digests(make_tiny_model(tmp_path / "s1", seed=3, shards=3))
    assert sharded == digests(make_tiny_model(tmp_path / "s2", seed=3, shards=3))
    assert "model.safetensors.index.json" in sharded


def test_tokenizer_roundtrip_and_special_tokens(tmp_path):
    tok = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m"))
    assert 384 <= len(tok) <= VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and len(ids) < 0.75 * len(text)  # merges learned
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok("unseen wörds ✓").input_ids, skip_special_tokens=True) == "unseen wörds ✓"  # byte-level


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers_with_peaked_outputs(tmp_path, arch):
    d = make_tiny_model(tmp_path / arch, arch=arch)
    cfg = json.loads((d / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert type(model).__name__ == cfg["architectures"][0]
    with torch.no_grad():
        logits = model(torch.arange(3, 67).unsqueeze(0)).logits[0]  # [64, V]
    top2 = logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    p_max = logits.softmax(-1).max(-1).values
    print(f"{arch}: median top-1 margin {margin.median():.3f}, min {margin.min():.4f}; "
          f"median max prob {p_max.median():.2f}; distinct argmax {logits.argmax(-1).unique().numel()}/64")
    assert margin.median() > 0.3 and margin.min() > 1e-3  # >> float32 error (~1e-5)
    assert logits.argmax(-1).unique().numel() > 16  # the model does not collapse onto one token
