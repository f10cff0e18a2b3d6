#!/usr/bin/env bash
# Issue 49's device check, in one call (one H100/H200, from the repo root; carry .whl from bench/device_wheels.sh and
# .dev/structload from bench/device_structured_load_files.sh: `run(..., carry=[".whl", ".dev/structload"])`):
#  1. beside step 2: /tmp/venv for the Triton stub, the OpenAI front and the clients (bench/device_venv.sh), then the
#     front's, the grammar engine's (llguidance) and the clients' wheels (.dev/structload/wheels, .whl/pyd) into it,
#     and a `prefect` shim in /tmp/site-shim (the bench imports tasks.lm_eval_gate for its served_engines, whose
#     module decorates a task: the image has no prefect);
#  2. the 8B shape's engine in FP8 with random weights made on the GPU (bench.fp8_engine: no bf16 checkpoint, no
#     convert), max batch CLIENTS, with the carried 128,256-token tokenizer (.dev/structload/tokenizer.json.xz), by
#     the image's python3 (`bench/structured_load.py --build-only`), <= BUILD_S;
#  3. `bench/structured_load.py --engine`: the bundled Triton (decoupled llm model) behind the OpenAI front, CLIENTS
#     closed-loop /v1/completions clients: a warm-up round of the mixed kinds (WARMUP_S), then three rounds of
#     ROUND_S: plain requests, the mix (10% a JSON schema, 10% `logprobs: 5`), plain again; <= what TOTAL_S leaves.
# Pass (step 3's exit 0): mixed output tok/s >= 90% of the two plain rounds' mean, no failed request, every schema
# answer parses with the schema's keys. Why ROUND_S=45 s suffices: 128-token requests at 256 live take a few
# seconds, so a round is some 15-20 requests a client back to back; its ramp and drain (about one request each)
# are alike in every round, and `plain_spread` (the two plain rounds apart, over their mean) shows how far the
# figure moves by itself: a spread near the 10% margin says to rerun with a longer ROUND_S.
# Env (default): TOTAL_S=530, BUILD_S=300, ROUND_S=45, WARMUP_S=10, CLIENTS=256, SHAPE=llama-3.1-8b, PROMPT_WORDS=96,
#   MAX_TOKENS=128, SCHEMA_MAX_TOKENS=256.
# Results under $OUT: steps.log (each step's and each bench phase's seconds as it ends, then the verdict),
# structured-load.json (rewritten after each round), structured-load.log, build.log, venv.log, triton.log and
# front.log (their last MB).
# CPU check of steps 2-3 (tiny shape, real Triton): the command in bench/structured_load.py's docstring.
set -u
OUT=${OUT:-/tmp/structured-load-out}
W=/tmp/sl
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
{ nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  python3 -c 'import sys, numpy, torch, tokenizers; print(sys.version.split()[0], "numpy", numpy.__version__, "torch", torch.__version__, "tokenizers", tokenizers.__version__)'
  nproc; df -h /tmp | tail -n 1; } >>"$OUT/steps.log" 2>&1
SHAPE=${SHAPE:-llama-3.1-8b}
CLIENTS=${CLIENTS:-256}

(
  set -e
  bash bench/device_venv.sh
  SP=$(/tmp/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SP" \
    .dev/structload/wheels/*.whl .whl/pyd/*.whl
  mkdir -p /tmp/site-shim/prefect
  printf 'def task(*args, **kwargs):\n    if args and callable(args[0]):\n        return args[0]\n    return lambda fn: fn\n' \
    >/tmp/site-shim/prefect/__init__.py
  echo 'NONE = None' >/tmp/site-shim/prefect/cache_policies.py
  PYTHONPATH=/tmp/site-shim /tmp/venv/bin/python -c 'import fastapi, uvicorn, llguidance, httpx, tritonclient.grpc
import flows.cli, serving.openai.server, tasks.lm_eval_gate
print("venv: the front, the grammar engine and the bench import; llguidance", llguidance.__version__)'
) >"$OUT/venv.log" 2>&1 &
VENV_PID=$!

timeout "${BUILD_S:-300}" python3 bench/structured_load.py --build-only --shape "$SHAPE" --clients "$CLIENTS" \
  --tokenizer .dev/structload/tokenizer.json.xz --work "$W" --steps-log "$OUT/steps.log" >"$OUT/build.log" 2>&1
log "build rc=$?: $(tail -n 1 "$OUT/build.log")"
wait $VENV_PID; log "venv rc=$?: $(tail -n 1 "$OUT/venv.log")"

LEFT=$((${TOTAL_S:-530} - ($(date +%s) - T0) - 15))
log "structured load: ${LEFT} s left"
( export PATH=/tmp/venv/bin:$PATH PYTHONPATH=/tmp/site-shim
  timeout -k 15 "$LEFT" /tmp/venv/bin/python bench/structured_load.py --engine "$W/engine-fp8-direct" --shape "$SHAPE" \
    --clients "$CLIENTS" --seconds "${ROUND_S:-45}" --warmup-seconds "${WARMUP_S:-10}" \
    --prompt-words "${PROMPT_WORDS:-96}" --max-tokens "${MAX_TOKENS:-128}" \
    --schema-max-tokens "${SCHEMA_MAX_TOKENS:-256}" --work "$W" --json "$OUT/structured-load.json" \
    --steps-log "$OUT/steps.log" ) >"$OUT/structured-load.log" 2>&1
log "structured load rc=$? (0: passed, 1: measured and failed, 124: cut at the limit)"
tail -c 1000000 "$W/serving/triton.log" >"$OUT/triton.log" 2>/dev/null
tail -c 1000000 "$W/serving/front.log" >"$OUT/front.log" 2>/dev/null
python3 - "$OUT/structured-load.json" <<'PY' 2>&1 | tee -a "$OUT/steps.log"
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except Exception as exc:
    sys.exit(f"RESULT missing: {exc!r}")
print("TIMELINE", report.get("timeline"))
for name in ("warmup", "plain", "mixed", "plain_again"):
    r = report.get(name)
    if r:
        print(name.upper(), {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
print("RESULT", {k: report.get(k) for k in ("ratio", "plain_tok_s", "plain_rounds", "plain_spread", "passed")})
PY
log done
