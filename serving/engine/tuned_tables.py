"""The decode kernels' tuned configs: per-device data files under `serving/engine/tuned/`, read at load.

One JSON file per GPU model, named by its CUDA device name with spaces as underscores (`NVIDIA_H200.json`,
as vLLM names its fused-MoE configs), written by the sweeps (`write_table`), read once when an engine's
options are resolved (`tables_for`). A file records the device and compute capability it was measured on
and one table per kernel family (`SECTIONS`), each `"<rows bucket>x<N>x<K>": "<config text>"`
(`gemm_config.GemmConfig`). A GPU with no file of its own takes the file of a GPU of the same compute
capability (a config that fits one GPU's shared memory fits another of the same capability); a GPU with
neither, and the CPU, have no tuned configs (cuBLAS everywhere, the quantized weights' default config).

Imports: stdlib and torch only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from serving.engine.gemm_config import GemmConfig, GroupedConfig, Shape, parse_table

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
FORMAT = "enginewright-tuned-kernels"
SECTIONS = {
    "skinny": "bf16 / fp16 weights: the skinny split-K kernels (where they beat cuBLAS)",
    "skinny_fp8": "quantized weights (e4m3, and int8 where `skinny_int8` has no entry): the weight-only kernels",
    "skinny_int8": "int8 weights where they run another config than e4m3 ones",
    "fp8": "e4m3 tokens x e4m3 weights on the FP8 tensor cores, split-K (`fp8_gemm`)",
    "gate_up": "silu(gate) * up in one kernel, bf16 / fp16 w13 (rows bucket, I, D)",
    "gate_up_quantized": "silu(gate) * up in one kernel, quantized w13 (rows bucket, I, D)",
    "moe": "the grouped expert GEMMs, e4m3 / int8 experts (tokens, moe intermediate I, D): `bench.moe --sweep`",
}
CONFIG_KINDS = {"moe": GroupedConfig}  # the sections whose configs are not GemmConfig texts

Table = Mapping[Shape, GemmConfig]


def _empty() -> Table:
    return MappingProxyType({})


@dataclass(frozen=True)
class TunedTables:
    """The tuned configs of one device, by kernel family (`SECTIONS`); empty where nothing was tuned."""

    source: str = "none"  # the file they were read from, or "none"
    skinny: Table = field(default_factory=_empty, compare=False)
    skinny_fp8: Table = field(default_factory=_empty, compare=False)
    skinny_int8: Table = field(default_factory=_empty, compare=False)
    fp8: Table = field(default_factory=_empty, compare=False)
    gate_up: Table = field(default_factory=_empty, compare=False)
    gate_up_quantized: Table = field(default_factory=_empty, compare=False)
    moe: Mapping[Shape, GroupedConfig] = field(default_factory=_empty, compare=False)

    @classmethod
    def from_record(cls, record: Mapping, *, source: str) -> TunedTables:
        """The tables of one file's JSON record; an unknown section or a bad key or config names the file."""
        tables = record.get("tables", {})
        unknown = sorted(set(tables) - set(SECTIONS))
        if record.get("format") != FORMAT or unknown:
            raise ValueError(f"tuned kernel file {source}: format {record.get('format')!r} (expected {FORMAT!r}), "
                             f"unknown sections {unknown} (known: {sorted(SECTIONS)})")
        parsed = {}
        for section, entries in tables.items():
            try:
                parsed[section] = MappingProxyType(parse_table({shape_of(key): text for key, text in entries.items()},
                                                               CONFIG_KINDS.get(section, GemmConfig)))
            except ValueError as exc:
                raise ValueError(f"tuned kernel file {source}, section {section!r}: {exc}") from None
        return cls(source=source, **parsed)


def shape_of(key: str) -> Shape:
    """"64x4096x14336" -> (64, 4096, 14336)."""
    parts = key.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"shape {key!r} is not like '<rows bucket>x<N>x<K>', e.g. '64x4096x14336'")
    rows, n, k = map(int, parts)
    return rows, n, k


def key_of(shape: Shape) -> str:
    return "x".join(map(str, shape))


def file_name(device_name: str) -> str:
    """"NVIDIA H200" -> "NVIDIA_H200.json"."""
    return device_name.strip().replace(" ", "_").replace("/", "_") + ".json"


def read_file(path: Path) -> TunedTables:
    return TunedTables.from_record(json.loads(path.read_text()), source=path.name)


def tables_for(device: torch.device, directory: Path = TUNED_DIR) -> TunedTables:
    """The tuned configs for `device`: its own file, else one measured on the same compute capability, else
    none (module doc)."""
    if device.type != "cuda":
        return TunedTables()
    own = directory / file_name(torch.cuda.get_device_name(device))
    if own.is_file():
        return read_file(own)
    shared = capability_file("{}.{}".format(*torch.cuda.get_device_capability(device)), directory)
    return read_file(shared) if shared is not None else TunedTables()


def capability_file(capability: str, directory: Path = TUNED_DIR) -> Path | None:
    """The first file (by name) measured on a GPU of this compute capability: what a GPU without its own reads."""
    for path in sorted(directory.glob("*.json")):
        if json.loads(path.read_text()).get("capability") == capability:
            return path
    return None


def write_table(device_name: str, capability: str, section: str, table: Mapping[Shape, str], *,
                directory: Path = TUNED_DIR, replace: bool = False) -> Path:
    """Record a sweep's `table` as `section` of the device's file (created if missing, from the tables the device
    read until now: `_new_record`): its entries added to those measured there (`replace`: instead of them).
    Returns the file."""
    if section not in SECTIONS:
        raise ValueError(f"tuned kernel section {section!r}: expected one of {sorted(SECTIONS)}")
    for text in table.values():
        CONFIG_KINDS.get(section, GemmConfig).parse(text)
    path = directory / file_name(device_name)
    record = json.loads(path.read_text()) if path.is_file() else _new_record(device_name, capability, directory)
    entries = {} if replace or section in record.get("copied", {}) else dict(record["tables"].get(section, {}))
    entries.update({key_of(shape): text for shape, text in sorted(table.items())})
    record["tables"][section] = dict(sorted(entries.items(), key=lambda item: shape_of(item[0])))
    record.get("copied", {}).pop(section, None)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _new_record(device_name: str, capability: str, directory: Path) -> dict:
    """A device's first file: the tables it read until now (`capability_file`, as `tables_for` reads it),
    each such section named in `copied` with the device it was measured on until a sweep here writes it; without
    them one section's sweep would leave the device no configs for the others."""
    record = {"format": FORMAT, "device": device_name, "capability": capability, "tables": {}}
    shared = capability_file(capability, directory)
    if shared is not None:
        source = json.loads(shared.read_text())
        record["tables"] = dict(source.get("tables", {}))
        record["copied"] = {section: source.get("device", shared.stem) for section in record["tables"]}
    return record
