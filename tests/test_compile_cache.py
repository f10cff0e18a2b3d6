"""The decode step's compile cache (serving/engine/compile_cache.py): keying, verification, ignore on mismatch.

CPU, every run, cheap: torch's own save/load of compile artifacts is replaced by a recorder where a test needs
artifacts (a CPU inductor compile takes minutes on a busy 2-core machine); torch's real functions are called
where they need no compile (nothing recorded -> nothing stored; bytes torch cannot read -> ignored). The real
round trip, a compiled 1B step restored in a fresh process, is measured on the H200
(serving/bench/device_loadcache.sh, docs/performance.md).
"""

from __future__ import annotations

import json
import os
import tarfile
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from serving.engine.compile_cache import (
    ARTIFACTS_FILE,
    RECORD_FILE,
    TRITON_FILE,
    CompileCache,
    cache_key,
    cache_root,
    decode_step_cache,
    kept,
    key_digest,
    pin_ptxas,
    source_digest,
    unpack_folders,
)
from serving.engine.options import EngineOptions

CPU = torch.device("cpu")
SETTINGS = {"compile": "auto", "decode_pdl": True}


class Torch:
    """Stands in for torch.compiler.save/load_cache_artifacts: what was saved, what was loaded."""

    def __init__(self, blob: bytes = b"artifacts of a compiled step") -> None:
        self.blob = blob
        self.loaded: list[bytes] = []

    def save(self):
        return self.blob, {"inductor": ["fx-key"]}

    def load(self, data: bytes) -> dict[str, list[str]]:
        self.loaded.append(data)
        return {"inductor": ["fx-key"]}


def make(root: Path, fake: Torch, *, fingerprint: str = "f" * 64, key: dict | None = None,
         lines: list[str] | None = None, triton_dir: Path | None = None) -> CompileCache:
    key = key or cache_key(fingerprint, CPU, SETTINGS)
    log = lines.append if lines is not None else None
    return CompileCache(root, key, log=log, save=fake.save, load=fake.load,
                        triton_dir=triton_dir or root.parent / f"triton-of-{root.name}")


def kernel_folder(triton_dir: Path, name: str, *, mtime: float | None = None) -> Path:
    folder = triton_dir / name
    folder.mkdir(parents=True)
    for file in ("k.cubin", "k.json"):
        (folder / file).write_bytes(name.encode() + b" " + file.encode())
        if mtime is not None:
            os.utime(folder / file, (mtime, mtime))
    return folder


def test_the_key_names_toolchain_gpu_engine_code_and_settings():
    key = cache_key("a" * 64, CPU, SETTINGS)
    assert key["torch"] == torch.__version__ and key["cuda"] == torch.version.cuda
    assert (key["gpu"], key["compute_capability"]) == ("cpu", "cpu")
    assert key["engine_fingerprint"] == "a" * 64 and key["engine_source"] == source_digest()
    assert key["settings"] == SETTINGS
    digests = {key_digest(key), key_digest({**key, "torch": "9.9.9"}), key_digest({**key, "gpu": "NVIDIA H100"}),
               key_digest(cache_key("b" * 64, CPU, SETTINGS)), key_digest(cache_key("a" * 64, CPU, {"decode_pdl": False}))}
    assert len(digests) == 5


