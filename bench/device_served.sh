#!/usr/bin/env bash
# The 1B engine offline and served by Triton to 64 streaming clients (one H200, from the repo root, wheels carried in .whl/): in one call,
#  - the python backend's send benchmark, 1/2/4/8 threads (SKIP_SENDS=1 to skip),
#  - the 1B engine built (random bf16 weights -> HF checkpoint -> convert -> build) and timed offline at
#    batch 64, 128/128, compiled decode in CUDA graphs (system python: the image's numpy 2),
#  - the same engine served by the bundled Triton (decoupled llm model, in-flight batching) to 64
#    concurrent streaming gRPC clients; Triton's stub and the clients run in /tmp/venv, where numpy 1.26
#    shadows the image's numpy 2 (the bundled python backend sends empty tensors with numpy 2),
#    with every variant of the llm model's parameters in $VARIANTS measured in turn,
#  - the bf16 parity test (tests/test_engine_gpu.py -k parity), then the GPU tests ($GPU_TESTS, -k $GPU_TESTS_K), while Triton
#    loads and compiles; the clients wait for them, so nothing else is on the GPU while they are timed.
# Whole script <= ~560 s. Results under $OUT: steps.log, sends.json/.log, offline.json/.log, served.json/.log,
# parity.json/.log, gpu-tests.log, triton.log.
# Also read from the environment (default): SKIP_GPU_TESTS=0, SKIP_PARITY=0, SWEEP_BEFORE_S=470, TOTAL_S=560,
#  VIA_STREAM=0.
set -u
OUT=${OUT:-/tmp/served-out}
W=/tmp/bs
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
{ nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
  python3 -c 'import sys, numpy, torch; print(sys.version.split()[0], "numpy", numpy.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)'
  nproc; } >>"$OUT/steps.log" 2>&1

bash bench/device_venv.sh >>"$OUT/steps.log" 2>&1 &
VENV_PID=$!

# pydantic (tasks.validate) for the parity test; prefect is only its @task decorator: a shim
(
  set -e
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-val .whl/pyd/*.whl
  mkdir -p /tmp/site-val/prefect
  printf 'def task(*args, **kwargs):\n    if args and callable(args[0]):\n        return args[0]\n    return lambda fn: fn\n' \
    >/tmp/site-val/prefect/__init__.py
) >>"$OUT/steps.log" 2>&1 &
VAL_PID=$!

timeout 200 python3 -m bench engine-offline --shape llama-3.2-1b --batch 64 --prompt-len 128 --gen-len 128 \
  --max-batch-size 64 --work "$W" --out "$OUT/offline.json" --built-marker "$W/built" >"$OUT/offline.log" 2>&1 &
OFF_PID=$!
wait $VENV_PID; log "venv rc=$?"
# the python backend's sends, one thread vs several (CPU only; overlaps the engine build, not its timing)
if [ "${SKIP_SENDS:-0}" != 1 ]; then
  ( export PATH=/tmp/venv/bin:$PATH
    timeout 90 /tmp/venv/bin/python -m bench sends --work /tmp/sends --out "$OUT/sends.json" ) >"$OUT/sends.log" 2>&1
  log "sends rc=$?: $(grep -c 'final responses' "$OUT/sends.log") thread counts"
fi
wait $VAL_PID; log "validation site rc=$?"
while [ ! -e "$W/built" ] && kill -0 $OFF_PID 2>/dev/null; do sleep 1; done
log "engine built: $(cat "$W/built" 2>/dev/null)"


wait $OFF_PID; log "offline rc=$?"
touch "$W/offline.done"
# served starts once the offline figure is taken (Triton's compile and graph capture would disturb it)
SRV_T=$((${TOTAL_S:-560} - ($(date +%s) - T0)))
VARIANTS=${VARIANTS:-"default nogather:admit_gap_ms=0 idle2:idle_senders=2 again"}
VARIANT_ARGS=(); for v in $VARIANTS; do VARIANT_ARGS+=(--variant "$v"); done
[ "${VIA_STREAM:-0}" = 1 ] && VARIANT_ARGS+=(--via-stream-router)  # each variant again through <release>_stream
log "served: ${SRV_T} s left"
(
  export PATH=/tmp/venv/bin:$PATH
  timeout "$SRV_T" /tmp/venv/bin/python -m bench served --shape llama-3.2-1b --clients 64 --requests-per-client 16 \
    --prompt-len 128 --gen-len 128 --max-batch-size 64 --work "$W" --out "$OUT/served.json" \
    --wait-for "$W/offline.done" --wait-for "$W/parity.done" --offline-json "$OUT/offline.json" "${VARIANT_ARGS[@]}"
) >"$OUT/served.log" 2>&1 &
SRV_PID=$!
if [ "${SKIP_PARITY:-0}" != 1 ]; then
  PYTHONPATH=/tmp/site-val ENGINEWRIGHT_PARITY_JSON="$OUT/parity.json" timeout 150 \
    python3 -m pytest -q -s -p no:cacheprovider tests/test_engine_gpu.py -k parity >"$OUT/parity.log" 2>&1
  log "parity rc=$?"
fi
if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider \
    ${GPU_TESTS:-tests/test_engine_gpu.py tests/test_decode_attention.py tests/test_decode_graphs.py} \
    -k "${GPU_TESTS_K:-not parity}" >"$OUT/gpu-tests.log" 2>&1
  log "gpu tests rc=$?: $(tail -n 1 "$OUT/gpu-tests.log")"
fi
touch "$W/parity.done"
wait $SRV_PID; log "served rc=$?"
tail -c 2000000 "$W/triton.log" >"$OUT/triton.log" 2>/dev/null
# the decode attention's tuning knobs, while time is left (GPU otherwise idle now)
if [ "$(($(date +%s) - T0))" -lt "${SWEEP_BEFORE_S:-470}" ]; then
  PYTHONPATH=. timeout 110 python3 tests/test_decode_attention.py --sweep >"$OUT/sweep.log" 2>&1
  log "sweep rc=$?"
fi
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/steps.log"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as exc:
        return {"missing": repr(exc)}
off, srv, par = load("offline.json"), load("served.json"), load("parity.json")
snd = load("sends.json")
for k, fig in snd.get("threads", {}).items():
    print("SENDS", k, "threads:", round(fig["median_ms"], 2), "ms per burst of", snd["burst"], fig["samples_ms"])
print("OFFLINE", {k: off.get(k) for k in ("impl", "decode_tok_s", "e2e_tok_s", "ttft_ms_p50", "tpot_ms_p50", "missing")})
print("SCHEDULER", {k: v for k, v in off.get("scheduler", {}).items()}, off.get("scheduler_over_e2e"))
print("SERVED", {k: v for k, v in srv.items() if k not in ("samples", "offline", "variants")})
for label, fig in srv.get("variants", {}).items():
    print("VARIANT", label, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in fig.items()
                             if k not in ("samples", "via_stream_router")})
    if "via_stream_router" in fig:
        print("VIA_STREAM_ROUTER", label, {k: (round(v, 3) if isinstance(v, float) else v)
                                           for k, v in fig["via_stream_router"].items() if k != "samples"})
for name in ("peaked", "standard_init"):
    e = par.get(name, {})
    print("PARITY", name, {k: v for k, v in e.items() if k != "gate"})
    if "gate" in e:
        print("GATE", e["gate"]["passed"], e["gate"]["failures"], e["gate"]["metrics"])
PY
log done
