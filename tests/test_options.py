"""How a loaded engine runs, as data (serving/engine/options.py, tuned_tables.py, the linear layers' routes):

- `resolve_options`: "auto" resolved for the device and dtype, overrides applied, bad names and values refused
  naming them; the device's tuned tables read from its file, or one of its compute capability, or none.
- The tuned tables: the shipped H200 file parses; a sweep's write merges into (or replaces) a section.
- The linear layers pick their GEMMs at load: float, fp8 and int8 layers by rows bucket and options.
- No module-level mutable switch in `serving/`: no module binds a name to a bool literal, and nothing in the
  repository assigns or patches an upper-case attribute of a `serving` module.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from serving.engine import options as options_module
from serving.engine.errors import EngineLimitError
from serving.engine.gemm_config import GemmConfig, parse_table
from serving.engine.linear_float import FloatLinear, TiedHead
from serving.engine.linear_int8 import Int8Linear
from serving.engine.linear_routes import Dequantized, GateUpKernel, Skinny, TorchLinear, Unfused, pick
from serving.engine.options import AttentionKernelOptions, EngineOptions, resolve_options, with_tuned
from serving.engine.tuned_tables import TUNED_DIR, TunedTables, read_file, tables_for, write_table

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_on_the_cpu_and_overrides_by_name():
    cpu = resolve_options(torch.device("cpu"))
    assert cpu.decode_gemm == "torch" and cpu.tuned == TunedTables()
    assert dataclasses.replace(cpu, tuned=TunedTables()) == EngineOptions()
    got = resolve_options(torch.device("cpu"), overrides={"prescale_rows": False, "decode_pdl": True,
                                                          "attention": {"prefetch_blocks": False}})
    assert not got.prescale_rows and got.decode_pdl and got.attention == AttentionKernelOptions(prefetch_blocks=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.decode_pdl = False  # type: ignore[misc]


def test_bad_names_and_values_are_refused_naming_them():
    cpu = torch.device("cpu")
    with pytest.raises(EngineLimitError, match=r"engine options \['prescale'\] are not known; known: .*'prescale_rows'"):
        resolve_options(cpu, overrides={"prescale": False})
    with pytest.raises(EngineLimitError, match=r"attention: \['warps'\] are not known"):
        resolve_options(cpu, overrides={"attention": {"warps": 2}})
    with pytest.raises(EngineLimitError, match=r"decode_gemm='cublas': expected 'auto', 'triton' or 'torch'"):
        resolve_options(cpu, overrides={"decode_gemm": "cublas"})
    with pytest.raises(EngineLimitError, match=r"decode_gemm='triton' needs Triton and a GPU with tuned kernel tables"):
        resolve_options(cpu, overrides={"decode_gemm": "triton"})
    with pytest.raises(EngineLimitError, match=r"attention.tile_positions=24: expected a power of two >= 16"):
        AttentionKernelOptions(tile_positions=24)
    with pytest.raises(EngineLimitError, match=r"decode_attention.*not known"):
        resolve_options(cpu, overrides={"decode_attention": "triton"})  # the static engine's option, gone with it


def test_the_shipped_h200_tables_parse_and_cover_the_llama_decode_shapes():
    h200 = read_file(TUNED_DIR / "NVIDIA_H200.json")
    assert h200.source == "NVIDIA_H200.json"
    assert h200.skinny[(64, 28672, 4096)] == GemmConfig.parse("dot:n128:k64:s1:w8:st3")
    assert h200.fp8[(1, 4096, 14336)].kernel == "dott"
    assert len(h200.skinny) == 18 and len(h200.skinny_fp8) == 16 and len(h200.skinny_int8) == 8
    assert len(h200.fp8) == 15 and len(h200.gate_up) == 3 and len(h200.gate_up_quantized) == 2


def test_a_device_takes_its_own_file_else_one_of_its_capability_else_none(monkeypatch, tmp_path):
    write_table("NVIDIA H200", "9.0", "skinny", {(1, 8, 16): "gemv:n8:k16:s1:w4:st2"}, directory=tmp_path)
    write_table("NVIDIA H100 80GB HBM3", "9.0", "skinny", {(1, 8, 16): "dot:n16:k16:s1:w4:st2"}, directory=tmp_path)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name, want in (("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3.json"), ("NVIDIA H200", "NVIDIA_H200.json"),
                       ("NVIDIA GH200 480GB", "NVIDIA_H100_80GB_HBM3.json")):  # (sorted: the first of 9.0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert tables_for(cuda, tmp_path).source == want, name
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    assert tables_for(cuda, tmp_path) == TunedTables()
    assert tables_for(torch.device("cpu"), tmp_path) == TunedTables()


def test_a_devices_first_sweep_keeps_the_sections_it_read_from_its_capabilitys_file(tmp_path):
    """An H100 read the H200's file; its first `moe` sweep must not leave it without the skinny configs."""
    write_table("NVIDIA H200", "9.0", "skinny", {(1, 8, 16): "gemv:n8:k16:s1:w4:st2"}, directory=tmp_path)
    write_table("NVIDIA H200", "9.0", "moe", {(1, 768, 2048): "m16:n64:k128:w4:st3"}, directory=tmp_path)
    path = write_table("NVIDIA H100 80GB HBM3", "9.0", "moe", {(8, 768, 2048): "m16:n64:k64:w8:st4"},
                       directory=tmp_path)
    h100 = read_file(path)
    assert h100.skinny == read_file(tmp_path / "NVIDIA_H200.json").skinny
    assert set(h100.moe) == {(8, 768, 2048)}, "the H200's moe entries are not the H100's measured ones"
    assert json.loads(path.read_text())["copied"] == {"skinny": "NVIDIA H200"}
    write_table("NVIDIA H100 80GB HBM3", "9.0", "skinny", {(1, 8, 16): "dot:n16:k16:s1:w4:st2"}, directory=tmp_path)
    record = json.loads(path.read_text())
    assert record["copied"] == {} and record["tables"]["skinny"] == {"1x8x16": "dot:n16:k16:s1:w4:st2"}


