#!/usr/bin/env bash
# The engine on the device (one H200, from the repo root, no wheels needed), in one call:
#  - the GPU tests of the decode graphs, the paged attention kernel and the row kernels,
#  - `bench throughput`, Llama-3.1-8B shape, random bf16 weights, 128/128: 1,024 requests at 1,024 live and
#    16,384 tokens a step three ways (as shipped; without running a step ahead; with its row work as torch
#    ops), the pool from 60% of the free memory (1,024 requests of 128/128 need 9,216 blocks of 32), each
#    side warmed on 128 requests (one full prompt step); then 64 requests (64 live) and 1 request.
#    (The previous commit beside this one: bench/device_previous_vs_current.sh.)
# Env: QUANT (engine.quantization of the weights, default none), KV (the pool's kv_cache_dtype), SIDES (the 1,024-request sides), WORKLOAD
#      (default 128/128), REQUESTS (default 1024), SMALL= (skip the 64- and 1-request runs), T1024= (skip the
#      1,024-request run), EXTRA (more `bench throughput` arguments for it, e.g. --profile-decode 1024), SMALL_SIDES
#      (the 64- and 1-request runs' sides, default engine; e.g. engine,engine-pdl), RUNS (measured runs
#      of each 1,024-request side, default 1; 2 for an A/B: the first run of a process is slower).
# Results under $OUT: steps.log, gpu-tests.log, t<N>.json/.log.
# Also read from the environment (default): FRACTION=0.6, SHAPE=llama-3.1-8b, T1024_S=330, T1_S=60,
#  T1_UNTIL_S=420, T64_S=120, TESTS=tests/test_paged_decode.py tests/test_paged_attention.py
#  tests/test_paged_rope.py tests/test_prefill_attention.py tests/test_row_norm.py tests/test_silu_mul.py,
#  TESTS_S=120.
set -u
OUT=${OUT:-/tmp/throughput-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv >>"$OUT/steps.log" 2>&1
if [ -n "${TESTS-tests/test_paged_decode.py tests/test_paged_attention.py tests/test_paged_rope.py tests/test_prefill_attention.py tests/test_row_norm.py tests/test_silu_mul.py}" ]; then
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-120}" python3 -m pytest -q -rfEs -p no:cacheprovider ${TESTS-tests/test_paged_decode.py tests/test_paged_attention.py tests/test_paged_rope.py tests/test_prefill_attention.py tests/test_row_norm.py tests/test_silu_mul.py} \
    >"$OUT/gpu-tests.log" 2>&1
  log "gpu tests rc=$?: $(tail -n 1 "$OUT/gpu-tests.log")"
fi
bench() {  # name, timeout, args...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m bench throughput --shape "${SHAPE:-llama-3.1-8b}" --workload "${WORKLOAD:-128/128}" \
    --quantization "${QUANT:-none}" --kv-cache-dtype "${KV:-auto}" "$@" \
    --out "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  log "$name rc=$?:"
  grep -E "^ *(engine[a-z0-9-]*):|model " "$OUT/$name.log" | cut -c1-520 | tee -a "$OUT/steps.log"
}
[ -z "${T1024-1}" ] || bench t1024 "${T1024_S:-330}" --requests "${REQUESTS:-1024}" --max-live 1024 --max-num-tokens 16384 \
  --free-mem-fraction "${FRACTION:-0.6}" --warmup-requests 128 --sides "${SIDES:-engine,engine-sync,engine-torch-ops}" \
  --runs "${RUNS:-1}" \
  ${EXTRA:-}
[ -n "${SMALL-1}" ] || exit 0
bench t64 "${T64_S:-120}" --requests 64 --max-live 64 --warmup-requests 16 --sides "${SMALL_SIDES:-engine}"
[ $(($(date +%s) - T0)) -lt "${T1_UNTIL_S:-420}" ] && \
  bench t1 "${T1_S:-60}" --requests 1 --max-live 1 --warmup-requests 1 --sides "${SMALL_SIDES:-engine}"
log "done"
