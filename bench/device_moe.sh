#!/usr/bin/env bash
# Mixtures of experts on the device (one H100/H200, from the repo root, no installs; PYTHONPATH=.), in one call:
#  1. the grouped expert kernels' GPU tests (tests/test_moe_gemm.py, tests/test_moe_routing.py -m gpu: bf16 and fp8 at Qwen3-30B-A3B's expert
#     shape against the loop over experts, and the MoE layer in a CUDA graph; tests/test_engine_gpu.py's tiny Mixtral
#     and Qwen3-MoE on CUDA against the CPU engine), <= TESTS_TIMEOUT (150) s;
#  2. `python3 -m bench.moe --sweep --write-table`: the grouped kernels' tilings at one layer of Qwen3-30B-A3B's
#     shape (e4m3 experts), 1-4,096 tokens, the best beside the default, written as the device's tuned `moe` section
#     (serving/engine/tuned/<device>.json, copied to $OUT: step 3 runs with it), <= SWEEP_TIMEOUT (120) s;
#  3. `python3 -m bench.moe`: Qwen3-30B-A3B's shape in FP8, random weights made in device memory; batch-1 decode
#     against the roofline of the bytes a step reads (issue 50: >= 60%; first with the torch ops' routing, then with
#     the one-launch routing, moe_routing.py, in the same run), then REQUESTS (1000) requests of
#     INPUT_LEN/OUTPUT_LEN (1024/1024) at once (issue 50: >= 10,000 output tok/s on one H200),
#     <= BENCH_TIMEOUT (420) s. KV_CACHE_DTYPE (auto) picks the pool's dtype ("fp8": e4m3 K/V).
# Results under $OUT (default /tmp/moe-out): steps.log, gpu-tests.log, sweep.json/.log, moe.json (written after the decode cell and
# at the end), moe.log.
set -u
OUT=${OUT:-/tmp/moe-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=. LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >>"$OUT/steps.log" 2>&1
log "grouped expert kernels: gpu tests"
timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -s -p no:cacheprovider -m gpu -k "moe or mixtral or routing" \
  tests/test_moe_gemm.py tests/test_moe_routing.py tests/test_engine_gpu.py >"$OUT/gpu-tests.log" 2>&1
log "gpu tests rc=$? $(tail -1 "$OUT/gpu-tests.log")"
log "grouped kernels' tilings (sweep)"
timeout "${SWEEP_TIMEOUT:-120}" python3 -m bench.moe --sweep "$OUT/sweep.json" --write-table >"$OUT/sweep.log" 2>&1
log "sweep rc=$?"
cp serving/engine/tuned/*.json "$OUT/" 2>/dev/null  # the table the sweep wrote, for the bench below and to commit
log "bench moe"
timeout "${BENCH_TIMEOUT:-420}" python3 -m bench.moe --requests "${REQUESTS:-1000}" --input-len "${INPUT_LEN:-1024}" \
  --output-len "${OUTPUT_LEN:-1024}" --kv-cache-dtype "${KV_CACHE_DTYPE:-auto}" --routing-ab --out "$OUT/moe.json" \
  >"$OUT/moe.log" 2>&1
log "bench moe rc=$?"
echo "==== summary"
grep -E "passed|failed|error|max error" "$OUT/gpu-tests.log" | tail -8
grep -E "FAILED|Error" "$OUT/gpu-tests.log" | head -8
grep -E "^tokens|Error" "$OUT/sweep.log" | tail -12
tail -20 "$OUT/moe.log"
cat "$OUT/steps.log"
