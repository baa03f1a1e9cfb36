#!/usr/bin/env bash
# The benchmark suite on a GPU machine: CPU expert kernels, the GPU test suites, and whole-pipeline
# `ninfer bench` runs on synthetic artifacts with released models' shapes (docs/BENCHMARKS.md says
# what each figure means). Build first with scripts/bench/build.sh on a machine with Rust, copy
# the checkout with its bundle folder over, then for example
#
#   STAGES=experts,q30 scripts/bench/run.sh
#   STAGES=q35 PROMPTS=512,4096 DECODE=512 scripts/bench/run.sh
#   STAGES=llama LLAMA_CPP_BENCH=~/llama.cpp/build/bin/llama-bench LLAMA_CPP_MODEL=q30.gguf scripts/bench/run.sh
#   STAGES=q30,llama Q30_LAYERS=16 LLAMA_CPP_BENCH=... LLAMA_CPP_WRITE_GGUF=1 LLAMA_CPP_CPU_MOE=10 scripts/bench/run.sh
#   STAGES=q30,llama Q30_LAYERS=16 LLAMA_CPP_SOURCE=~/llama.cpp LLAMA_CPP_WRITE_GGUF=1 scripts/bench/run.sh
#
# STAGES (comma-separated, run in the order below whatever the order given):
#   experts     `ninfer bench experts`: decode-shape expert streaming against the RAM read
#               bandwidth (two invocations of 3 rounds, each round against its own reference),
#               the same with the benchmark's buffers on 2 MiB pages and on small pages
#               (HUGE_PAGES_AB=0 skips), then AMX against AVX-512 VNNI at 32 and 128 tokens.
#               Run it first: it wants a quiet machine.
#   tuning      the decode kernels' scheduling variants (NINFER_EXPERT_TUNING) in TUNINGS
#               (space-separated; words steal, shared, none; default "steal,shared"), two rounds at a
#               fixed reference, then the standard decode command 3 times with the fastest.
#   experts_ab  a kernel change: the bundle's ninfer-baseline (build.sh BASELINE=) against
#               ninfer, alternating, two passes; then AB_TUNINGS (none by default) and an
#               8-thread run.
#   gpu         the GPU test suites (scripts/gpu_tests.sh run, all at once, a canary first),
#               in the background while the first artifact is written.
#   quick       a first look: 8 layers of qwen3-30b-a3b (int8, uniform), 0 against all experts
#               on the GPU, 512-token prompt, 32 tokens.
#   profile     op-by-op GPU timing (NINFER_CUDA_OP_TIMING) of qwen3-30b-a3b int8 uniform;
#               PROFILE_RUNS (default "0:sync all:sync all:host": GPU experts:mode; sync = each
#               op's launch + GPU time, host = the host time inside each op), PROFILE_PROMPT.
#   q30         qwen3-30b-a3b, int8 experts, uniform routing: (a) every routed expert on the
#               CPU, (b) a 16 GiB card (--gpu-mem-budget 16, auto), (b) 53 experts per layer,
#               (c) every expert on the GPU; Q30_PLACEMENTS (default "a b b53 c") picks some, in its order.
#   b53         (without q30) only (b) at 53 experts per layer.
#   spin        (with q30 or b53) (b) again with the worker spinning 1 ms for its next request.
#   threads     (with b53) (b) at 53 with --moe-threads 15 (one core left to the engine).
#   share       qwen3-30b-a3b's decode during a long prefill (--decode-during-prefill
#               SHARE_PROMPT, default 32768; the stream's prompt 512 tokens, DECODE solo tokens)
#               at (c) every expert on the GPU, then (a) every expert on the CPU; SHARE_ARGS adds
#               arguments (e.g. "--engine-arg=--prefill-time-share --engine-arg=0.3"),
#               SHARE_TIMEOUT (300 s per bench).
#   q35         qwen3.5-35b-a3b, int4 experts, zipf routing, a 16 GiB card: a first run records
#               routing statistics, the measured run places GPU experts by them.
#   cache       the expert cache against static placement on each of CACHE_MODELS (default
#               qwen3.5-35b-a3b; e.g. "qwen3.5-35b-a3b qwen3-next-80b-a3b"), int4 experts,
#               trained routing, a 16 GiB card (--gpu-mem-budget 16, auto), 4K prompt, DECODE
#               tokens (default 128): a first run records routing statistics, then CACHE_PASSES
#               (default 2) passes of the four placements in turn: static first N, cache without
#               statistics, static by the statistics, cache seeded by them (CACHE_FILLS
#               per layer and step, default 2; CACHE_PLACEMENTS names a subset), then each
#               of CACHE_VARIANTS (the cache without statistics with other engine options, in
#               DECODE_AB_OPTIONS' syntax, e.g. "moe-cache-fill-cost=1+moe-cache-eviction-margin=1
#               moe-cache-upkeep-during-steps"); then, without statistics, one run per fill
#               cost of CACHE_FILL_COSTS (e.g. "0 2 8", or COST:MARGIN with the eviction margin,
#               e.g. "1:1 2:1"; none by default). The engine logs
#               (logs_cache_*) end with the cache's summary (hit rate, fills, upkeep per step).
#               A model's artifact is deleted after its runs when another model follows, unless
#               KEEP_ARTIFACTS=1 (two do not fit a 64 GiB disk together).
#   decode_ab   qwen3-30b-a3b (as q30) all on the GPU: the defaults, then each variant of
#               DECODE_AB_OPTIONS (default "cuda-group-decode-attention cuda-decode-gate-up-tasks":
#               each option off; OPTION=VALUE sets another value, "+" joins several, e.g.
#               "cuda-fused-decode-router=on cuda-fused-decode-router=on+cuda-fused-decode-experts=on"),
#               AB_PASSES (2) passes; PROMPTS (e.g. 4096,16384) and DECODE as for q30. With CuPy
#               present, first the kernel bench's decode sections (kernel_microbench.log).
#   cards       prefill of qwen3.5-35b-a3b, int4, at CARD_PROMPTS (default 4096,16384) on the
#               whole GPU, then as on an RTX 30/40/50 card (--cuda-shared-memory-cap 99K; the
#               engine log says which kernel variant each op takes), then uncapped again.
#   split       several GPUs: each of SPLIT_MODELS (default "qwen3-235b-a22b
#               qwen3-next-80b-a3b"), int4 experts, uniform routing (SPLIT_LAYERS keeps that many
#               decoder layers: the 235B's 94 take ~125 GB of disk), first every expert on the cards of
#               SPLIT_GPUS (default 0,1; the layers split by each card's memory, SPLIT_SHARES
#               as --gpu-split), then the first card alone with as many experts as fit and the
#               rest in RAM; PROMPTS, DECODE, REPEATS as for q30. A model's artifact is deleted
#               after its runs unless KEEP_ARTIFACTS=1.
#   llama       llama.cpp's llama-bench side by side, when LLAMA_CPP_BENCH (the binary) and
#               LLAMA_CPP_MODEL (a GGUF of the same model) are given (LLAMA_CPP_SOURCE=DIR, a
#               llama.cpp source checkout, builds llama-bench into $WORK/llama-cpp-build with
#               CMake, `-DGGML_CUDA=ON` unless LLAMA_CPP_CMAKE_ARGS says otherwise; CMAKE names
#               the cmake binary, LLAMA_BUILD_TIMEOUT bounds each build step, LLAMA_BUILD_JOBS its
#               parallel jobs; the build and the GGUF run while q30's artifact is written): all experts on the CPU
#               (-ot exps=CPU), LLAMA_CPP_CPU_MOE layers' experts on the CPU (--n-cpu-moe, if
#               set), everything on the GPU; same prompt lengths (LLAMA_CPP_PROMPTS, default
#               PROMPTS), decode tokens, threads and repeats; LLAMA_CPP_ARGS adds arguments to each, LLAMA_CPP_DEPTH=N decodes after N
#               tokens of context (-d N) instead of an empty one. LLAMA_CPP_WRITE_GGUF=1 (with no
#               LLAMA_CPP_MODEL) writes the GGUF with scripts/bench/write_gguf.py at q30's layers
#               into LLAMA_CPP_GGUF_DIR (default WORK; /dev/shm keeps it off a small disk)
#               (Q8_0 experts, bf16 dense: the artifact's bytes). After q30 and llama, two tables
#               (decode tok/s; prefill tok/s of the first prompt length): llama.cpp, ninfer and
#               their ratio per placement.
#
# Knobs: PROMPTS (default 4096), DECODE (64), REPEATS (2), THREADS (the CPU experts' threads; default the engine's own, one per physical core), Q30_LAYERS (q30's
# decoder layers, default all 48; at 48 the artifact and the GGUF take ~33 GB each: a 64 GiB disk
# needs KEEP_ARTIFACTS=0 and INTERLEAVE=0, or fewer layers), INTERLEAVE (1, the default: with
# the llama stage, llama.cpp's run of each q30 placement follows ninfer's at once, its GGUF
# written before q30's artifact; 0: all of llama.cpp's runs after all of ninfer's), BENCH_TIMEOUT (150 s per bench), STATS_TIMEOUT (120),
# CONVERT_TIMEOUT (240), GGUF_TIMEOUT (600), WORK (artifacts, default /tmp/ninfer-bench;
# REUSE_ARTIFACTS=0 rewrites them, KEEP_ARTIFACTS=0 deletes q30's and the GGUF after use),
# Q35_FIRST=1 (q35 before q30), GPU_TEST_FIGURES, GPU_TEST_TIMEOUT (passed to gpu_tests.sh),
# NINFER_BUNDLE (the binaries, default target/gpu-bundle), OUT (results, default
# /tmp/ninfer-bench-results: summary.log, one log per step; ARCHIVE=1 keeps the step logs in a
# temporary folder and refreshes $OUT/results.tgz after every step instead, so that a run cut
# short keeps what it measured in two files). Every step has its own timeout.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
bundle=${NINFER_BUNDLE:-target/gpu-bundle}
ninfer=$bundle/ninfer
final=${OUT:-/tmp/ninfer-bench-results}
mkdir -p "$final"
if [ "${ARCHIVE:-0}" = 1 ]; then
  out=$(mktemp -d /tmp/ninfer-bench-logs.XXXXXX)
