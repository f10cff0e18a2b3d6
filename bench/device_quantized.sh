#!/usr/bin/env bash
# Quantized engines on the device (one H200, from the repo root, no installs; PYTHONPATH=.), in one call:
#  STEPS (a comma list, default tests,sweep,bench): tests  - the quantized kernels' GPU tests (the FP8
#                                     tensor-core ones first) and the bf16 kernels' own;
#                                     qtests - the quantized kernels' GPU tests only;
#                                     tc     - `bench gemms --quantization fp8 --tuned-only`: the engine's fp8
#                                              decode kernels beside the FP8 tensor cores and bf16 cuBLAS;
#                                     ab     - `bench gemms --quantization int8-weight-only --tuned-only`: the
#                                              engine's int8 configs, weights widened through float32 bits
#                                              beside int-to-float conversions;
#                                     sweep  - `bench gemms --quantization $QUANT` (skinny tables);
#                                     gateup - the same for the gate/up kernel's table;
#                                     fp8sweep - `bench fp8-gemms` (the TUNED_FP8 table; the bench after it in
#                                              this call runs on what it found);
#                                     prefill - `bench fp8-prefill` (8B: the prefill GEMMs at PREFILL_ROWS (128) rows and whole
#                                              eager prefills, bf16 beside fp8 and its candidates, and the kernels of each);
#                                     bench  - `bench quantized` (bf16 beside fp8 and int8 weight-only);
#                                     fp8tests - the FP8 kernels' GPU tests and the quantized ones (last; FP8_TESTS_K: -k).
# Env: QUANT (sweep, gateup: fp8 or int8-weight-only, default fp8), AB_SHAPES (ab), SWEEP_GEMMS (sweep),
#      SHAPES (bench, default llama-3.1-8b,llama-3.2-1b), METHODS, SWEEP_SHAPES, SWEEP_ROWS, FP8_SWEEP_ROWS,
#      FP8_SWEEP_GEMMS, DEADLINE (bench s),
#      BENCH_TIMEOUT, BATCH_SIZES (bench, default 1,64), TC_ROWS (tc, default 1,16,64).
# Results under $OUT: steps.log, gpu-tests.log, tc.log/.json, sweep.log/.json, gate-up.log/.json,
# fp8-sweep.log/.json, prefill.log/.json, quantized.json/.log.
# Also read from the environment (default): AB_TIMEOUT=90, FP8_SWEEP_TIMEOUT=200, FP8_TESTS_TIMEOUT=180,
#  MORE_TESTS_TIMEOUT=240, PREFILL_TIMEOUT=150, SWEEP_TIMEOUT=200, TC_TESTS_TIMEOUT=110, TC_TIMEOUT=90.
set -u
OUT=${OUT:-/tmp/quant-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=. LC_ALL=C.UTF-8
STEPS=${STEPS:-tests,sweep,gateup,bench}
QUANT=${QUANT:-fp8}
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv >>"$OUT/steps.log" 2>&1
case ",$STEPS," in *,tests,*|*,qtests,*)
  log "gpu tests (fp8 tensor cores first)"
  timeout "${TC_TESTS_TIMEOUT:-110}" python3 -m pytest -q -s -p no:cacheprovider -m gpu -k "tensor_core or compiled" \
    tests/test_quantized_kernels.py >"$OUT/gpu-tests.log" 2>&1
  log "gpu tests rc=$? $(tail -1 "$OUT/gpu-tests.log")"
  MORE=(tests/test_quantized_kernels.py)
  case ",$STEPS," in *,tests,*) MORE+=(tests/test_skinny_gemm.py tests/test_gate_up.py) ;; esac
  timeout "${MORE_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -k "not tensor_core and not compiled" \
    "${MORE[@]}" >>"$OUT/gpu-tests.log" 2>&1
  log "more gpu tests rc=$? $(tail -1 "$OUT/gpu-tests.log")" ;;
esac
case ",$STEPS," in *,tc,*)
  log "fp8 tensor cores beside the decode kernels"
  timeout "${TC_TIMEOUT:-90}" python3 -m bench gemms --quantization fp8 --tuned-only \
    --shapes "${SWEEP_SHAPES:-llama-3.1-8b,llama-3.2-1b}" --rows "${TC_ROWS:-1,16,64}" --out "$OUT/tc.json" \
    >"$OUT/tc.log" 2>&1
  log "tc rc=$?" ;;
esac
case ",$STEPS," in *,ab,*)
  log "int8 widening: float32 bits beside conversions"
  timeout "${AB_TIMEOUT:-90}" python3 -m bench gemms --quantization int8-weight-only --tuned-only \
    --shapes "${AB_SHAPES:-llama-3.1-8b,llama-3.2-1b}" --rows "${SWEEP_ROWS:-1,64}" --out "$OUT/ab.json" \
    >"$OUT/ab.log" 2>&1
  log "ab rc=$?" ;;
