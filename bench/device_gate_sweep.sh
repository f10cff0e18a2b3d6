#!/usr/bin/env bash
# The quality gate's check on a GPU (docs/gates.md, "On the H200"): SmolLM2-135M-Instruct (real weights, Llama
# architecture) built in float32 and bfloat16 (and fp8 on bfloat16) judged against HF float32 on the same
# GPU; faulty builds beside them (bench/gate_sweep.py). The device has no PyPI and a call carries 64 MiB, so
# the 94 MiB GGUF travels in two parts in back-to-back calls (the machine keeps ignored paths while warm):
#   here:   split -b 49181216 -d ~/.cache/enginewright/gguf/SmolLM2-135M-Instruct.Q4_1.gguf part
#           (part00 into .dev/gates_g1/, part01 into .dev/gates_g2/), the wheels of gguf and pydantic (with
#           pydantic-core, annotated-types, typing-inspection; CPython 3.12) into .dev/gates_whl/
#   call 1: STAGE=1 bash bench/device_gate_sweep.sh   (carry .dev/gates_g1, .dev/gates_whl, the code)
#   call 2: bash bench/device_gate_sweep.sh           (carry .dev/gates_g2 and the code)
# From the repository root (ROOT is found there), with `/.dev/` in .git/info/exclude (else both halves travel).
# DTYPES (default float32,bfloat16), FAULTS, QUANTIZATIONS narrow the sweep: the whole one took 77 s once and ran past 120 s once.
# PRECISE_ACCUM=1: the fp8 prompt GEMMs without _scaled_mm's fast accumulation (EngineOptions.fp8_fast_accum off).
# Results: $OUT/gates.json (every case and the summary) and $OUT/gates.log.
# Also read from the environment (default): REBUILDS=1, TINY_SEEDS='', TOTAL_S=400.
set -uo pipefail
ROOT=${ROOT:-$([ -d .dev ] && echo . || echo ../..)}  # where .dev/ is: the repository root, or ../.. from a copy of the branch in .dev/<name>
STAGE_DIR=/tmp/gates-stage
SITE=/tmp/site-gates
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$STAGE_DIR"
cp -f "$ROOT"/.dev/gates_g*/part* "$STAGE_DIR"/ 2>/dev/null
if [ ! -d "$SITE/prefect" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$ROOT"/.dev/gates_whl/*.whl || exit 1
  mkdir -p "$SITE/prefect"  # tasks.* import prefect only for its @task decorator
  printf 'def task(*args, **kwargs):\n    if args and callable(args[0]):\n        return args[0]\n    return lambda fn: fn\n' \
    >"$SITE/prefect/__init__.py"
fi
printf 'NONE = NO_CACHE = None\n' >"$SITE/prefect/cache_policies.py"  # tasks.* name a cache policy on their @task
ls -la "$STAGE_DIR"
if [ "${STAGE:-0}" = 1 ]; then
  PYTHONPATH=$SITE python3 -c 'import gguf, pydantic, transformers, torch; print("staged: torch", torch.__version__, "transformers", transformers.__version__, "gguf", gguf.__version__, torch.cuda.get_device_name())'
  exit 0
fi
GGUF=/tmp/gates-model/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/gates-model
cat "$STAGE_DIR"/part00 "$STAGE_DIR"/part01 >"$GGUF" || exit 1
echo "$GGUF_SHA256  $GGUF" | sha256sum -c - || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
timeout "${TOTAL_S:-400}" python3 bench/gate_sweep.py --device cuda --gguf "$GGUF" --tiny-seeds "${TINY_SEEDS:-}" \
  --dtypes "${DTYPES:-float32,bfloat16}" --quantizations "${QUANTIZATIONS:-fp8}" --rebuilds "${REBUILDS:-1}" \
  --faults "${FAULTS:-int8_round,drop_layer,swap_heads}" ${PRECISE_ACCUM:+--fp8-precise-accum} --work /tmp/gates-work \
  --out "$OUT/gates.json" 2>&1 | tee "$OUT/gates.log"
