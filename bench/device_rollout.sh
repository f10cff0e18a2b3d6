#!/usr/bin/env bash
# A gray release's latency on the device, phase by phase (one H200, from the repo root, wheels of bench/device_wheels.sh
# in $WHL, default .whl/): in one call, the 1B engine built (random bf16 weights -> HF checkpoint -> convert ->
# build; max batch 64, 256 positions), staged as three versions of one release (decoupled llm, eager decode:
# no torch.compile, so three loads fit the device budget), and `bench rollout` under steady load:
# $CLIENTS closed-loop HTTP clients through the router from a child process, phases before / rollout 1->2
# (load beside, warm, 10/50/100, unload v1) / between / rollback of 3 (load, warm, 10%, back) / after.
# Triton's stub and the clients run in /tmp/venv, where numpy 1.26 shadows the image's numpy 2.
# PARAMS: more arguments of `bench rollout`, e.g. PARAMS="--param admit_every_steps=8".
# Results under $OUT: steps.log, rollout.json, rollout.log, triton.log.
# Also read from the environment (default): GEN_LEN=32, HOLD_S=3, ROLLOUT_S=150, STEADY_S=10.
set -u
OUT=${OUT:-/tmp/rollout-out}
WHL=${WHL:-.whl}
W=/tmp/ro
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$OUT/steps.log" 2>&1

(
  set -e
  python3 -m venv --without-pip --system-site-packages /tmp/venv
  SP=$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SP" \
    "$WHL"/numpy-1.26.4-*.whl "$WHL"/python_rapidjson-*.whl
  python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    >"$SP/zz-system-packages.pth"
  tar -xJf "$WHL"/pytriton-312.tar.xz -C "$SP"
  cp -r "$WHL"/site/tritonclient "$SP"/
) >>"$OUT/steps.log" 2>&1 &
VENV_PID=$!

timeout 100 python3 -c 'from pathlib import Path; from bench.served import build_random_engine
print(build_random_engine("llama-3.2-1b", Path("/tmp/ro"), max_batch_size=64, max_seq_len=256))' >>"$OUT/steps.log" 2>&1
log "engine built rc=$?"
wait $VENV_PID; log "venv rc=$?"

( export PATH=/tmp/venv/bin:$PATH
  timeout "${ROLLOUT_S:-150}" /tmp/venv/bin/python -m bench rollout --engine "$W/engine" --work "$W/bench" \
    --clients "${CLIENTS:-16}" --prompt-len 128 --gen-len "${GEN_LEN:-32}" --steady-s "${STEADY_S:-10}" \
    --hold-s "${HOLD_S:-3}" --out "$OUT/rollout.json" ${PARAMS:-} ) >"$OUT/rollout.log" 2>&1
log "rollout rc=$?"
cp "$W/bench/triton.log" "$OUT/" 2>/dev/null
tail -12 "$OUT/rollout.log" | tee -a "$OUT/steps.log"
log done