else
  out=$final
fi
archive() {
  [ "${ARCHIVE:-0}" = 1 ] || return 0
  local archive
  archive=$(mktemp /tmp/ninfer-bench-results.XXXXXX.tgz)
  tar czf "$archive" -C "$out" . 2>/dev/null && mv "$archive" "$final/results.tgz"
  cp "$out/summary.log" "$final/summary.log" 2>/dev/null
}
stages=",${STAGES:-q30},"
work=${WORK:-/tmp/ninfer-bench}
# THREADS unset: the engine's default, one worker thread per physical core (llama.cpp's -t gets
# the same count); THREADS=N passes --moe-threads N to every bench and -t N to llama-bench.
physical_cores=$(lscpu -p=core,socket 2>/dev/null | grep -v '^#' | sort -u | wc -l)
[ "${physical_cores:-0}" -gt 0 ] || physical_cores=16
threads=${THREADS:-$physical_cores}
moe_threads=()
[ -z "${THREADS:-}" ] || moe_threads=(--moe-threads "$THREADS")
mkdir -p "$work"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$out/summary.log"; }
has() { [[ "$stages" == *",$1,"* ]]; }

[ -x "$ninfer" ] || { echo "no $ninfer: build with scripts/bench/build.sh first" >&2; exit 2; }
log "machine: $(uname -r), $(nproc) cpus, $(free -g | awk '/Mem:/ {print $2}') GiB, $(df -h "$work" | awk 'NR==2 {print $4}') free in $work"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$out/summary.log"
# Hardware threads per core matter to the CPU experts (THREADS counts hardware threads).
lscpu 2>/dev/null | grep -E "^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))" \
  | tr -s ' ' | tee -a "$out/summary.log"

