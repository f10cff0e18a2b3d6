#!/usr/bin/env bash
# The paged engine served (one H200, from the repo root, wheels carried in .whl/: bench/device_wheels.sh),
# in one call: Llama-3.1-8B shape, random bf16 weights quantized per QUANT (default fp8), 128/128,
#  1. offline: `bench throughput`, the engine side alone, REQUESTS (1,024) at once, 1,024 live, 16,384 tokens a step;
#  2. served: the same shape built as an engine folder with those KV cache settings, loaded by the bundled Triton
#     (decoupled llm model), CLIENTS (16) streaming gRPC clients x LANES (64) requests in flight each, one
#     request per lane after a warm-up round, set against step 1's figure; one run per variant in $VARIANTS
#     (`bench served --variant`, e.g. "interval20:stream_interval_ms=20").
# Env: WARMUP_LANES (requests each client sends at once in the served warm-up round; 0: all its lanes, default 1),
#      OFFLINE_RUNS (measured offline runs, the last one kept; default 1: a process's first run is ~10% slower),
#      PER_LANE (timed requests each lane sends one after the other; default 1),
#      SHARED_PREFIX (leading prompt tokens every served request shares; default 0; a variant with
#      prefix_caching=true serves them from the prefix cache),
#      PYSPY (1: sample the first variant's model stub with py-spy, native frames, every thread, from its start to
#      its unload, PYSPY_RATE a second (default 100): `.whl/py-spy`, the binary of the py-spy wheel, carried; it
#      pauses the stub at each sample, so that variant's figures are not comparable).
# Results under $OUT: steps.log, offline.json/.log, served.json/.log, triton.log, pyspy-llm.txt (collapsed stacks).
# Also read from the environment (default): BUILD_S=240, FRACTION=0.85, OFFLINE=1, OFFLINE_S=200, SERVED_S=360.
set -u
OUT=${OUT:-/tmp/served-paged-out}
W=/tmp/sp
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
QUANT=${QUANT:-fp8}
bash bench/device_venv.sh >>"$OUT/steps.log" 2>&1 &
VENV_PID=$!
if [ "${OFFLINE:-1}" = 1 ]; then
  timeout "${OFFLINE_S:-200}" python3 -m bench throughput --shape llama-3.1-8b --quantization "$QUANT" \
    --workload 128/128 --requests "${REQUESTS:-1024}" --max-live 1024 --max-num-tokens 16384 \
    --free-mem-fraction 0.9 --warmup-requests 128 --runs "${OFFLINE_RUNS:-1}" --out "$OUT/offline.json" \
    >"$OUT/offline.log" 2>&1
  log "offline rc=$?: $(grep -E '^ *engine' "$OUT/offline.log" | cut -c1-300)"
fi
# the engine folder built by the image's python (transformers needs its numpy 2; the venv's 1.26 is for the stub)
timeout "${BUILD_S:-240}" python3 -c "
from pathlib import Path
from bench.served import build_random_engine
from serving.engine.kv_cache import KVCacheConfig
print(build_random_engine('llama-3.1-8b', Path('$W'), max_batch_size=1024, max_seq_len=256, quantization='$QUANT',
                          kv_cache=KVCacheConfig(max_num_tokens=16384, free_mem_fraction=${FRACTION:-0.85})))
" >"$OUT/build.log" 2>&1
log "build rc=$?: $(tail -n 1 "$OUT/build.log")"
wait $VENV_PID; log "venv rc=$?"
VARIANT_ARGS=()
for v in ${VARIANTS:-}; do VARIANT_ARGS+=(--variant "$v"); done
if [ "${PYSPY:-0}" = 1 ] && [ -x .whl/py-spy ]; then
  ( for _ in $(seq 600); do PID=$(pgrep -f 'python_backend_stub.*/bench_' | head -n 1); [ -n "$PID" ] && break; sleep 0.5; done
    echo "py-spy on pid ${PID:-none}"
    [ -n "${PID:-}" ] && .whl/py-spy record --pid "$PID" --rate "${PYSPY_RATE:-100}" --native --threads --idle \
      --format raw --output "$OUT/pyspy-llm.txt" ) >"$OUT/pyspy.log" 2>&1 &
fi
( export PATH=/tmp/venv/bin:$PATH
  timeout "${SERVED_S:-360}" /tmp/venv/bin/python -m bench served --shape llama-3.1-8b --quantization "$QUANT" \
    --max-batch-size 1024 --max-num-tokens 16384 --free-mem-fraction "${FRACTION:-0.85}" \
    --clients "${CLIENTS:-16}" --lanes-per-client "${LANES:-64}" --requests-per-client "${PER_LANE:-1}" \
    --prompt-len 128 --gen-len 128 --warmup-lanes "${WARMUP_LANES:-1}" --shared-prefix "${SHARED_PREFIX:-0}" \
    --work "$W" --offline-json "$OUT/offline.json" \
    --out "$OUT/served.json" \
    "${VARIANT_ARGS[@]}" ) >"$OUT/served.log" 2>&1
log "served rc=$?"
grep -E '"(output_tok_s|served_over_offline_e2e|n_errors|most_in_flight|ttft_ms_p50|ttft_ms_p99|itl_ms_p50|itl_ms_p99|tpot_ms_p50|tokens_per_response|load_s|build_s)"' \
  "$OUT/served.log" | tee -a "$OUT/steps.log"
cp -f "$W/triton.log" "$OUT/" 2>/dev/null
log "done"
