#!/usr/bin/env bash
# MTP speculative decoding at full size on a GPU machine: synthetic qwen3.5-35b-a3b (int4
# experts, trained-like routing, its one MTP layer), `ninfer bench mtp` with the acceptance
# forced to the trained fixture's measured rates (a random-weight MTP head is almost never right,
# so its own acceptance says nothing), and one table at the end. Build the bundle with
# scripts/bench/build.sh, copy the checkout with it, then
#
#   scripts/bench/mtp_full_size.sh                 convert (once; reused after) and run the matrix
#   STAGES=convert scripts/bench/mtp_full_size.sh  only the artifact (~20 GB, a few minutes)
#   STAGES=bench scripts/bench/mtp_full_size.sh    only the matrix, on the artifact written before
#
# The matrix, per placement (every expert on the GPU; a 16 GiB card with the dynamic expert
# cache; the same card with the start-up placement kept, --moe-static-experts):
#   rates  MTP off, then N = 1, 2, 3 drafts per step with the acceptance forced to RATES;
#   zero   MTP off, then N = 3 with adaptive drafting and the acceptance forced to 0 (what
#          drafting costs a sequence whose drafts are never accepted).
# Each bench is one process (the model loads once for its rows) under BENCH_TIMEOUT; at the
# defaults the six benches take about five minutes after the artifact exists.
#
# Knobs: RATES (0.80,0.56,0.41: the trained fixture's acceptance at depths 1, 2, 3), TOKENS (64
# per run), REPEATS (2 timed runs after a warm-up, the median printed), THREADS (16: CPU expert
# threads), BUDGET (16 GiB), BENCH_TIMEOUT (80 s per bench), CONVERT_TIMEOUT (480), LAYERS (all
# 40; fewer for a quick look), DEVICE (cuda; cpu runs the same matrix on the CPU backend, where
# the budget does not apply: it is for trying the script on a small LAYERS artifact), WORK
# (/tmp/ninfer-bench; REUSE_ARTIFACTS=0 rewrites the artifact), NINFER_BUNDLE (target/gpu-bundle),
# OUT (/tmp/ninfer-bench-results: summary.log, mtp_table.txt and one log per bench).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
bundle=${NINFER_BUNDLE:-target/gpu-bundle}
ninfer=$bundle/ninfer
out=${OUT:-/tmp/ninfer-bench-results}
work=${WORK:-/tmp/ninfer-bench}
stages=",${STAGES:-convert,bench},"
rates=${RATES:-0.80,0.56,0.41}
tokens=${TOKENS:-64}
repeats=${REPEATS:-2}
threads=${THREADS:-16}
budget=${BUDGET:-16}
device=${DEVICE:-cuda}
mkdir -p "$out" "$work"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$out/summary.log"; }
has() { [[ "$stages" == *",$1,"* ]]; }

[ -x "$ninfer" ] || { echo "no $ninfer: build with scripts/bench/build.sh first" >&2; exit 2; }
name=q35-mtp${LAYERS:+-l$LAYERS}
artifact=$work/$name.ninfer
log "machine: $(nproc) cpus, $(free -g | awk '/Mem:/ {print $2}') GiB, $(df -h "$work" | awk 'NR==2 {print $4}') free in $work"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$out/summary.log"

if has convert; then
  if [ -s "$artifact" ] && [ "${REUSE_ARTIFACTS:-1}" = 1 ]; then
    log "convert: reusing $artifact"
  else
    log "convert: qwen3.5-35b-a3b int4, trained routing${LAYERS:+, $LAYERS layers}"
    start=$SECONDS
    timeout "${CONVERT_TIMEOUT:-480}" "$ninfer" convert --synthetic qwen3.5-35b-a3b \
      --experts-dtype int4 --routing trained ${LAYERS:+--layers "$LAYERS"} "$artifact" \
      >"$out/convert_$name.log" 2>&1
    log "convert: exit $? after $((SECONDS - start)) s, $(du -sh "$artifact" 2>/dev/null | cut -f1)"
    tail -3 "$out/convert_$name.log" | tee -a "$out/summary.log"
  fi
  # The MTP head must be there (the release has one MTP layer): its line and its tensor class.
  "$ninfer" inspect "$artifact" 2>&1 | grep -E "MTP layers|^mtp " | tee -a "$out/summary.log"
fi

# Placements: label, then the bench's placement flags.
placements=(
  "all-gpu|--moe-gpu-experts all"
  "${budget}GiB-cache|--moe-gpu-experts auto --gpu-mem-budget $budget"
  "${budget}GiB-static|--moe-gpu-experts auto --gpu-mem-budget $budget --moe-static-experts"
)
if [ "$device" = cpu ]; then
  # No GPU memory to budget: half of each layer's experts in the CPU backend's host slots.
  placements=(
    "all-slots|--moe-gpu-experts all"
    "half-cache|--moe-gpu-experts half"
    "half-static|--moe-gpu-experts half --moe-static-experts"
  )
fi
# Runs: label, then the bench's drafting flags.
runs=(
  "rates|--draft-tokens 0,1,2,3 --force-acceptance $rates"
  "zero|--draft-tokens 0,3 --adaptive-drafts --force-acceptance 0"
)

table=$out/mtp_table.txt
if has bench; then
  [ -s "$artifact" ] || { log "no $artifact: run the convert stage first"; exit 2; }
  : >"$table"
  for placement in "${placements[@]}"; do
    for run in "${runs[@]}"; do
      label="${placement%%|*}_${run%%|*}"
      # Word splitting of the flag lists is intended.
      # shellcheck disable=SC2086
      set -- --device "$device" --moe-threads "$threads" --tokens "$tokens" --repeats "$repeats" \
        ${placement#*|} ${run#*|}
      log "bench mtp $label: $*"
      start=$SECONDS
      timeout "${BENCH_TIMEOUT:-80}" "$ninfer" bench mtp "$artifact" "$@" >"$out/mtp_$label.txt" 2>&1
      status=$?
      log "bench mtp $label: exit $status after $((SECONDS - start)) s"
      grep -v ' INFO \|^\s*$' "$out/mtp_$label.txt" | tail -12 | tee -a "$out/summary.log"
      {
        echo "== $label: $(head -1 "$out/mtp_$label.txt" | sed 's/^.*: [0-9]* prompt tokens, //')"
        grep -E '^ +[0-9]+ ' "$out/mtp_$label.txt" || echo "   (no rows: exit $status, see $out/mtp_$label.txt)"
      } >>"$table"
    done
  done
  log "MTP at full size: forced acceptance $rates (TEST ONLY: drafts computed and verified, decisions forced)"
  header=$(grep -m1 -h '^ drafts' "$out"/mtp_*.txt 2>/dev/null)
  { echo "$header"; cat "$table"; } | tee -a "$out/summary.log"
fi
