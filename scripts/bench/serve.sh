#!/usr/bin/env bash
# The serving path on a GPU machine, through the HTTP API (`ninfer bench serve`) against the
# engine alone (`ninfer bench`, run by it): synthetic qwen3.5-35b-a3b with the real Qwen3.5
# tokenizer, every expert on the GPU; then the tiny real-vocabulary model on the CPU backend
# (the gateway's CPU time per token on a quiet machine). Build with scripts/bench/build.sh (or
# cargo build --release), then for example
#
#   scripts/bench/serve.sh
#   BIN=bundle LEVELS=1,4 PROMPT=4096 scripts/bench/serve.sh
#
# BIN      directory of ninfer and its sibling binaries (default target/release)
# WORK     scratch for the artifacts (default /tmp/ninfer-serve); OUT where tables go (default WORK)
# LEVELS   concurrencies (default 1,4,16,64); PROMPT prompt tokens (512); DECODE answer tokens (128)
# EXPERTS_DTYPE  of the synthetic model's experts (int4); STAGES gpu,cpu (both by default)
set -euo pipefail
cd "$(dirname "$0")/../.." || exit 1
BIN=${BIN:-target/release}
WORK=${WORK:-/tmp/ninfer-serve}
OUT=${OUT:-$WORK}
LEVELS=${LEVELS:-1,4,16,64}
PROMPT=${PROMPT:-512}
DECODE=${DECODE:-128}
EXPERTS_DTYPE=${EXPERTS_DTYPE:-int4}
STAGES=${STAGES:-gpu,cpu}
TOKENIZER=tests/fixtures/qwen3_5_tokenizer
mkdir -p "$WORK" "$OUT"
common=(--concurrency "$LEVELS" --prompt-tokens "$PROMPT" --output-tokens "$DECODE"
  --run-arg=--no-mtp --bench-arg=--ram-buffer-gib --bench-arg=1)

if [[ ,$STAGES, == *,gpu,* ]]; then
  q35="$WORK/qwen3.5-35b-a3b-real-vocab.ninfer"
  [[ -f $q35 ]] || "$BIN/ninfer" convert --synthetic qwen3.5-35b-a3b --experts-dtype "$EXPERTS_DTYPE" \
    --tokenizer "$TOKENIZER" "$q35"
  "$BIN/ninfer" bench serve "$q35" "${common[@]}" \
    --run-arg=--moe-gpu-experts --run-arg=all --bench-arg=--moe-gpu-experts --bench-arg=all \
    | tee "$OUT/serve-qwen3.5-35b-a3b-gpu.txt"
fi

if [[ ,$STAGES, == *,cpu,* ]]; then
  tiny="$WORK/tiny-real-vocab.ninfer"
  [[ -f $tiny ]] || "$BIN/ninfer" convert --synthetic qwen3.5-35b-a3b --scale-down --layers 4 \
    --tokenizer "$TOKENIZER" "$tiny"
  "$BIN/ninfer" bench serve "$tiny" "${common[@]}" --run-arg=--device --run-arg=cpu \
    --bench-arg=--device --bench-arg=cpu | tee "$OUT/serve-tiny-cpu.txt"
fi
