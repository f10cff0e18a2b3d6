"""The validation gate's HF side, kept in the work dir keyed by content, so releases of one checkpoint share it.

``tasks.validate.reference_run`` is the costliest part of a release on the CPU (HF float32 greedy on every
prompt and teacher-forced logits of every passage, then HF again at the engine's precision). Its float32
side depends only on the checkpoint's content, the spec's prompts / passages / token counts, the engine's
max_seq_len and max_input_len (the long prompts), the device kind and the torch / transformers versions; the peer (HF at the engine's precision)
also on that precision. Each is stored once under ``<work_dir>/references/``:
- ``<key>.pt``: the float32 side (prompt ids, greedy tokens with their top-N, teacher-forced ids and logits);
- ``<key>-<precision>.pt``: that precision's peer figures beside it.
So a bfloat16 build reuses the float32 side of the checkpoint's float32 build, a rebuild with other limits
or a faulty build of the same checkpoint reuses all of it, and a release re-run after a crash recomputes
nothing. Files are written aside and renamed (a killed write leaves no entry).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tasks.hashing import value_digest

log = logging.getLogger(__name__)

FLOAT32 = "float32"


@dataclass(frozen=True)
class ReferenceCache:
    """Where the HF reference runs of one checkpoint are kept, and that checkpoint's content digest
    (``ConvertedCheckpoint.source_digest``: the release already computed it)."""

    folder: Path
    checkpoint_digest: str

    def run(self, checkpoint: Path, spec: Any, precision: str, *, device: torch.device | str,
            max_seq_len: int | None, max_input_len: int | None = None) -> Any:
        """`tasks.validate.reference_run`'s result for these arguments, from the cache or computed and stored."""
        from tasks.validate import reference_run

        key = self.key(spec, device=device, max_seq_len=max_seq_len, max_input_len=max_input_len)
        base = self._load_base(key, checkpoint)
        if base is None:
            base = reference_run(checkpoint, spec, FLOAT32, device=device, max_seq_len=max_seq_len,
                                 max_input_len=max_input_len)
            self._store(self.folder / f"{key}.pt", _base_record(base))
        if precision == FLOAT32:
            return base
        peer_path = self.folder / f"{key}-{_file_safe(precision)}.pt"
        if peer_path.is_file():
            log.info("validation reference: cache hit, HF at %s from %s", precision, peer_path)
            peer = torch.load(peer_path, weights_only=True)
            return _with_peer(base, precision, peer)
        run = reference_run(checkpoint, spec, precision, device=device, max_seq_len=max_seq_len, base=base,
                            max_input_len=max_input_len)
        self._store(peer_path, {"peer": asdict(run.peer) if run.peer else None, "peer_diverged": run.peer_diverged})
        return run

    def key(self, spec: Any, *, device: torch.device | str, max_seq_len: int | None,
            max_input_len: int | None = None) -> str:
        """What the float32 side depends on, hashed: checkpoint content, spec fields, limits, device, toolchain."""
        import transformers

        from tasks.evaluation import load_evaluation

        passages = spec.passages if spec.passages is not None else list(load_evaluation().passages)
        return value_digest({
            "checkpoint": self.checkpoint_digest,
            "prompts": list(spec.prompts), "passages": passages, "max_new_tokens": spec.max_new_tokens,
            "top_logprobs": spec.top_logprobs, "max_seq_len": max_seq_len, "device": torch.device(device).type,
            "max_input_len": max_input_len, "long_prompts": spec.envelope.long_prompts,
            "torch": torch.__version__, "transformers": transformers.__version__,
        })[:24]

    def _load_base(self, key: str, checkpoint: Path) -> Any:
        from transformers import AutoTokenizer

        from tasks.validate import ReferenceRun, _Side

        path = self.folder / f"{key}.pt"
        if not path.is_file():
            return None
        log.info("validation reference: cache hit, HF float32 from %s", path)
        r = torch.load(path, weights_only=True)
        return ReferenceRun(FLOAT32, r["prompt_ids"], [_Side(s["tokens"], s["top"]) for s in r["greedy"]],
                            r["sequences"], r["logits"], None, 0, r["eos_ids"], r["texts"],
                            AutoTokenizer.from_pretrained(checkpoint), r["prompt_labels"])

    def _store(self, path: Path, record: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.{os.getpid()}")
        torch.save(record, aside)
        aside.replace(path)


def _base_record(run: Any) -> dict:
    return {"prompt_ids": run.prompt_ids, "greedy": [{"tokens": s.tokens, "top": s.top} for s in run.greedy],
            "sequences": run.sequences, "logits": run.logits, "eos_ids": run.eos_ids, "texts": run.texts,
            "prompt_labels": run.prompt_labels}


def _with_peer(base: Any, precision: str, record: dict) -> Any:
    from tasks.token_stats import DistanceFigures

    peer = DistanceFigures(**record["peer"]) if record["peer"] is not None else None
    return replace(base, precision=precision, peer=peer, peer_diverged=record["peer_diverged"])


def _file_safe(precision: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in precision)