convert() { # convert NAME ARGS...: writes $work/NAME.ninfer, logs its time
  local name=$1
  shift
  if [ -s "$work/$name.ninfer" ] && [ "${REUSE_ARTIFACTS:-1}" = 1 ]; then
    log "convert $name: reusing $work/$name.ninfer"
    return
  fi
  log "convert $name: $*"
  local start=$SECONDS
  timeout "${CONVERT_TIMEOUT:-240}" "$ninfer" convert --synthetic "$@" "$work/$name.ninfer" \
    >"$out/convert_$name.log" 2>&1
  log "convert $name: exit $? after $((SECONDS - start)) s, $(du -sh "$work/$name.ninfer" 2>/dev/null | cut -f1)"
  tail -3 "$out/convert_$name.log" | tee -a "$out/summary.log"
}

bench() { # bench LABEL TIMEOUT ARGS...: one `ninfer bench`, its engine and worker logs kept
  local label=$1 limit=$2
  shift 2
  log "bench $label: $*"
  local start=$SECONDS
  NINFER_KEEP_LOGS="$out/logs_$label" timeout "$limit" "$ninfer" bench "$@" >"$out/bench_$label.txt" 2>&1
  log "bench $label: exit $? after $((SECONDS - start)) s"
  grep -v '^\s*$' "$out/bench_$label.txt" | grep -v ' INFO ' | tail -9 | tee -a "$out/summary.log"
  archive
}

# The decode shape of qwen3.5-35b-a3b's experts: 8 per layer, one token.
# shellcheck disable=SC2054 # `int4,int8` is one argument, a list for the flag
DECODE_EXPERTS=(bench experts --preset qwen3.5-35b-a3b --dtype int4,int8 --tokens 1
  --kernel-isa avx512-vnni --working-set-gib 4)

if has experts; then
  for invocation in 1 2; do
    log "bench experts, invocation $invocation"
    timeout 120 "$ninfer" "${DECODE_EXPERTS[@]}" --rounds 3 >"$out/experts_$invocation.txt" 2>&1
    log "bench experts: exit $?"
    tail -4 "$out/experts_$invocation.txt" | tee -a "$out/summary.log"
  done
  if [ "${HUGE_PAGES_AB:-1}" = 1 ]; then
    # The reference buffer and the working set on 2 MiB pages, then on small pages.
    for policy in huge small; do
      log "bench experts, NINFER_HUGE_PAGES=$policy"
      NINFER_HUGE_PAGES=$policy timeout 120 "$ninfer" "${DECODE_EXPERTS[@]}" --rounds 3 \
        >"$out/experts_pages_$policy.txt" 2>&1
      grep "read bandwidth\|2 MiB" "$out/experts_pages_$policy.txt" | tee -a "$out/summary.log"
      tail -3 "$out/experts_pages_$policy.txt" | tee -a "$out/summary.log"
    done
  fi
  timeout 120 "$ninfer" bench experts --preset qwen3.5-35b-a3b --dtype int8,int4 --tokens 32,128 \
    --kernel-isa avx512-vnni,amx --working-set-gib 4 --seconds 0.5 >"$out/experts_batch.txt" 2>&1
  tail -10 "$out/experts_batch.txt" | tee -a "$out/summary.log"
  archive
fi

