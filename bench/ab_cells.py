"""The previous tree's throughput bench beside the current one's, cell by cell, old and new alternating.

`drive` (what `bench/device_previous_vs_current.sh` runs, stdlib only) starts one worker process per tree for
one quantization, each building its random weights once, and hands them the cells in turn: a cell is one
`bench throughput` call (a number of requests of one workload), run by the old worker (sides static and paged)
and then the new one (side engine), or the other way round on every other cell, so that a drift of the GPU's
clocks over the run falls on both trees alike. The worker that waits holds its weights only (its runners,
caches and CUDA graphs are freed after each cell), so both fit on one GPU.

`worker` runs inside a tree (its root the working directory): it imports that tree's throughput bench
(`serving.bench.throughput` at aa3684c, `bench.throughput` now), reads one cell a line from stdin as JSON
(`{"name", "out", "config"}`, `config` the tree's `ThroughputConfig` fields) and answers `done <name> <rc>` on
stdout. Each tree's bench builds its model inside `bench_throughput`; the worker hands it the same model every
cell (the tree's `Transformer` and `quantized_model` replaced, for this process, by ones that build once), which
is what keeps one process per tree and quantization.

`table` prints, per cell and metric (output tok/s, TPOT p50), old static, old paged, new and the ratios.

Run: `python3 bench/ab_cells.py drive --old .ab/old --new . --out DIR --quantization none`, then
`python3 bench/ab_cells.py table DIR` (bench/device_previous_vs_current.sh runs both). Imports: stdlib; a worker imports torch and its tree's bench.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

TREES = {  # tree -> (its throughput bench's package, the module its bench builds the model from)
    "old": ("serving.bench", "serving.engine.model"),
    "new": ("bench", "serving.engine.models.llama"),
}
DONE = "done"


def cell_configs(requests: int, *, shape: str, workload: tuple[int, int], quantization: str,
                 fraction: float, old_fraction: float, num_blocks: int | None = None) -> dict[str, dict[str, Any]]:
    """Each tree's `ThroughputConfig` fields for one cell of `requests` requests: the previous tree's static
    engine at `requests` cache rows (512 from 1,024 requests: its device script's setting), its paged engine
    and the current engine at `requests` live requests. The current engine's pool takes `fraction` of the free
    memory, the previous paged one `old_fraction` (0.6 in its device script: its static cache and the static
    side's prompt steps need the rest), or both `num_blocks` blocks (the CPU has no free-memory figure)."""
    common = {"shape": shape, "requests": requests, "input_len": workload[0], "output_len": workload[1],
              "quantization": quantization, "num_blocks": num_blocks,
              "warmup_requests": max(1, min(128, requests // 8)),
              "max_num_tokens": 16384 if requests >= 1024 else 8192}
    return {"old": {**common, "sides": ["static", "paged"], "static_batch": min(requests, 512),
                    "paged_live": requests, "free_mem_fraction": old_fraction},
            "new": {**common, "sides": ["engine"], "max_live": requests, "free_mem_fraction": fraction}}


class Worker:
    """One tree's worker process, cells in on stdin, `done` lines out on stdout (its log: everything else)."""

    def __init__(self, tree: str, root: Path, device: str, log: Path) -> None:
        self.tree = tree
        self.log = log.open("a")
        env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "worker", "--tree", tree,
                                      "--device", device], cwd=root, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def run(self, name: str, out: Path, config: dict[str, Any]) -> int:
        """Run one cell; its exit status (1: it failed, see the log; -1: the worker is gone)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"name": name, "out": str(out), "config": config}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return -1
        for line in self.proc.stdout:
            if line.startswith(f"{DONE} {name} "):
                return int(line.split()[-1])
            self.log.write(line)
            self.log.flush()
        return -1

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def drive(args: argparse.Namespace) -> int:
    """Every cell of one quantization; returns the number of cells that failed. `--sequential`: the old worker's
    cells, then the new one's, each process alone on the GPU (where two sets of weights and a 1,024-request pool
    do not fit together: an 80 GB H100 at the 8B shape); else both workers live, old and new alternating."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = tuple(int(x) for x in args.workload.split("/"))
    started = time.monotonic()
    roots = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    for tree, root in roots.items():
        if not (root / TREES[tree][0].replace(".", "/") / "throughput.py").is_file():
            raise SystemExit(f"ab_cells: --{tree} {str(root)!r} has no {TREES[tree][0]}.throughput (the tree's root?)")
    cells = []  # (tree, requests) in the order they run
    for i, requests in enumerate(int(x) for x in args.cells.split(",")):
        cells += [(tree, requests) for tree in (("old", "new") if (i + args.flip) % 2 == 0 else ("new", "old"))]
    if args.sequential:
        cells = sorted(cells, key=lambda cell: cell[0] != ("old" if args.flip % 2 == 0 else "new"))
    workers: dict[str, Worker] = {}
    failed = 0
    try:
        for tree, requests in cells:
            name = f"{tree}-{args.quantization}-t{requests}"
            if time.monotonic() - started > args.deadline_s:
                print(f"[{time.monotonic() - started:.0f} s] {name}: skipped, past --deadline-s {args.deadline_s}",
                      flush=True)
                failed += 1
                continue
            if args.sequential:
                for other in [t for t in workers if t != tree]:
                    workers.pop(other).close()
            if tree not in workers:
                workers[tree] = Worker(tree, roots[tree], args.device, out / f"{tree}-{args.quantization}.log")
            configs = cell_configs(requests, shape=args.shape, workload=workload,  # type: ignore[arg-type]
                                   quantization=args.quantization, fraction=args.fraction,
                                   old_fraction=args.old_fraction, num_blocks=args.num_blocks)
            rc = workers[tree].run(name, out / f"{name}.json", configs[tree])
            failed += rc != 0
            print(f"[{time.monotonic() - started:.0f} s] {name} rc={rc}", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    return failed


class Once:
    """`build` called the first time only; later calls get its first answer (`built`)."""

    def __init__(self, build: Any) -> None:
        self.build = build
        self.built: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.built is None:
            self.built = self.build(*args, **kwargs)
        return self.built


def worker(args: argparse.Namespace) -> int:
    """Serve cells from stdin with this tree's throughput bench (see the module doc)."""
    import gc
    import importlib
    from unittest import mock

    import torch

    package, model_module = TREES[args.tree]
    throughput = importlib.import_module(f"{package}.throughput")
    quantized = importlib.import_module(f"{package}.quantized")
    models = importlib.import_module(model_module)
    quantize = Once(quantized.quantized_model)
    model = Once(partial(base_model, models.Transformer, quantize))
    with mock.patch.object(models, "Transformer", model), mock.patch.object(quantized, "quantized_model", quantize):
        for line in sys.stdin:
            cell = json.loads(line)
            config = {**cell["config"], "sides": tuple(cell["config"]["sides"])}
            rc = 0
            try:
                throughput.bench_throughput(throughput.ThroughputConfig(**config), device=args.device,
                                            out_json=Path(cell["out"]),
                                            progress=lambda text: print(text, file=sys.stderr, flush=True))
            except Exception as exc:  # noqa: BLE001 - any failed cell (OOM, a refused setting) is reported, the next one runs
                print(f"{cell['name']} failed: {exc!r}", file=sys.stderr, flush=True)
                rc = 1
            for built in (model.built, quantize.built):
                if built is not None:
                    release_static_caches(built)
            if quantize.built is not None:
                model.built = None  # the quantized model's bf16 base: the later cells get one on the meta device
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(f"{DONE} {cell['name']} {rc}", flush=True)
    return 0


def base_model(transformer: Any, quantize: Once, *args: Any, **kwargs: Any) -> Any:
    """The tree's `Transformer`, built on the meta device once the quantized model it feeds is built (the bench
    builds the base every cell; `quantize` then answers with the model it built the first time)."""
    import torch

    if quantize.built is None:
        return transformer(*args, **kwargs)
    with torch.device("meta"):
        return transformer(*args, **kwargs)


def release_static_caches(model: Any) -> None:
    """Drop the previous tree's static KV caches (its `setup_caches` hangs them on the model the cells share), so
    that the next cell and the other worker size their pools without them."""
    for layer in model.layers:
        if "kv_cache" in layer.attention._modules or "kv_cache" in vars(layer.attention):
            layer.attention.kv_cache = None


METRICS = (("output tok/s", lambda side: side["output_tok_s"]), ("TPOT p50 ms", lambda side: side["tpot_ms"]["p50"]))


def side_figures(path: Path) -> dict[str, dict[str, Any]]:
    """A tree's report of one cell -> {side: its figures}; {} when the cell wrote none."""
    if not path.is_file():
        return {}
    return {side["side"]: side for side in json.loads(path.read_text())["sides"]}


def render_table(out: Path) -> str:
    """One line per cell and metric: old static, old paged, new, new/old-static, new/old-paged ("-": missing)."""
    cells = sorted({p.stem.split("-", 1)[1] for p in out.glob("*-t*.json")},
                   key=lambda c: (c.rsplit("-t", 1)[0] != "none", c.rsplit("-t", 1)[0], int(c.rsplit("-t", 1)[1])))
    head = f"{'cell':<12} {'metric':<13} {'old static':>11} {'old paged':>11} {'new':>11} {'new/static':>11} {'new/paged':>10}"
    lines = [head, "-" * len(head)]
    for cell in cells:
        old, new = side_figures(out / f"old-{cell}.json"), side_figures(out / f"new-{cell}.json")
        quant, requests = cell.rsplit("-t", 1)
        for metric, read in METRICS:
            figures = [read(old["static"]) if "static" in old else None, read(old["paged"]) if "paged" in old else None,
                       read(new["engine"]) if "engine" in new else None]
            ratios = [figures[2] / f if figures[2] is not None and f else None for f in figures[:2]]
            text = [f"{f:>11.1f}" if f is not None else f"{'-':>11}" for f in figures]
            text += [f"{r:>11.3f}" if r is not None else f"{'-':>11}" for r in ratios]
            lines.append(f"{('bf16' if quant == 'none' else quant) + ' x' + requests:<12} {metric:<13} " + " ".join(text))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/ab_cells.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    drv = sub.add_parser("drive", help="run the cells of one quantization, old and new alternating")
    drv.add_argument("--old", required=True, help="the previous tree's root (a `git archive` of aa3684c)")
    drv.add_argument("--new", default=".", help="the current tree's root")
    drv.add_argument("--out", required=True)
    drv.add_argument("--quantization", default="none")
    drv.add_argument("--shape", default="llama-3.1-8b")
    drv.add_argument("--workload", default="128/128", help="input/output tokens per request")
    drv.add_argument("--cells", default="1,64,1024", help="requests of each cell, comma list")
    drv.add_argument("--fraction", type=float, default=0.85, help="the current engine's pool: its share of the free memory")
    drv.add_argument("--old-fraction", type=float, default=0.6, help="the previous paged engine's pool: its share of "
                     "the memory free beside its static cache")
    drv.add_argument("--sequential", action="store_true", help="the old worker's cells, then the new one's (each "
                     "process alone on the GPU), not alternating")
    drv.add_argument("--num-blocks", type=int, help="each pool's blocks (default: --fraction; needed on a CPU)")
    drv.add_argument("--device", default="auto")
    drv.add_argument("--flip", type=int, default=0, help="1: the first cell runs new before old")
    drv.add_argument("--deadline-s", type=float, default=1e9, help="skip the cells starting after this many seconds")
    tab = sub.add_parser("table", help="the table of a drive's reports")
    tab.add_argument("out", type=Path, help="the folder the drives wrote")
    wrk = sub.add_parser("worker", help="serve cells from stdin inside one tree (started by drive)")
    wrk.add_argument("--tree", choices=sorted(TREES), required=True)
    wrk.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    if args.mode == "table":
        print(render_table(args.out))
        return 0
    return min(drive(args), 1) if args.mode == "drive" else worker(args)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # the tree's root, not bench/ (whose module names would shadow)
    raise SystemExit(main())