def test_a_sweep_writes_its_section_merging_or_replacing(tmp_path):
    path = write_table("NVIDIA H200", "9.0", "gate_up", {(64, 8, 16): "dot:n16:k16:s1:w4:st2"}, directory=tmp_path)
    write_table("NVIDIA H200", "9.0", "gate_up", {(1, 8, 16): "dot:n16:k16:s1:w4:st3"}, directory=tmp_path)
    assert set(read_file(path).gate_up) == {(1, 8, 16), (64, 8, 16)}
    write_table("NVIDIA H200", "9.0", "gate_up", {(1, 8, 16): "dot:n16:k16:s1:w4:st4"}, directory=tmp_path,
                replace=True)
    assert {k: c.stages for k, c in read_file(path).gate_up.items()} == {(1, 8, 16): 4}
    assert json.loads(path.read_text())["tables"]["gate_up"] == {"1x8x16": "dot:n16:k16:s1:w4:st4"}
    with pytest.raises(ValueError, match="section 'tuned'"):
        write_table("NVIDIA H200", "9.0", "tuned", {}, directory=tmp_path)
    with pytest.raises(ValueError, match="is not like"):
        write_table("NVIDIA H200", "9.0", "skinny", {(1, 8, 16): "fast"}, directory=tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "enginewright-tuned-kernels", "tables": {"skinny": {"1x8": "x"}}}))
    with pytest.raises(ValueError, match=r"bad.json, section 'skinny': shape '1x8'"):
        read_file(bad)


