#!/usr/bin/env bash
# Quantized engines on the device (one H200, from the repo root, no installs; PYTHONPATH=.), in one call:
#  STEPS (a comma list, default all): tests  - the quantized kernels' GPU tests and the bf16 kernels' own;
#                                     sweep  - `bench gemms --quantization fp8` (skinny and gate/up tables);
#                                     bench  - `bench quantized` (bf16 beside fp8 and int8 weight-only).
# Env: SHAPES (bench, default llama-3.1-8b,llama-3.2-1b), METHODS, SWEEP_SHAPES, SWEEP_ROWS, DEADLINE (bench s).
# Results under $OUT: steps.log, gpu-tests.log, sweep.log/.json, gate-up.log/.json, quantized.json/.log.
set -u
OUT=${OUT:-/tmp/quant-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=. LC_ALL=C.UTF-8
STEPS=${STEPS:-tests,sweep,bench}
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >>"$OUT/steps.log" 2>&1
case ",$STEPS," in *,tests,*)
  log "gpu tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_quantized_kernels.py \
    tests/test_skinny_gemm.py tests/test_gate_up.py >"$OUT/gpu-tests.log" 2>&1
  log "gpu tests rc=$? $(tail -1 "$OUT/gpu-tests.log")" ;;
esac
case ",$STEPS," in *,sweep,*)
  log "sweep"
  timeout 200 python3 -m serving.bench gemms --quantization fp8 --shapes "${SWEEP_SHAPES:-llama-3.2-1b,llama-3.1-8b}" \
    --rows "${SWEEP_ROWS:-1,64}" --out "$OUT/sweep.json" >"$OUT/sweep.log" 2>&1
  log "sweep rc=$?"
  timeout 90 python3 -m serving.bench gemms --gate-up --quantization fp8 --shapes "${SWEEP_SHAPES:-llama-3.2-1b,llama-3.1-8b}" \
    --rows "${SWEEP_ROWS:-1,64}" --out "$OUT/gate-up.json" >"$OUT/gate-up.log" 2>&1
  log "gate-up sweep rc=$?" ;;
esac
case ",$STEPS," in *,bench,*)
  log "bench quantized"
  # after a sweep in this call, the engines run on what it found (serving/bench/quant_tables.py)
  TABLES=(); [ -s "$OUT/sweep.json" ] && [ -s "$OUT/gate-up.json" ] && TABLES=(-m serving.bench.quant_tables "$OUT/sweep.json" "$OUT/gate-up.json" --)
  [ ${#TABLES[@]} -eq 0 ] && TABLES=(-m serving.bench)
  timeout "${BENCH_TIMEOUT:-420}" python3 "${TABLES[@]}" quantized --shapes "${SHAPES:-llama-3.1-8b,llama-3.2-1b}" \
    --methods "${METHODS:-none,fp8,int8-weight-only}" --deadline-s "${DEADLINE:-330}" --out "$OUT/quantized.json" \
    >"$OUT/quantized.log" 2>&1
  log "bench rc=$?" ;;
esac
echo "==== summary"
grep -E "passed|failed|error" "$OUT/gpu-tests.log" 2>/dev/null | tail -3
grep -E "FAILED|Error" "$OUT/gpu-tests.log" 2>/dev/null | head -8
sed -n '/^TUNED/,/^}/p' "$OUT/sweep.log" "$OUT/gate-up.log" 2>/dev/null | grep -v lm_head
sed -n '/^TUNED.* += {/,/^}/p' "$OUT/quantized.log" 2>/dev/null
grep -E "FAILED|Traceback" "$OUT/sweep.log" "$OUT/gate-up.log" 2>/dev/null | head -5
sed -n '/^copy bandwidth.*GB\/s;/,$p' "$OUT/quantized.log" 2>/dev/null
grep -E "FAILED|Traceback|Error" "$OUT/quantized.log" 2>/dev/null | head -5
cat "$OUT/steps.log"