def test_the_source_digest_follows_the_engine_code(tmp_path):
    (tmp_path / "step.py").write_text("x = 1\n")
    before = source_digest(tmp_path)
    (tmp_path / "step.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != before


def test_a_stored_entry_is_restored_by_the_next_load(tmp_path):
    first, second = Torch(), Torch()
    entry = make(tmp_path, first).store()
    record = json.loads((entry / RECORD_FILE).read_text())
    assert record["files"][ARTIFACTS_FILE]["bytes"] == len(first.blob)
    assert record["torch_info"] == {"inductor": ["fx-key"]}
    lines: list[str] = []
    restored = make(tmp_path, second, lines=lines).restore()
    assert restored is not None and restored.entry == entry
    assert second.loaded == [first.blob]
    assert "restored" in lines[-1]
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # nothing left aside


def test_another_toolchain_is_logged_and_ignored(tmp_path):
    make(tmp_path, Torch()).store()
    here = {**cache_key("f" * 64, CPU, SETTINGS), "torch": "2.99.0"}
    fake, lines = Torch(), []
    assert make(tmp_path, fake, key=here, lines=lines).restore() is None
    assert fake.loaded == []
    assert any("ignored: not this toolchain" in line and "2.99.0" in line for line in lines)


def test_a_record_whose_key_differs_from_its_place_is_ignored(tmp_path):
    entry = make(tmp_path, Torch()).store()
    record = json.loads((entry / RECORD_FILE).read_text())
    record["key"]["gpu"] = "NVIDIA H100 80GB HBM3"
    (entry / RECORD_FILE).write_text(json.dumps(record))
    fake, lines = Torch(), []
    assert make(tmp_path, fake, lines=lines).restore() is None
    assert fake.loaded == [] and "its key differs (gpu: 'NVIDIA H100 80GB HBM3' -> 'cpu')" in lines[-1]


@pytest.mark.parametrize("damage", ["truncated", "edited", "record unreadable", "artifacts missing",
                                    "triton kernels edited"])
def test_a_damaged_entry_is_ignored_never_loaded(tmp_path, damage):
    kernel_folder(tmp_path / "triton", "K1")
    entry = make(tmp_path / "root", Torch(), triton_dir=tmp_path / "triton").store(since=time.time() - 60)
    blob = entry / (TRITON_FILE if damage == "triton kernels edited" else ARTIFACTS_FILE)
    if damage == "truncated":
        blob.write_bytes(blob.read_bytes()[:5])
    elif damage == "edited":
        blob.write_bytes(b"X" + blob.read_bytes()[1:])
    elif damage == "record unreadable":
        (entry / RECORD_FILE).write_text("{not json")
    elif damage == "artifacts missing":
        blob.unlink()
    else:
        blob.write_bytes(blob.read_bytes() + b"\0")
    fake, lines = Torch(), []
    assert make(tmp_path / "root", fake, lines=lines, triton_dir=tmp_path / "fresh").restore() is None
    assert fake.loaded == [] and not (tmp_path / "fresh").exists()
    assert "ignored" in lines[-1] and "compiling without it" in lines[-1]


def test_bytes_torch_cannot_read_are_ignored(tmp_path):
    make(tmp_path, Torch(b"not torch's serialization")).store()
    lines: list[str] = []
    cache = CompileCache(tmp_path, cache_key("f" * 64, CPU, SETTINGS), log=lines.append)  # torch's own load
    assert cache.restore() is None
    assert "torch could not load it" in lines[-1]


def test_nothing_compiled_stores_nothing(tmp_path):
    lines: list[str] = []
    cache = CompileCache(tmp_path, cache_key("f" * 64, CPU, SETTINGS), log=lines.append)  # torch's own save
    assert cache.store() is None
    assert not cache.entry.exists() and "nothing to store" in lines[-1]


def test_an_entry_already_there_is_kept(tmp_path):
    entry = make(tmp_path, Torch(b"first")).store()
    assert make(tmp_path, Torch(b"second")).store() == entry
    assert (entry / ARTIFACTS_FILE).read_bytes() == b"first"


def test_an_unwritable_root_loses_only_the_cache(tmp_path):
    root = tmp_path / "file-not-folder"
    root.write_text("")
    lines: list[str] = []
    assert make(root, Torch(), lines=lines).store() is None
    assert "not stored" in lines[-1]


def test_kept_stores_after_a_compile_without_a_cache_and_restores_next_time(tmp_path):
    first = Torch()
    with kept(make(tmp_path, first)) as restored:
        assert restored is None
    second = Torch()
    with kept(make(tmp_path, second)) as restored:
        assert restored is not None
    assert second.loaded == [first.blob]


def test_kept_stores_nothing_when_the_compile_fails(tmp_path):
    cache = make(tmp_path, Torch())
    with pytest.raises(RuntimeError), kept(cache):
        raise RuntimeError("compile failed")
    assert not cache.entry.exists()
    with kept(None) as restored:
        assert restored is None


def test_where_an_llm_model_keeps_its_caches(tmp_path):
    repo_model = tmp_path / "repo" / "demo_v3"
    assert cache_root(None, repo_model) == tmp_path / "repo" / ".compile-cache"
    assert cache_root("", repo_model) == tmp_path / "repo" / ".compile-cache"
    assert cache_root(str(tmp_path / "per-device"), repo_model) == tmp_path / "per-device"
    assert cache_root("OFF", repo_model) is None


def test_a_runner_without_cuda_graphs_has_no_cache(tmp_path):
    class CpuRunner:
        graphs = None

    assert decode_step_cache(CpuRunner(), tmp_path, pdl=True) is None


def test_a_save_that_fails_is_logged_and_loses_only_the_cache(tmp_path):
    def broken():
        raise RuntimeError("cannot pickle")

    lines: list[str] = []
    cache = CompileCache(tmp_path, cache_key("f" * 64, CPU, SETTINGS), log=lines.append, save=broken)
    assert cache.store() is None
    assert "torch could not save its artifacts: RuntimeError: cannot pickle" in lines[-1]


class GraphsRunner:
    """What the llm model's engine thread needs of a runner with CUDA graphs, on the CPU."""

    class Graphs:
        def warm_up(self) -> None:
            GraphsRunner.calls.append("warm")

    calls: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.graphs = self.Graphs()
        self.device = CPU
        self.model = type("Model", (), {"options": EngineOptions(decode_attention="triton", decode_gemm="triton")})()
        self.info = type("Info", (), {"fingerprint": "e" * 64})()

    def compile_decode(self, *, pdl: bool) -> None:
        self.calls.append(f"compile pdl={pdl}")


def test_the_llm_models_engine_thread_restores_and_stores_around_its_compile(tmp_path):
    from serving.triton.models.llm import EngineThread

    lines: list[str] = []
    log = type("Log", (), {"prefix": "m_v1", "info": staticmethod(lines.append), "error": staticmethod(lines.append)})
    from serving.engine.compile_cache_prune import Pruning

    GraphsRunner.calls = []
    unstaged = make(tmp_path, Torch(), fingerprint="d" * 64).store()
    EngineThread(GraphsRunner(), log, device_id=None, compile_decode=True, warmup=True, compile_cache_root=tmp_path,
                 compile_cache_pruning=Pruning(staged=frozenset({"e" * 64}))).prepare_decode()
    assert GraphsRunner.calls == ["compile pdl=True", "warm"]
    assert any("no entry yet" in line for line in lines)  # restore looked first
    assert "FX graph cache hit 0, miss 0, bypass 0" in lines[-3]
    assert "nothing to store" in lines[-2]  # torch's own save: nothing compiled here
    assert "removed (its engine is no longer staged" in lines[-1] and not unstaged.exists()


def test_the_triton_kernels_a_compile_wrote_are_kept_and_put_back(tmp_path):
    first_triton, second_triton = tmp_path / "triton-1", tmp_path / "triton-2"
    kernel_folder(first_triton, "OLD", mtime=time.time() - 3600)  # there before the compile
    with kept(make(tmp_path / "root", Torch(), triton_dir=first_triton)):
        kernel_folder(first_triton, "NEW")  # what the compile's JIT wrote
    record = json.loads(next((tmp_path / "root").glob(f"*/*/{RECORD_FILE}")).read_text())
    assert record["triton_kernel_folders"] == 1 and TRITON_FILE in record["files"]
    lines: list[str] = []
    with kept(make(tmp_path / "root", Torch(), triton_dir=second_triton, lines=lines)) as restored:
        assert restored is not None
    assert sorted(p.name for p in second_triton.iterdir()) == ["NEW"]
    assert (second_triton / "NEW" / "k.cubin").read_bytes() == b"NEW k.cubin"
    assert "(2 Triton cache files)" in lines[0]


def test_kernels_put_back_under_another_cache_root_are_found_there(tmp_path):
    """Triton's group record names the kernel's files by absolute path and takes a missing path as a miss: put
    back under another root, the record must point at the files there (else every kernel compiles again)."""
    first_triton, second_triton = tmp_path / "triton-1", tmp_path / "triton-2"
    with kept(make(tmp_path / "root", Torch(), triton_dir=first_triton)):
        folder = kernel_folder(first_triton, "NEW")
        (folder / "__grp__k.json").write_text(json.dumps(
            {"child_paths": {name: str(folder / name) for name in ("k.cubin", "k.json")}}))
        names_only = kernel_folder(first_triton, "NAMES")  # a Triton that records the names alone
        (names_only / "__grp__k.json").write_text(json.dumps({"child_paths": ["k.cubin", "k.json"]}))
    with kept(make(tmp_path / "root", Torch(), triton_dir=second_triton)) as restored:
        assert restored is not None
    paths = json.loads((second_triton / "NEW" / "__grp__k.json").read_text())["child_paths"]
    assert paths == {name: str(second_triton / "NEW" / name) for name in ("k.cubin", "k.json")}
    assert all(Path(p).is_file() for p in paths.values())
    assert json.loads((second_triton / "NAMES" / "__grp__k.json").read_text()) == {"child_paths": ["k.cubin", "k.json"]}


def test_an_archive_reaching_outside_its_folder_is_refused(tmp_path):
    outside = tmp_path / "evil.txt"
    outside.write_text("x")
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(outside, arcname="../evil.txt")
    with pytest.raises(ValueError, match="not a plain file or folder inside it"):
        unpack_folders(archive, tmp_path / "triton")


def stored_entry(root: Path, fingerprint: str, *, used_unix: float, size: int = 100) -> Path:
    """An entry of `fingerprint` under `root` holding `size` bytes, last used at `used_unix`."""
    entry = make(root, Torch(b"x" * size), fingerprint=fingerprint).store()
    os.utime(entry / RECORD_FILE, (used_unix, used_unix))
    return entry


def staged_repository(tmp_path: Path, *fingerprints: str) -> Path:
    repo = tmp_path / "repo"
    for i, fingerprint in enumerate(fingerprints):
        engine = repo / f"m_v{i + 1}" / "1" / "engine"
        engine.mkdir(parents=True)
        (engine / "engine.json").write_text(json.dumps({"fingerprint": fingerprint}))
    return repo


def test_entries_of_engines_no_longer_staged_are_removed(tmp_path):
    from serving.engine.compile_cache_prune import prune_entries, pruning_for

    repo = staged_repository(tmp_path, "a" * 64, "b" * 64)
    root = repo / ".compile-cache"
    now = time.time()
    live, candidate, gone = (stored_entry(root, c * 64, used_unix=now - 10) for c in "abc")
    lines: list[str] = []
    pruning = pruning_for(None, repo / "m_v2")
    assert pruning is not None and pruning.staged == {"a" * 64, "b" * 64}
    assert prune_entries(root, pruning, keep=candidate, log=lines.append) == [gone]
    assert live.is_dir() and candidate.is_dir() and not gone.parent.exists()
    assert "its engine is no longer staged" in lines[0]
    assert not list(root.rglob(".*"))  # nothing left aside


def test_the_least_recently_used_entries_go_beyond_the_cap_never_the_loads_own(tmp_path):
    from serving.engine.compile_cache_prune import Pruning, cache_entries, prune_entries

    root, now = tmp_path / "cache", time.time()
    oldest, own, newest = (stored_entry(root, c * 64, used_unix=now - age, size=1000) for c, age in
                           (("a", 300), ("b", 200), ("c", 100)))
    size = cache_entries(root)[0].bytes  # the blob and its record
    assert prune_entries(root, Pruning(max_bytes=2 * size), keep=own) == [oldest]
    assert prune_entries(root, Pruning(max_bytes=size // 2), keep=own) == [newest]  # over the cap: own stays
    assert [e.path for e in cache_entries(root)] == [own]


def test_a_restore_marks_its_entry_used_and_a_named_folder_is_only_capped(tmp_path):
    from serving.engine.compile_cache_prune import pruning_for

    entry = stored_entry(tmp_path / "cache", "f" * 64, used_unix=time.time() - 3600)
    assert make(tmp_path / "cache", Torch()).restore() is not None
    assert (entry / RECORD_FILE).stat().st_mtime > time.time() - 60
    assert pruning_for(str(tmp_path / "shared"), tmp_path / "repo" / "m_v1").staged is None
    assert pruning_for("off", tmp_path / "repo" / "m_v1") is None
    assert pruning_for(None, tmp_path / "empty" / "m_v1").staged is None  # no engines found: none go for that


def test_the_ptxas_torch_ships_is_pinned_before_any_kernel_even_after_inductor_chose_once(tmp_path, monkeypatch):
    """Triton's cache key holds the ptxas version; inductor points Triton at torch's ptxas only once it compiles in
    this process, so the engine pins that choice up front (a first and a second load of one engine assembled its
    kernels with two ptxas and found none of them again). A TRITON_PTXAS_PATH already set is kept."""
    from torch._inductor.runtime import compile_tasks

    ptxas = tmp_path / "torch" / "bin" / "ptxas"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    monkeypatch.setattr(compile_tasks, "__file__", str(tmp_path / "torch" / "runtime" / "compile_tasks.py"))
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    compile_tasks._set_triton_ptxas_path()  # inductor's choice once, before the variable is unset again
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    pin_ptxas()
    assert os.environ["TRITON_PTXAS_PATH"] == str(ptxas)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/cuda/bin/ptxas")
    pin_ptxas()
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/cuda/bin/ptxas"