def test_the_grouped_expert_tilings_are_a_section_the_moe_layer_looks_up_by_tokens(tmp_path):
    from serving.engine.gemm_config import GroupedConfig
    from serving.engine.moe_gemm import config_for

    path = write_table("NVIDIA H100 80GB HBM3", "9.0", "moe",
                       {(1, 768, 2048): "m16:n64:k128:w4:st4", (64, 768, 2048): "m16:n128:k128:w8:st3"},
                       directory=tmp_path)
    moe = read_file(path).moe
    assert moe[(1, 768, 2048)] == GroupedConfig(16, 64, 128, 4, 4)
    assert config_for(1, 128, moe, inter=768, dim=2048).block_n == 64
    assert config_for(8, 128, moe, inter=768, dim=2048).block_n == 128  # the least tuned count >= 8
    assert config_for(4096, 128, moe, inter=768, dim=2048).warps == 8  # past the table: its largest
    assert config_for(1, 128, moe, inter=512, dim=2048) == GroupedConfig(16, 32, 64)  # another shape: the default
    assert config_for(512, 128, {}, inter=768, dim=2048) == GroupedConfig(64, 64, 32)
    with pytest.raises(ValueError, match="grouped GEMM config 'dot:n16:k16:s1:w4:st2' is not like"):
        write_table("NVIDIA H200", "9.0", "moe", {(1, 8, 16): "dot:n16:k16:s1:w4:st2"}, directory=tmp_path)


def test_the_package_ships_its_tuned_files():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"engine/tuned/*.json"' in text


@pytest.fixture
def cuda_tensors(monkeypatch):
    """Layers whose weights report CUDA (the routes are picked; nothing is launched)."""
    from serving.engine import skinny_gemm

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(skinny_gemm, "triton", object())


def triton_options(**tables) -> EngineOptions:
    return with_tuned(EngineOptions(decode_gemm="triton"), **{k: parse_table(v) for k, v in tables.items()})


def test_a_float_layer_picks_the_tuned_kernel_per_rows_bucket(cuda_tensors):
    layer = FloatLinear(64, 256, bias=False)
    options = triton_options(skinny={(1, 256, 64): "gemv:n16:k16:s2:w4:st3"},
                             gate_up={(64, 128, 64): "dot:n16:k16:s1:w4:st3"})
    layer.apply_options(options)
    x = torch.zeros(65, 64)
    assert pick(layer.routes, x[:1]) == Skinny(GemmConfig("gemv", 16, 16, 2))
    assert isinstance(pick(layer.routes, x[:2]), TorchLinear)  # no 64-row config: cuBLAS
    assert isinstance(pick(layer.routes, x), TorchLinear)  # prompt rows
    assert pick(layer.gated_routes, x[:64]) == GateUpKernel(GemmConfig("dot", 16, 16, 1))
    assert isinstance(pick(layer.gated_routes, x[:1]), Unfused)
    layer.apply_options(dataclasses.replace(options, decode_gate_up=False))
    assert isinstance(pick(layer.gated_routes, x[:64]), Unfused)
    layer.apply_options(dataclasses.replace(options, decode_gemm="torch"))
    assert all(isinstance(route, TorchLinear) for _, route in layer.routes)


def test_an_int8_layer_runs_the_weight_only_kernel_at_decode_rows_and_dequantizes_prompts(cuda_tensors):
    layer = Int8Linear(64, 256, bias=False, dtype=torch.bfloat16)
    layer.apply_options(triton_options())
    x = torch.zeros(65, 64)
    assert isinstance(pick(layer.routes, x[:1]), Skinny) and pick(layer.routes, x[:64]).scaled
    assert isinstance(pick(layer.routes, x), Dequantized)
    layer.apply_options(EngineOptions())
    assert all(isinstance(route, Dequantized) for _, route in layer.routes)


def test_layers_on_the_cpu_compute_what_they_did():
    """The CPU routes: F.linear for float layers and a tied head, the reference for quantized ones."""
    from serving.engine.model import ModelArgs
    from serving.engine.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs("LlamaForCausalLM", 64, 16, 1, 2, 1, 8, 32, 1e-5, 64, tie_word_embeddings=True))
    head = model.head()
    assert isinstance(head, TiedHead) and head.weight is model.tok_embeddings.weight
    assert "tied_head" not in str(list(model.state_dict()))
    x = torch.randn(3, 16)
    from serving.engine.linears import apply_options

    apply_options(model, resolve_options(torch.device("cpu")))
    torch.testing.assert_close(head(x), x @ model.tok_embeddings.weight.T)
    wqkv = model.layers[0].attention.wqkv
    torch.testing.assert_close(wqkv(x), torch.nn.functional.linear(x, wqkv.weight, wqkv.bias))


# ---------------------------------------------------------------------------------------------
# no module-level mutable switch


