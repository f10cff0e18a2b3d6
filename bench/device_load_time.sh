#!/usr/bin/env bash
# How long an engine takes to load, first and second time on a machine (one H200, from the repo root, wheels of bench/device_wheels.sh in $WHL,
# default .whl/): in one call,
#  - the 1B engine built (random bf16 weights -> HF checkpoint -> convert -> build; max batch 64, 256 positions),
#  - offline: its first load against its second (`bench load-pair`: each in a fresh process sharing one Triton
#    cache folder that starts empty; the second finds the kernels the first compiled),
#  - Triton: the same engine as a decoupled llm model, loaded by a first server then a second one (one Triton
#    cache folder, empty at the first), model load to ready and one request,
#  - while the second serves it: the fit check (tasks.fit.check_fits, Triton's GPU memory metrics) of a
#    candidate built from the same checkpoint with limits that fit an empty GPU but not beside the live one.
# Results under $OUT: steps.log, load-pair.json, triton.json, triton-*.log. OFFLINE=0 skips the offline pair,
# FIT=0 the fit check (each ~40 s of device time); LAYERS=4 builds the 1B shape with 4 layers and PROFILE=1 adds a
# cProfile'd second offline load (the breakdown: LAYERS=4 PROFILE=1 TRITON=0, ~110 s); TRITON=0 skips Triton;
# KEYS=1 logs every Triton compile's cache key in the servers' processes and reports, per kernel compiled by
# both loads, which parts of its key differ (bench/triton_keys.py).
# Also read from the environment (default): TRITON_S=150.
set -u
OUT=${OUT:-/tmp/load-time-out}
WHL=${WHL:-.whl}
W=/tmp/lc
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} >>"$OUT/steps.log" 2>&1

(  # the Triton stub's venv (numpy 1.26 shadows the image's numpy 2), tritonclient, pydantic for tasks.fit
  set -e
  python3 -m venv --without-pip --system-site-packages /tmp/venv
  SP=$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SP" \
    "$WHL"/numpy-1.26.4-*.whl "$WHL"/python_rapidjson-*.whl "$WHL"/pyd/*.whl
  python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    >"$SP/zz-system-packages.pth"
  tar -xJf "$WHL"/pytriton-312.tar.xz -C "$SP"
  cp -r "$WHL"/site/tritonclient "$SP"/
  if [ "${KEYS:-0}" = 1 ]; then  # every process of this venv logs its Triton cache keys (bench/triton_keys.py)
    echo "import os, sys; os.environ.get('TRITON_KEY_LOG') and (sys.path.insert(0, '$PWD'), __import__('bench.triton_keys', fromlist=['install']).install(__import__('pathlib').Path(os.environ['TRITON_KEY_LOG'])))" >"$SP/zz-triton-keys.pth"
  fi
) >>"$OUT/steps.log" 2>&1 &
VENV_PID=$!

timeout 100 python3 -c 'import sys; from pathlib import Path; from bench import models
from bench.served import build_random_engine
models.SHAPES["lc"] = {**models.SHAPES["llama-3.2-1b"], "num_hidden_layers": int(sys.argv[1])}
print(build_random_engine("lc", Path("/tmp/lc"), max_batch_size=64, max_seq_len=256))' "${LAYERS:-16}" >>"$OUT/steps.log" 2>&1
log "engine built rc=$?"
if [ "${OFFLINE:-1}" = 1 ]; then
  timeout 300 python3 -m bench load-pair --engine "$W/engine" --work "$W/offline" --out "$OUT/load-pair.json" \
    ${PROFILE:+--profile} >"$OUT/load-pair.log" 2>&1
  cp "$W"/offline/second-profile.txt "$OUT"/ 2>/dev/null
  log "load pair rc=$?"
fi
wait $VENV_PID; log "venv rc=$?"

if [ "${TRITON:-1}" = 1 ]; then
[ "${KEYS:-0}" = 1 ] && export TRITON_KEY_LOG=$W/keys
PATH=/tmp/venv/bin:$PATH timeout "${TRITON_S:-150}" /tmp/venv/bin/python - "$W" "$OUT" <<'PY' >"$OUT/triton-run.log" 2>&1
import json, os, sys
from pathlib import Path

from bench.load_time import run_triton_loads

work, out = Path(sys.argv[1]), Path(sys.argv[2])


def fit_check(metrics_url: str, http_url: str) -> dict:
    from serving.engine import EngineLimits, build_engine, read_engine_info
    from serving.engine.memory import kv_cache_bytes
    from serving.triton.metrics import scrape
    from tasks.fit import HEADROOM_FRACTION, INSTANCE_OVERHEAD_BYTES, CandidateDoesNotFit, check_fits, device_memory
    from tasks.targets import Target

    gpu = device_memory(scrape(metrics_url), "gpu")[0]
    live = read_engine_info(work / "engine").model
    per_seq = kv_cache_bytes(n_layers=live.n_layers, n_kv_heads=live.n_kv_heads, head_dim=live.head_dim,
                             max_batch_size=1, max_seq_len=8192, dtype="bfloat16")
    weights = sum(p.stat().st_size for p in (work / "engine").glob("*.pt"))
    # needs more than the room beside the live engine, less than an empty GPU's room
    target = gpu.room_bytes() + gpu.used_bytes // 2
    batch = (target - weights - INSTANCE_OVERHEAD_BYTES["gpu"]) // per_seq
    cand = build_engine(work / "ckpt", work / "candidate", limits=EngineLimits(
        "bfloat16", max_batch_size=int(batch), max_input_len=8191, max_seq_len=8192)).path
    result = {"gpu_total": gpu.total_bytes, "gpu_used": gpu.used_bytes, "candidate_max_batch_size": int(batch),
              "empty_gpu_room": int(gpu.total_bytes * (1 - HEADROOM_FRACTION))}
    try:
        result["checked"] = check_fits([Target(http_url, work / "repo", "device run", metrics_url)], cand, device="cuda")
        result["refused"] = False
    except CandidateDoesNotFit as exc:
        result.update(refused=True, message=str(exc))
    print("FIT", result, flush=True)
    return result


report = run_triton_loads(work / "engine", work / "triton",
                          during_second=fit_check if os.environ.get("FIT", "1") == "1" else None)
(out / "triton.json").write_text(json.dumps(report, indent=1))
PY
log "triton rc=$?"
fi
cp "$W"/triton/triton-*.log "$OUT"/ 2>/dev/null
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/steps.log"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for name in ("load-pair.json", "triton.json"):
    try:
        rep = json.loads((out / name).read_text())
    except Exception as exc:
        print(name, "missing", exc)
        continue
    for label, fig in rep.items():
        if not isinstance(fig, dict):
            print(name, label, json.dumps(fig)[:3000])
            continue
        print(name, label, {k: v for k, v in fig.items() if k not in ("log", "during_second")})
        for line in fig.get("log", []):
            print("   ", line)
        if "during_second" in fig:
            print("   FIT", fig["during_second"])
PY
[ "${KEYS:-0}" = 1 ] && python3 -m bench.triton_keys "$W/keys" 2>&1 | tee "$OUT/triton-keys.txt"
log done
