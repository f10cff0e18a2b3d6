#!/usr/bin/env bash
# The paged engine on the device (one H200, from the repo root, no wheels needed), in one call:
#  - the GPU tests of the paged decode graphs and the paged attention kernel,
#  - `bench throughput`, Llama-3.1-8B shape, random bf16 weights, 128/128: 1,024 requests with the static
#    engine at 512 cache rows beside the paged one at 1,024 live (the pool from 60% of the free memory: at
#    90% the decode graphs of 22 batch buckets beside the static engine's did not fit; 1,024 requests of
#    128/128 need 9,216 blocks of 32, the pool has about 14,000); the paged engine alone at 512 live; then 64
#    requests (64 rows / 64 live) and 1 request, each pair side by side in one process.
# Results under $OUT: steps.log, gpu-tests.log, t<N>.json/.log.
set -u
OUT=${OUT:-/tmp/paged-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv >>"$OUT/steps.log" 2>&1
if [ -n "${TESTS-tests/test_paged_decode.py tests/test_paged_attention.py}" ]; then
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-120}" python3 -m pytest -q -rfEs -p no:cacheprovider ${TESTS-tests/test_paged_decode.py tests/test_paged_attention.py} \
    >"$OUT/gpu-tests.log" 2>&1
  log "gpu tests rc=$?: $(tail -n 1 "$OUT/gpu-tests.log")"
fi
bench() {  # name, timeout, args...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m serving.bench throughput --shape "${SHAPE:-llama-3.1-8b}" --workload 128/128 "$@" \
    --out "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  log "$name rc=$?:"
  grep -E "^ *(static|paged):|model " "$OUT/$name.log" | tee -a "$OUT/steps.log"
}
bench t1024 "${T1024_S:-300}" --requests 1024 --static-batch 512 --paged-live 1024 --free-mem-fraction 0.6
[ $(($(date +%s) - T0)) -lt "${P512_UNTIL_S:-400}" ] && \
  bench p512 "${P512_S:-120}" --requests 1024 --sides paged --paged-live 512 --free-mem-fraction 0.6 --warmup-requests 16
[ -n "${SMALL-1}" ] || exit 0
bench t64 "${T64_S:-120}" --requests 64 --static-batch 64 --paged-live 64 --warmup-requests 16
[ $(($(date +%s) - T0)) -lt "${T1_UNTIL_S:-200}" ] && \
  bench t1 "${T1_S:-60}" --requests 1 --static-batch 1 --paged-live 1 --warmup-requests 1
log "done"