def module_level_bools(path: Path) -> list[str]:
    """`NAME = True/False` (annotated or not) at a module's top level."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and isinstance(value.value, bool):
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {t.id}" for t in targets if isinstance(t, ast.Name)]
    return found


def is_bool(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, bool)


def switch_writes(path: Path) -> list[str]:
    """`<name>.<UPPER_CASE> = True/False` and `mock.patch.object(<name>, "UPPER_CASE", True/False)` /
    `monkeypatch.setattr(<name>, "UPPER_CASE", True/False)`: a module's switch flipped from outside."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and is_bool(node.value):
            found += [ast.unparse(t) for t in node.targets
                      if isinstance(t, ast.Attribute) and t.attr.isupper() and isinstance(t.value, ast.Name)]
        elif (isinstance(node, ast.Call) and len(node.args) >= 3 and isinstance(node.args[1], ast.Constant)
              and ast.unparse(node.func).endswith(("patch.object", "setattr")) and is_bool(node.args[2])
              and isinstance(node.args[1].value, str) and node.args[1].value.isupper()):
            found.append(f"{ast.unparse(node.args[0])}.{node.args[1].value}")
    return [f"{path.relative_to(ROOT)}: {w}" for w in found]


def test_no_module_level_switch_in_serving():
    bools = [hit for path in sorted((ROOT / "serving").rglob("*.py")) for hit in module_level_bools(path)]
    assert not bools, f"module-level booleans (make them EngineOptions fields): {bools}"
    writes = [hit for top in ("serving", "tests", "bench") if (ROOT / top).is_dir()
              for path in sorted((ROOT / top).rglob("*.py")) for hit in switch_writes(path)]
    assert not writes, f"module settings changed from outside (pass an EngineOptions instead): {writes}"


def test_the_scan_finds_a_switch(tmp_path):
    probe = ROOT / "tests" / "_switch_probe.py"
    probe.write_text("FAST = True\nimport x\nx.FAST = False\nmock.patch.object(x, 'FAST', True)\n")
    try:
        assert module_level_bools(probe) == ["tests/_switch_probe.py:1 FAST"]
        assert switch_writes(probe) == ["tests/_switch_probe.py: x.FAST", "tests/_switch_probe.py: x.FAST"]
    finally:
        probe.unlink()


def test_options_are_read_from_the_model_not_getattr():
    sources = [(p, p.read_text()) for p in (ROOT / "serving").rglob("*.py")]
    assert not [str(p) for p, text in sources if 'getattr(model, "decode_' in text]
    assert not [str(p) for p, text in sources if "_linear_fn" in text or "_gate_up_fn" in text]
    assert options_module.OVERRIDABLE[0] == "decode_gemm"


def test_the_h200_tables_route_every_llama_8b_fp8_decode_gemm_to_the_split_k_fp8_kernel(cuda_tensors, monkeypatch):
    """What the tables were tuned for: on the H200 every Llama-3.1-8B fp8 projection at 1 and 2-64 rows runs the
    split-K FP8 kernel, prompt rows `_scaled_mm`; the bf16 layers the skinny kernel where it beat cuBLAS."""
    from serving.engine.linear_fp8 import Fp8Linear
    from serving.engine.linear_routes import SplitKFp8, TensorCores

    monkeypatch.setattr(Fp8Linear, "takes_tensor_cores", lambda self: True)
    options = dataclasses.replace(EngineOptions(decode_gemm="triton"), tuned=read_file(TUNED_DIR / "NVIDIA_H200.json"))
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        fp8 = Fp8Linear(k, n, bias=False, dtype=torch.bfloat16)
        fp8.apply_options(options)
        bf16 = FloatLinear(k, n, bias=False, device="meta")
        bf16.apply_options(options)
        for rows in (1, 2, 15, 16, 64):
            assert isinstance(pick(fp8.routes, torch.zeros(rows, k)), SplitKFp8), (n, k, rows)
        assert isinstance(pick(fp8.routes, torch.zeros(65, k)), TensorCores), (n, k)
        assert isinstance(pick(bf16.routes, torch.zeros(64, k)), Skinny), (n, k)