if has tuning; then
  # Two rounds at a fixed reference (--bandwidth-gbs: compare the µs column), each variant in
  # its own process.
  for round in 1 2; do
    for tuning in ${TUNINGS:-steal,shared}; do
      log "tuning $tuning round $round"
      NINFER_EXPERT_TUNING=$tuning timeout 40 "$ninfer" "${DECODE_EXPERTS[@]}" --seconds 0.5 \
        --bandwidth-gbs 100 2>&1 | grep -E '^int' | sed "s/^/$tuning r$round  /" | tee -a "$out/tuning.log"
    done
  done
  # The variant with the lowest mean int4 layer time, then the standard command 3 times (each
  # measures its own read-bandwidth reference first).
  best=$(awk '$3 == "int4" { sum[$1] += $8; n[$1]++ } END { for (t in sum) print sum[t] / n[t], t }' \
    "$out/tuning.log" | sort -n | head -1 | awk '{print $2}')
  best=${best:-steal,shared}
  log "fastest int4 tuning: $best; the standard decode command x3"
  for _ in 1 2 3; do
    NINFER_EXPERT_TUNING=$best timeout 60 "$ninfer" "${DECODE_EXPERTS[@]}" 2>&1 \
      | grep -E '^(int|read)' | tee -a "$out/tuning_best.log"
  done
  archive
fi

if has experts_ab; then
  lscpu | grep -i "model name\|thread(s) per core\|core(s) per socket\|socket(s)\|numa node(s)" | tee -a "$out/summary.log"
  for pass in 1 2; do
    for build in ninfer-baseline ninfer; do
      [ -x "$bundle/$build" ] || continue
      log "experts A/B pass $pass: $build"
      timeout 120 "$bundle/$build" "${DECODE_EXPERTS[@]}" --rounds 2 >"$out/experts_ab_${pass}_$build.txt" 2>&1
      grep "read bandwidth\|plain read\|^int" "$out/experts_ab_${pass}_$build.txt" | tee -a "$out/summary.log"
    done
  done
  # A tuning list replaces the defaults (steal, shared): name them too.
  for tuning in ${AB_TUNINGS:-}; do
    log "experts, NINFER_EXPERT_TUNING=$tuning"
    NINFER_EXPERT_TUNING=$tuning timeout 120 "$ninfer" "${DECODE_EXPERTS[@]}" --rounds 2 \
      >"$out/experts_tuning_$tuning.txt" 2>&1
    grep "read bandwidth\|plain read\|^int" "$out/experts_tuning_$tuning.txt" | tee -a "$out/summary.log"
  done
  log "experts, 8 threads"
  timeout 120 "$ninfer" "${DECODE_EXPERTS[@]}" --threads 8 >"$out/experts_8_threads.txt" 2>&1
  grep "read bandwidth\|plain read\|^int" "$out/experts_8_threads.txt" | tee -a "$out/summary.log"
  archive
fi

gpu_pid=
if has gpu; then
  log "GPU test suites (background)"
  (OUT="$out/gpu" NINFER_BUNDLE="$bundle" GPU_TEST_PARALLEL=1 GPU_TEST_CANARY=1 \
    GPU_TEST_FIGURES=${GPU_TEST_FIGURES:-0} GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-150} \
    scripts/gpu_tests.sh run >"$out/gpu_tests.log" 2>&1) &
  gpu_pid=$!