esac
case ",$STEPS," in *,sweep,*)
  log "sweep ($QUANT)"
  timeout "${SWEEP_TIMEOUT:-200}" python3 -m bench gemms --quantization "$QUANT" \
    --shapes "${SWEEP_SHAPES:-llama-3.2-1b,llama-3.1-8b}" --rows "${SWEEP_ROWS:-1,64}" --workers 14 --gemms "${SWEEP_GEMMS:-wqkv,wo,w13,w2}" \
    --out "$OUT/sweep.json" >"$OUT/sweep.log" 2>&1
  log "sweep rc=$?" ;;
esac
case ",$STEPS," in *,gateup,*)
  timeout 90 python3 -m bench gemms --gate-up --quantization "$QUANT" --shapes "${SWEEP_SHAPES:-llama-3.2-1b,llama-3.1-8b}" \
    --rows "${SWEEP_ROWS:-1,64}" --out "$OUT/gate-up.json" >"$OUT/gate-up.log" 2>&1
  log "gate-up sweep rc=$?" ;;
esac
[ -s "$OUT/sweep.json" ] && [ ! -s "$OUT/gate-up.json" ] && echo '{"cells": []}' >"$OUT/gate-up.json"
case ",$STEPS," in *,fp8sweep,*)
  log "fp8 kernel sweep"
  timeout "${FP8_SWEEP_TIMEOUT:-200}" python3 -m bench fp8-gemms --shapes "${SWEEP_SHAPES:-llama-3.1-8b,llama-3.2-1b}" \
    --rows "${FP8_SWEEP_ROWS:-1,64,128}" --gemms "${FP8_SWEEP_GEMMS:-wqkv,wo,w13,w2}" --out "$OUT/fp8-sweep.json" \
    >"$OUT/fp8-sweep.log" 2>&1
  log "fp8 sweep rc=$?" ;;
esac
case ",$STEPS," in *,prefill,*)
  log "fp8 prefill"
  timeout "${PREFILL_TIMEOUT:-150}" python3 -m bench fp8-prefill --shape llama-3.1-8b --rows "${PREFILL_ROWS:-128}" \
    --out "$OUT/prefill.json" >"$OUT/prefill.log" 2>&1
  log "fp8 prefill rc=$?" ;;
esac
case ",$STEPS," in *,bench,*)
  log "bench quantized"
  # after a sweep in this call, the engines run on what it found (bench/quant_tables.py)
  TABLES=(); [ -s "$OUT/sweep.json" ] && [ -s "$OUT/gate-up.json" ] && TABLES=(-m bench.quant_tables "$OUT/sweep.json" "$OUT/gate-up.json" --)
  [ ${#TABLES[@]} -eq 0 ] && [ -s "$OUT/fp8-sweep.json" ] && TABLES=(-m bench.quant_tables --fp8 "$OUT/fp8-sweep.json" --)
  [ ${#TABLES[@]} -eq 0 ] && TABLES=(-m bench)
  timeout "${BENCH_TIMEOUT:-420}" python3 "${TABLES[@]}" quantized --shapes "${SHAPES:-llama-3.1-8b,llama-3.2-1b}" \
    --methods "${METHODS:-none,fp8,int8-weight-only}" --batch-sizes "${BATCH_SIZES:-1,64}" --deadline-s "${DEADLINE:-330}" --out "$OUT/quantized.json" \
    >"$OUT/quantized.log" 2>&1
  log "bench rc=$?" ;;
esac
# after the bench: its figures come back even if the tests outlast the call
case ",$STEPS," in *,fp8tests,*)
  log "fp8 kernel gpu tests"
  timeout "${FP8_TESTS_TIMEOUT:-180}" python3 -m pytest -q -s -p no:cacheprovider -m gpu -k "${FP8_TESTS_K:-not nothing}" \
    tests/test_fp8_gemm.py tests/test_quantized_kernels.py >"$OUT/fp8-tests.log" 2>&1
  log "fp8 kernel gpu tests rc=$? $(tail -1 "$OUT/fp8-tests.log")" ;;
esac
echo "==== summary"
grep -E "passed|failed|error|rel err" "$OUT/gpu-tests.log" "$OUT/fp8-tests.log" 2>/dev/null | tail -6
grep -E "^llama|^TUNED|^    \(|^}|Traceback|Error" "$OUT/fp8-sweep.log" 2>/dev/null
grep -E "rows|^prefill|Traceback|Error" "$OUT/prefill.log" 2>/dev/null
grep -E "^llama|Traceback|Error" "$OUT/tc.log" "$OUT/ab.log" 2>/dev/null
grep -E "^llama" "$OUT/sweep.log" 2>/dev/null | grep -v lm_head
grep -E "FAILED|Error" "$OUT/gpu-tests.log" 2>/dev/null | head -8
sed -n '/^TUNED/,/^}/p' "$OUT/sweep.log" "$OUT/gate-up.log" 2>/dev/null | grep -v lm_head
sed -n '/^TUNED.* += {/,/^}/p' "$OUT/quantized.log" 2>/dev/null
grep -E "FAILED|Traceback" "$OUT/sweep.log" "$OUT/gate-up.log" 2>/dev/null | head -5
sed -n '/^copy bandwidth.*GB\/s;/,$p' "$OUT/quantized.log" 2>/dev/null
grep -E "FAILED|Traceback|Error" "$OUT/quantized.log" 2>/dev/null | head -5
cat "$OUT/steps.log"
