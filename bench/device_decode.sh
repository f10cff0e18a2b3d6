#!/usr/bin/env bash
# The decode step on the device (one H200, from the repo root, no wheels needed): in one call,
#  - the GPU tests of the engine and its kernels (TESTS="" to skip; GPU_TESTS_K filters; TESTS_AFTER=1
#    runs them after the benchmarks instead of before),
#  - `bench offline` on each of $SHAPES (128/128, batch 1 and 64): the engine side by side with the HF peers
#    ($PEERS, "" for none). (The decode graphs' kernels: `bench throughput --profile-decode 1,64`.)
# Results under $OUT: steps.log, gpu-tests.log, offline-<shape>.json/.log.
# Also read from the environment (default): OFFLINE_S=300, TESTS_S=240.
set -u
OUT=${OUT:-/tmp/decode-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv >>"$OUT/steps.log" 2>&1

TESTS=${TESTS-"tests/test_skinny_gemm.py tests/test_engine_gpu.py tests/test_paged_decode.py tests/test_gate_up.py"}
gpu_tests() {
  [ -n "$TESTS" ] || return 0
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-240}" python3 -m pytest -q -rfE -p no:cacheprovider $TESTS -k "${GPU_TESTS_K:-not parity}" \
    >"$OUT/gpu-tests.log" 2>&1
  log "gpu tests rc=$?: $(tail -n 1 "$OUT/gpu-tests.log")"
}
[ "${TESTS_AFTER:-0}" = 1 ] || gpu_tests  # before the benchmarks, or after them (TESTS_AFTER=1)
for shape in ${SHAPES:-llama-3.2-1b llama-3.1-8b}; do
  timeout "${OFFLINE_S:-300}" python3 -m bench offline --shapes "$shape" --workloads 128/128 --batch-sizes 1,64 \
    --peers "${PEERS-hf-eager,hf-static-compile}" --no-check \
    --out "$OUT/offline-$shape.json" >"$OUT/offline-$shape.log" 2>&1
  log "offline $shape rc=$?"
  grep -E "decode .*tok/s" "$OUT/offline-$shape.log" | tee -a "$OUT/steps.log"
done
[ "${TESTS_AFTER:-0}" = 1 ] && gpu_tests
log done
