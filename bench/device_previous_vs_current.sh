#!/usr/bin/env bash
# The previous commit's engines beside the current one, side by side in one call on one GPU (from the repo root):
# `bench throughput`, Llama-3.1-8B shape, random weights, 128/128, at 1, 64 and 1,024 requests, in bf16 and with
# FP8 weights. The previous tree (a `git archive` of aa3684c at .ab/old) runs its static engine (what users ran by
# default) and its paged one (the opt-in); the current tree runs its one engine. One process per tree and
# quantization builds its weights once and runs every cell (bench/ab_cells.py); old and new alternate cell by
# cell, and the second quantization starts with the tree the first one ended with. On a GPU under 100 GiB (an
# H100) both processes' weights and a 1,024-request pool do not fit together: there (or with SEQUENTIAL=1) the
# old process runs its cells, then the new one (alone on the GPU each), the second quantization the other way.
# Cells: 1,024 requests at 1,024 live (the static engine at 512 cache rows, as the previous device script ran
# it), 16,384 tokens a step, warmed on 128 requests; 64 requests at 64 live/rows; 1 request. The current
# engine's pool: FRACTION (0.85) of the free memory; the previous paged one's: OLD_FRACTION (0.6, its device
# script's) of what its static cache leaves.
# Env: OLD (the previous tree, default .ab/old), QUANTS (default "none fp8"), CELLS (requests of each cell,
#      default 1,64,1024), SHAPE (default llama-3.1-8b; tiny on a CPU), WORKLOAD (default 128/128),
#      DEVICE (default auto; cpu), FRACTION, OLD_FRACTION, SEQUENTIAL (1 or 0; default: 1 under 100 GiB), NUM_BLOCKS (each pool's blocks instead; 256 on
#      DEVICE=cpu, which has no free-memory figure), DEADLINE_S (cells starting later are skipped,
#      default 420), CELL_S (how long the last cell may run past it, default 90).
#   CPU check of the plumbing: SHAPE=tiny DEVICE=cpu QUANTS=none CELLS=1,4,16 WORKLOAD=16/8 bash bench/device_previous_vs_current.sh
# Results under $OUT: steps.log, <old|new>-<quant>-t<N>.json (the tree's bench report), <old|new>-<quant>.log
# (each worker's output), table.txt (cell, old static, old paged, new, new/old-static, new/old-paged:
# output tok/s and TPOT p50).
set -u
OUT=${OUT:-/tmp/previous-vs-current-out}
OLD=${OLD:-.ab/old}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LC_ALL=C.UTF-8
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/steps.log"; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv >>"$OUT/steps.log" 2>&1
[ -f "$OLD/serving/bench/throughput.py" ] || { log "no previous tree at OLD=$OLD (git archive aa3684c | tar -x -C $OLD)"; exit 2; }
log "previous tree $OLD ($(cat "$OLD/.commit" 2>/dev/null || echo aa3684c)), current tree $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo '+changes')"
flip=0
[ "${DEVICE:-auto}" != cpu ] || NUM_BLOCKS=${NUM_BLOCKS:-256}
if [ -z "${SEQUENTIAL:-}" ]; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  SEQUENTIAL=$([ -n "$mib" ] && [ "$mib" -lt 102400 ] && echo 1 || echo 0)
fi
log "SEQUENTIAL=$SEQUENTIAL"
for quant in ${QUANTS:-none fp8}; do
  left=$((${DEADLINE_S:-420} - ($(date +%s) - T0)))
  [ "$left" -gt 0 ] || { log "$quant skipped: past DEADLINE_S"; continue; }
  # a cell that hangs ends its drive CELL_S after the deadline (the table still prints)
  timeout "$((left + ${CELL_S:-90}))" python3 bench/ab_cells.py drive --old "$OLD" --new . --out "$OUT" --quantization "$quant" \
    --shape "${SHAPE:-llama-3.1-8b}" --workload "${WORKLOAD:-128/128}" --cells "${CELLS:-1,64,1024}" \
    --fraction "${FRACTION:-0.85}" --old-fraction "${OLD_FRACTION:-0.6}" $([ "$SEQUENTIAL" = 1 ] && echo --sequential) ${NUM_BLOCKS:+--num-blocks "$NUM_BLOCKS"} --device "${DEVICE:-auto}" --flip "$flip" --deadline-s "$left" 2>&1 | tee -a "$OUT/steps.log"
  log "$quant rc=${PIPESTATUS[0]}"
  n=$(echo "${CELLS:-1,64,1024}" | tr ',' '\n' | wc -l)
  [ "$SEQUENTIAL" = 1 ] && n=1  # sequential: the next quantization starts with the tree this one ended with
  flip=$(((flip + n) % 2))
done
python3 bench/ab_cells.py table "$OUT" | tee "$OUT/table.txt" | tee -a "$OUT/steps.log"
log "done"