fi
engine_option_args() { # engine_option_args VARIANT: sets option_args to its engine arguments
  # A variant: OPTION (turned off), OPTION=VALUE, or several joined by "+".
  local settings setting name value
  option_args=()
  IFS=+ read -r -a settings <<<"$1"
  for setting in "${settings[@]}"; do
    name=${setting%%=*} value=off
    [[ $setting == *=* ]] && value=${setting#*=}
    option_args+=(--engine-arg="--$name" --engine-arg="$value")
  done
}

wait_for_gpu_tests() {
  if [ -n "$gpu_pid" ]; then
    wait "$gpu_pid"
    gpu_pid=
    tail -30 "$out/gpu_tests.log" >>"$out/summary.log"
  fi
}

if has quick; then
  convert q30-l8 qwen3-30b-a3b --layers 8 --experts-dtype int8 --routing uniform
  wait_for_gpu_tests
  for experts in 0 all; do
    bench "q30_l8_gpu_$experts" 120 "$work/q30-l8.ninfer" --device cuda "${moe_threads[@]}" \
      --prompt-lengths 512 --decode-tokens 32 --moe-gpu-experts "$experts"
  done
fi

run_q35() {
  convert q35 qwen3.5-35b-a3b --experts-dtype int4
  wait_for_gpu_tests
  Q=("$work/q35.ninfer" --device cuda "${moe_threads[@]}")
  bench q35_stats "${STATS_TIMEOUT:-120}" "${Q[@]}" --prompt-lengths 2048 --decode-tokens 128 \
    --engine-arg=--moe-record-stats --engine-arg="$work/q35-stats.json"
  cp "$work/q35-stats.json" "$out/" 2>/dev/null
  bench q35_budget16 "${BENCH_TIMEOUT:-150}" "${Q[@]}" --prompt-lengths "${PROMPTS:-4096}" \
    --decode-tokens "${DECODE:-64}" --repeats "${REPEATS:-2}" --gpu-mem-budget 16 \
    --moe-gpu-experts auto --engine-arg=--moe-expert-stats --engine-arg="$work/q35-stats.json"
}

if has q35 && [ "${Q35_FIRST:-0}" = 1 ]; then run_q35; fi

if has split; then
  wait_for_gpu_tests
  split_gpus=${SPLIT_GPUS:-0,1}
  for model in ${SPLIT_MODELS:-qwen3-235b-a22b qwen3-next-80b-a3b}; do
    name=split-${model//./-}${SPLIT_LAYERS:+-l$SPLIT_LAYERS}
    # shellcheck disable=SC2086 # SPLIT_LAYERS adds two arguments when set
    CONVERT_TIMEOUT=${CONVERT_TIMEOUT:-900} convert "$name" "$model" --experts-dtype int4 \
      --routing uniform ${SPLIT_LAYERS:+--layers $SPLIT_LAYERS}
    S=("$work/$name.ninfer" --device cuda "${moe_threads[@]}" --prompt-lengths "${PROMPTS:-4096}"
      --decode-tokens "${DECODE:-64}" --repeats "${REPEATS:-2}")
    bench "${name}_cards" "${BENCH_TIMEOUT:-600}" "${S[@]}" --moe-gpu-experts all \
      --gpus "$split_gpus" ${SPLIT_SHARES:+--gpu-split "$SPLIT_SHARES"}
    bench "${name}_one_card" "${BENCH_TIMEOUT:-600}" "${S[@]}" --moe-gpu-experts auto \
      --gpus "${split_gpus%%,*}"
    grep -h "pipeline stage\|GPU expert slots filled" "$out/logs_${name}_cards"/*engine* 2>/dev/null \
      | cut -c1-300 | tee -a "$out/summary.log"
    [ "${KEEP_ARTIFACTS:-0}" = 1 ] || rm -f "$work/$name.ninfer"*
  done
fi

if has cache; then
  cache_left=$(wc -w <<<"${CACHE_MODELS:-qwen3.5-35b-a3b}")
  for cache_model in ${CACHE_MODELS:-qwen3.5-35b-a3b}; do  # intentional word split: a list
    # q35t for the default model (the name other stages and earlier logs use).
    name=$([ "$cache_model" = qwen3.5-35b-a3b ] && echo q35t || echo "cache-${cache_model%%-*}")
    convert "$name" "$cache_model" --experts-dtype int4 --routing trained
    wait_for_gpu_tests
    C=("$work/$name.ninfer" --device cuda "${moe_threads[@]}" --gpu-mem-budget 16
      --moe-gpu-experts auto --prompt-lengths 4096 --decode-tokens "${DECODE:-128}" --repeats 1)
    stats=(--engine-arg=--moe-expert-stats --engine-arg="$work/$name-stats.json")
    placements=${CACHE_PLACEMENTS:-static_first dynamic static_stats dynamic_stats}
    if [[ $placements == *stats* ]]; then
      bench "cache_${name}_record" "${STATS_TIMEOUT:-150}" "$work/$name.ninfer" --device cuda \
        "${moe_threads[@]}" --prompt-lengths 2048 --decode-tokens 128 \
        --engine-arg=--moe-record-stats --engine-arg="$work/$name-stats.json"
    fi
    for pass in $(seq 1 "${CACHE_PASSES:-2}"); do
      for placement in $placements; do  # intentional word split: a list
        case $placement in
          static_first) placement_args=(--engine-arg=--moe-static-experts) ;;
          dynamic) placement_args=() ;;
          static_stats) placement_args=("${stats[@]}" --engine-arg=--moe-static-experts) ;;
          # With statistics the engine's default is static placement: the seeded cache is asked for.
          dynamic_stats) placement_args=("${stats[@]}" --engine-arg=--moe-cache-fills-per-layer
            --engine-arg="${CACHE_FILLS:-2}") ;;
          *) log "CACHE_PLACEMENTS: no placement $placement"; continue ;;
        esac
        bench "cache_${name}_${placement}_$pass" "${BENCH_TIMEOUT:-150}" "${C[@]}" "${placement_args[@]}"
      done
      # The cache without statistics with other engine options (DECODE_AB_OPTIONS' syntax).
      for variant in ${CACHE_VARIANTS:-}; do  # intentional word split: a list
        engine_option_args "$variant"
        bench "cache_${name}_${variant//[=+]/_}_$pass" "${BENCH_TIMEOUT:-150}" "${C[@]}" "${option_args[@]}"
      done
    done
    for setting in ${CACHE_FILL_COSTS:-}; do  # intentional word split: a list
      # COST, or COST:MARGIN (the eviction margin too).
      cost=${setting%%:*} margin_args=()
      [[ $setting == *:* ]] && margin_args=(--engine-arg=--moe-cache-eviction-margin --engine-arg="${setting#*:}")
      bench "cache_${name}_dynamic_cost_${setting/:/_margin_}" "${BENCH_TIMEOUT:-150}" "${C[@]}" \
        --engine-arg=--moe-cache-fill-cost --engine-arg="$cost" "${margin_args[@]}"
    done
    grep -h "expert cache:" "$out"/logs_cache_"$name"_*/*engine* 2>/dev/null | cut -c1-400 \
      | tee -a "$out/summary.log"
    # Another model after this one: its artifact goes first (two do not fit a 64 GiB disk).
    cache_left=$((cache_left - 1))
    [ "$cache_left" -eq 0 ] || [ "${KEEP_ARTIFACTS:-0}" = 1 ] || rm -f "$work/$name.ninfer"*
  done
fi

if has cards; then
  convert q35 qwen3.5-35b-a3b --experts-dtype int4
  wait_for_gpu_tests
  K=("$work/q35.ninfer" --device cuda "${moe_threads[@]}" --moe-gpu-experts all
    --prompt-lengths "${CARD_PROMPTS:-4096,16384}" --decode-tokens 8 --repeats 1)
  bench cards_uncapped "${BENCH_TIMEOUT:-240}" "${K[@]}"
  bench cards_99k "${BENCH_TIMEOUT:-240}" "${K[@]}" --engine-arg=--cuda-shared-memory-cap \
    --engine-arg=99K
  bench cards_uncapped_again "${BENCH_TIMEOUT:-240}" "${K[@]}"
  grep -h "gated delta rule\|tensor-core prefill attention\|capped" "$out"/logs_cards_99k/*engine* \
    2>/dev/null | cut -c1-300 | sort -u | tee -a "$out/summary.log"
fi

q30=q30${Q30_LAYERS:+-l$Q30_LAYERS}
# Starts building llama-bench (LLAMA_CPP_SOURCE) and writing the GGUF (LLAMA_CPP_WRITE_GGUF) as
# asked, both in the background (they overlap q30's conversion); finish_llama waits for them.
llama_build_pid='' gguf_pid=''
start_llama() {
  [ -z "${llama_started:-}" ] || return 0
  llama_started=1
  if has llama && [ -z "${LLAMA_CPP_BENCH:-}" ] && [ -n "${LLAMA_CPP_SOURCE:-}" ]; then
    llama_build=$work/llama-cpp-build
    if [ -x "$llama_build/bin/llama-bench" ] && [ "${REUSE_ARTIFACTS:-1}" = 1 ]; then
      log "llama-bench: reusing $llama_build/bin/llama-bench"
    else
      log "llama-bench: building from $LLAMA_CPP_SOURCE into $llama_build (${LLAMA_CPP_CMAKE_ARGS:--DGGML_CUDA=ON})"
      (
        start=$SECONDS
        # shellcheck disable=SC2086 # LLAMA_CPP_CMAKE_ARGS is a list of arguments
        timeout "${LLAMA_BUILD_TIMEOUT:-1800}" "${CMAKE:-cmake}" -S "$LLAMA_CPP_SOURCE" -B "$llama_build" \
          -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF ${LLAMA_CPP_CMAKE_ARGS:--DGGML_CUDA=ON} \
          >"$out/llama_build.log" 2>&1 &&
          timeout "${LLAMA_BUILD_TIMEOUT:-1800}" "${CMAKE:-cmake}" --build "$llama_build" \
            --target llama-bench -j "${LLAMA_BUILD_JOBS:-$(nproc)}" >>"$out/llama_build.log" 2>&1
        log "llama-bench: build exit $? after $((SECONDS - start)) s"
      ) &
      llama_build_pid=$!
    fi
  fi
  if has llama && [ "${LLAMA_CPP_WRITE_GGUF:-0}" = 1 ] && [ -z "${LLAMA_CPP_MODEL:-}" ]; then
    gguf=${LLAMA_CPP_GGUF_DIR:-$work}/$q30.gguf
    if [ -s "$gguf" ] && [ "${REUSE_ARTIFACTS:-1}" = 1 ]; then
      log "write GGUF: reusing $gguf"
    else
      log "write GGUF: $gguf, ${Q30_LAYERS:-48} layers"
      (
        timeout "${GGUF_TIMEOUT:-600}" python3 scripts/bench/write_gguf.py "$gguf" \
          --layers "${Q30_LAYERS:-48}" >"$out/write_gguf.log" 2>&1
        log "write GGUF: exit $?, $(tail -1 "$out/write_gguf.log")"
      ) &
      gguf_pid=$!
    fi
  fi
}
# Waits for start_llama's work; sets the llama-bench command line L when both a binary and a
# model are there.
finish_llama() {
  start_llama
  [ -z "$llama_build_pid" ] || wait "$llama_build_pid"
  [ -z "$gguf_pid" ] || wait "$gguf_pid"
  llama_build_pid='' gguf_pid=''
  if [ -n "${llama_build:-}" ] && [ -x "$llama_build/bin/llama-bench" ]; then
    LLAMA_CPP_BENCH=$llama_build/bin/llama-bench
  elif [ -n "${llama_build:-}" ]; then
    tail -3 "$out/llama_build.log" | tee -a "$out/summary.log"
  fi
  if [ -n "${gguf:-}" ] && [ -s "$gguf" ]; then LLAMA_CPP_MODEL=$gguf; fi
  if llama_ready; then
    # shellcheck disable=SC2206 # LLAMA_CPP_ARGS is a list of arguments
    L=("$LLAMA_CPP_BENCH" -m "$LLAMA_CPP_MODEL" -p "${LLAMA_CPP_PROMPTS:-${PROMPTS:-4096}}" -n "${DECODE:-64}"
      -t "$threads" -r "${REPEATS:-2}" -ngl 99 ${LLAMA_CPP_DEPTH:+-d "$LLAMA_CPP_DEPTH"} ${LLAMA_CPP_ARGS:-})
  fi
}
llama_ready() { has llama && [ -n "${LLAMA_CPP_BENCH:-}" ] && [ -n "${LLAMA_CPP_MODEL:-}" ]; }
llama() { # llama LABEL ARGS...: one llama-bench run, its table in the summary
  local label=$1
  shift
  log "llama-bench $label: ${L[*]} $*"
  timeout "${BENCH_TIMEOUT:-150}" "${L[@]}" "$@" >"$out/llama_$label.txt" 2>&1
  log "llama-bench $label: exit $?"
  grep '|' "$out/llama_$label.txt" | tee -a "$out/summary.log"
  archive
}
llama_once() { # llama_once LABEL ARGS...: llama, unless this run has that placement already
  [ -s "$out/llama_$1.txt" ] || llama "$@"
}
# With INTERLEAVE=1 (the default) and llama.cpp ready, the q30 stage runs llama.cpp's matching
# placement right after each of its own, so the two engines meet the machine in the same state.
beside() { # beside LABEL ARGS...: llama_once when interleaving
  if [ "${INTERLEAVE:-1}" = 1 ] && llama_ready; then llama_once "$@"; fi
}

if has decode_ab && python3 -c "import cupy" 2>/dev/null; then
  log "kernel bench: router, decode attention and experts"
  timeout "${KERNEL_BENCH_TIMEOUT:-300}" python3 scripts/bench/kernel_microbench.py \
    --sections router,decode_attention,experts --json "$out/kernel_microbench.json" \
    >"$out/kernel_microbench.log" 2>&1
  log "kernel bench: exit $?"
  grep -E "split|decode|route|expert_gate_up|expert_down|!!" "$out/kernel_microbench.log" | grep -v "~=" \
    | tee -a "$out/summary.log"
  archive
fi

# Interleaving needs llama.cpp ready before the first ninfer placement: its build and GGUF go
# on while q30's artifact is written.
interleaving() { has llama && has q30 && [ "${INTERLEAVE:-1}" = 1 ]; }
if interleaving; then start_llama; fi

if has q30 || has profile || has b53 || has share || has decode_ab; then
  convert "$q30" qwen3-30b-a3b ${Q30_LAYERS:+--layers "$Q30_LAYERS"} --experts-dtype int8 --routing uniform
  wait_for_gpu_tests
  if interleaving; then finish_llama; fi
  B=("$work/$q30.ninfer" --device cuda --prompt-lengths "${PROMPTS:-4096}"
    --decode-tokens "${DECODE:-64}" --repeats "${REPEATS:-2}")
  if has decode_ab; then
    # Each decode kernel option off against the defaults, all on the GPU, alternating.
    for pass in $(seq "${AB_PASSES:-2}"); do
      bench "decode_ab_defaults_$pass" "${BENCH_TIMEOUT:-150}" "${B[@]}" "${moe_threads[@]}" \
        --moe-gpu-experts all
      for variant in ${DECODE_AB_OPTIONS:-cuda-group-decode-attention cuda-decode-gate-up-tasks}; do
        engine_option_args "$variant"
        bench "decode_ab_${variant//[=+]/_}_$pass" "${BENCH_TIMEOUT:-150}" "${B[@]}" "${moe_threads[@]}" \
          --moe-gpu-experts all "${option_args[@]}"
      done
    done
  fi
  if has profile; then
    # Every op synchronises: slow; this says where the time goes, not how fast it is.
    for profile_run in ${PROFILE_RUNS:-0:sync all:sync all:host}; do
      experts=${profile_run%%:*} mode=${profile_run#*:}
      NINFER_CUDA_OP_TIMING="$out/op_timing_q30_${experts}_$mode.txt" NINFER_CUDA_OP_TIMING_MODE=$mode \
        bench "q30_profile_${experts}_$mode" 120 "$work/$q30.ninfer" --device cuda "${moe_threads[@]}" \
        --prompt-lengths "${PROFILE_PROMPT:-1024}" --decode-tokens 64 --moe-gpu-experts "$experts"
      head -40 "$out/op_timing_q30_${experts}_$mode.txt" | tee -a "$out/summary.log"
    done
  fi
  if has q30; then
    for placement in ${Q30_PLACEMENTS:-a b b53 c}; do
      case $placement in
        a)
          bench q30_a "${BENCH_TIMEOUT:-150}" "${B[@]}" "${moe_threads[@]}" --moe-gpu-experts 0
          beside cpu_experts -ot 'exps=CPU'
          ;;
        b)
          bench q30_b "${BENCH_TIMEOUT:-150}" "${B[@]}" "${moe_threads[@]}" --gpu-mem-budget 16 --moe-gpu-experts auto
          ;;
        b53)
          # The expert bytes of a 16 GB card as 53 experts per layer; the 16 GiB budget places
          # fewer (it also reserves the prefill staging slots, the KV cache and 1 GiB of working
          # memory).
          bench q30_b53 "${BENCH_TIMEOUT:-150}" "${B[@]}" "${moe_threads[@]}" --moe-gpu-experts 53
          [ -z "${LLAMA_CPP_CPU_MOE:-}" ] || beside "cpu_moe_$LLAMA_CPP_CPU_MOE" --n-cpu-moe "$LLAMA_CPP_CPU_MOE"
          ;;
        c)
          bench q30_c "${BENCH_TIMEOUT:-150}" "${B[@]}" "${moe_threads[@]}" --moe-gpu-experts all
          beside all_gpu
          ;;
        *) log "Q30_PLACEMENTS: unknown placement $placement (a, b, b53, c)" ;;
      esac
    done
    if has spin; then
      # The worker spinning 1 ms for its next request instead of the channel's default.
      NINFER_WORKER_SPIN_US=1000 bench q30_b_worker_spin "${BENCH_TIMEOUT:-150}" "${B[@]}" \
        "${moe_threads[@]}" --gpu-mem-budget 16 --moe-gpu-experts auto
    fi
  fi
  if has b53 && ! has q30; then
    bench q30_b53 "${BENCH_TIMEOUT:-150}" "${B[@]}" "${moe_threads[@]}" --moe-gpu-experts 53
    if has spin; then
      NINFER_WORKER_SPIN_US=1000 bench q30_b53_worker_spin "${BENCH_TIMEOUT:-150}" "${B[@]}" \
        "${moe_threads[@]}" --moe-gpu-experts 53
    fi
    if has threads; then
      bench "q30_b53_$((threads - 1))_threads" "${BENCH_TIMEOUT:-150}" "${B[@]}" \
        --moe-threads "$((threads - 1))" --moe-gpu-experts 53
    fi
  fi
  if has share; then
    # SHARE_ARGS is split into words on purpose: several arguments in one variable.
    # shellcheck disable=SC2206
    S=("$work/$q30.ninfer" --device cuda "${moe_threads[@]}" --prompt-lengths 512
      --decode-tokens "${DECODE:-64}" --repeats 1 --decode-during-prefill "${SHARE_PROMPT:-32768}"
      ${SHARE_ARGS:-})
    bench q30_share_c "${SHARE_TIMEOUT:-300}" "${S[@]}" --moe-gpu-experts all
    bench q30_share_a "${SHARE_TIMEOUT:-300}" "${S[@]}" --moe-gpu-experts 0
  fi
  [ "${KEEP_ARTIFACTS:-1}" = 1 ] || rm -f "$work/$q30.ninfer"*
fi

if has q35 && [ "${Q35_FIRST:-0}" != 1 ]; then run_q35; fi

if has llama; then
  finish_llama
  if ! llama_ready; then
    log "llama: skipped (set LLAMA_CPP_BENCH to llama-bench, or LLAMA_CPP_SOURCE to a llama.cpp checkout, and LLAMA_CPP_MODEL to a GGUF or LLAMA_CPP_WRITE_GGUF=1)"
  else
    wait_for_gpu_tests
    # The placements not run beside ninfer's already (INTERLEAVE=0, or no q30 stage).
    llama_once cpu_experts -ot 'exps=CPU'
    if [ -n "${LLAMA_CPP_CPU_MOE:-}" ]; then
      llama_once "cpu_moe_$LLAMA_CPP_CPU_MOE" --n-cpu-moe "$LLAMA_CPP_CPU_MOE"
    fi
    llama_once all_gpu
    [ "${KEEP_ARTIFACTS:-1}" = 1 ] || [ "$LLAMA_CPP_MODEL" != "${gguf:-}" ] || rm -f "$LLAMA_CPP_MODEL"
    # tok/s of llama-bench's tg (decode) or pp (prompt) row (last column, mean), and ninfer's
    # decode (field 3) or prefill (field 2) of its table row for the first prompt length.
    llama_tok_s() { # llama_tok_s LABEL tg|pp
      awk -F'|' -v test="$2" '$0 ~ (" " test "[0-9]") { split($(NF - 1), mean, " "); print mean[1]; exit }' \
        "$out/llama_$1.txt" 2>/dev/null
    }
    prompts=${PROMPTS:-4096}
    ninfer_tok_s() { # ninfer_tok_s LABEL tg|pp
      local field=3
      [ "$2" = pp ] && field=2
      awk -v prompt="${prompts%%,*}" -v field="$field" \
        '$1 == prompt && $2 ~ /^[0-9.]+$/ && index($0, " | ") { print $field; exit }' \
        "$out/bench_$1.txt" 2>/dev/null
    }
    compare() { # compare tg|pp PLACEMENT LLAMA_LABEL NINFER_LABEL
      local ours theirs
      theirs=$(llama_tok_s "$3" "$1") ours=$(ninfer_tok_s "$4" "$1")
      awk -v p="$2" -v l="${theirs:--}" -v n="${ours:--}" 'BEGIN {
        r = (l + 0 > 0 && n + 0 > 0) ? sprintf("%.2fx", n / l) : "-"
        printf "| %s | %s | %s | %s |\n", p, l, n, r }' | tee -a "$out/summary.log"
    }
    if has q30 || has b53; then
      for kind in tg pp; do
        what="decode tok/s, batch 1, ${DECODE:-64} tokens"
        [ "$kind" = pp ] && what="prefill tok/s, a ${prompts%%,*}-token prompt"
        log "$what (llama.cpp's test: $(grep -o " ${kind}[0-9][^|]*" "$out/llama_all_gpu.txt" 2>/dev/null | head -1 | xargs))"
        echo "| placement | llama.cpp | ninfer | ninfer / llama.cpp |" | tee -a "$out/summary.log"
        echo "|---|---|---|---|" | tee -a "$out/summary.log"
        compare "$kind" "all experts on the CPU" cpu_experts q30_a
        [ -z "${LLAMA_CPP_CPU_MOE:-}" ] ||
          compare "$kind" "llama.cpp --n-cpu-moe $LLAMA_CPP_CPU_MOE; ninfer 53 per layer" "cpu_moe_$LLAMA_CPP_CPU_MOE" q30_b53
        compare "$kind" "all on the GPU" all_gpu q30_c
      done
    fi
  fi
fi

wait_for_gpu_tests
log "done"
archive
