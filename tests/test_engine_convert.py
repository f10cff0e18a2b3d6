"""convert_checkpoint: sharded == unsharded, progress per shard, streaming memory (tiny + ~88 MB random)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from serving.engine import EngineError, convert_checkpoint
from serving.engine.convert import CHECKPOINT_JSON
from tasks.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[1]


def load_all(ckpt: Path) -> dict[str, torch.Tensor]:
    meta = json.loads((ckpt / CHECKPOINT_JSON).read_text())
    state: dict[str, torch.Tensor] = {}
    for f in sorted(set(meta["weights"].values())):
        state.update(torch.load(ckpt / f, weights_only=True, mmap=True))
    return state


def reshard_round_robin(hf_dir: Path, out: Path, shards: int) -> Path:
    """Copy an HF folder with its tensors dealt round-robin over `shards` files: every fused group straddles."""
    from safetensors.torch import load_file

    out.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix == ".json":
            (out / f.name).write_bytes(f.read_bytes())
    state = load_file(str(hf_dir / "model.safetensors"))
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        group = {n: t for i, (n, t) in enumerate(state.items()) if i % shards == s}
        save_file(group, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-tied"])
def test_sharded_equals_unsharded_and_reports_each_shard(tmp_path, arch):
    one = make_tiny_model(tmp_path / "one", arch=arch, shards=1)
    sharded = make_tiny_model(tmp_path / "sharded", arch=arch, shards=4)
    n_files = len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert n_files >= 3
    dealt = reshard_round_robin(one, tmp_path / "dealt", 3)

    a = load_all(convert_checkpoint(one, tmp_path / "c1", dtype="float32"))
    for src, n in ((sharded, n_files), (dealt, 3)):
        messages: list[str] = []
        b = load_all(convert_checkpoint(src, tmp_path / f"c-{src.name}", dtype="float32", progress=messages.append))
        assert len(messages) == n and messages[0].startswith(f"shard 1/{n}") and messages[-1].startswith(f"shard {n}/{n}")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (tmp_path / "c-sharded").iterdir() if p.name.startswith("tokenizer")) == [
        "tokenizer.json", "tokenizer_config.json"]


def test_dtype_cast_and_fusion_layout(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", arch="qwen2")
    from safetensors.torch import load_file

    src = load_file(str(hf / "model.safetensors"))
    got = load_all(convert_checkpoint(hf, tmp_path / "bf16", dtype="bfloat16"))
    p = "model.layers.1."
    wqkv = torch.cat([src[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).to(torch.bfloat16)
    bqkv = torch.cat([src[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]).to(torch.bfloat16)
    w13 = torch.cat([src[p + "mlp.gate_proj.weight"], src[p + "mlp.up_proj.weight"]]).to(torch.bfloat16)
    assert torch.equal(got["layers.1.attention.wqkv.weight"], wqkv)
    assert torch.equal(got["layers.1.attention.wqkv.bias"], bqkv)
    assert torch.equal(got["layers.1.feed_forward.w13.weight"], w13)
    assert all(t.dtype == torch.bfloat16 for t in got.values())


def test_failed_convert_leaves_nothing(tmp_path):
    hf = make_tiny_model(tmp_path / "hf")
    from safetensors.torch import load_file

    state = load_file(str(hf / "model.safetensors"))
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(EngineError, match=r"layers.1.attention.wqkv.weight.*\[0, 1\]"):
        convert_checkpoint(hf, tmp_path / "out", dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def make_random_checkpoint(out: Path, *, shards: int = 4, dim: int = 512) -> tuple[int, int]:
    """Float32 Llama-shaped checkpoint (dim `dim`, 8 layers; ~88 MB at 512, ~352 MB at 1024) in `shards`
    files; (total, largest) bytes."""
    out.mkdir()
    h, f = dim, 2 * dim
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": f, "hidden_size": h,
           "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": f,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (f, h), "model.norm.weight": (h,), "lm_head.weight": (f, h)}
    for i in range(8):
        p = f"model.layers.{i}."
        shapes |= {p + f"self_attn.{x}_proj.weight": (h, h) for x in "qkvo"}
        shapes |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    names = list(shapes)
    per = -(-len(names) // shards)
    weight_map, sizes = {}, []
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        group = {n: torch.randn(shapes[n], generator=g) for n in names[s * per:(s + 1) * per]}
        save_file(group, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file)
        sizes.append((out / file).stat().st_size)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(sizes), max(sizes)


MEASURE = textwrap.dedent("""
    import sys, resource
    from pathlib import Path
    import torch
    from serving.engine import convert_checkpoint

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    before = status("VmRSS:")
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    except OSError:
        pass
    convert_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]), dtype="float32")
    print(before, status("VmHWM:"))
""")


@pytest.mark.parametrize("dim", [512, 1024], ids=["24MiB-shards", "88MiB-shards"])
def test_streaming_convert_peak_rss_under_1_5x_largest_shard(tmp_path, dim):
    """Acceptance (issue 7): peak RSS growth while converting a 4-shard checkpoint stays under 1.5x the
    largest shard (VmHWM in a fresh process, after imports); the figure is printed."""
    total, largest = make_random_checkpoint(tmp_path / "hf", shards=4, dim=dim)
    res = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "hf"), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=REPO, check=True)
    before, peak = map(int, res.stdout.split())
    growth = peak - before
    mib = 1 << 20
    print(f"\nconvert peak RSS growth {growth / mib:.1f} MiB; largest shard {largest / mib:.1f} MiB "
          f"(ratio {growth / largest:.2f}); checkpoint {total / mib:.1f} MiB (ratio {growth / total:.2f})")
    assert growth < 1.5 * largest, f"peak RSS growth {growth / largest:.2f}x the largest shard"
    state = {}
    for file in sorted((tmp_path / "out").glob("weights-*.pt")):
        state.update(torch.load(file, weights_only=True, mmap=True))
    assert len(state) == 3 + 8 * 6  # embeddings, norm, output + per layer wqkv, wo, w13, w2, 2 norms
