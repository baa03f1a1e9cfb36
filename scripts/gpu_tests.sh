#!/usr/bin/env bash
# The GPU test suites (the engine's, and the command-line crate's that start the processes), in
# two halves, so that the GPU machine needs no Rust toolchain:
#
#   scripts/gpu_tests.sh build   on a machine with Rust: release test binaries (and the engine,
#                                worker, gateway and ninfer binaries those suites start)
#                                → $NINFER_BUNDLE (default target/gpu-bundle)
#   scripts/gpu_tests.sh run     on the GPU machine, in a copy of this checkout holding that
#                                folder: runs them with NINFER_REQUIRE_GPU=1 (a GPU case that
#                                would skip fails instead) and prints a summary table
#
# Knobs of `run`: OUT (logs, default /tmp/gpu_tests), GPU_TEST_PARALLEL=1 (every suite at once,
# one CUDA context each: the wall time is the slowest suite's), GPU_TEST_TIMEOUT (seconds per
# suite, default 150), GPU_TEST_FIGURES=0 (skip the matmul and attention figures, which are
# measurements, not checks), GPU_TEST_CANARY=1 (first one small suite, which compiles and caches
# the kernels and runs the backend's start-up self-checks; when it fails and the log points at
# NINFER_CUDA_REFERENCE_KERNELS, the suites run with the reference kernels only).
# GPU_TEST_SUITES="cuda_ops batch_decode" (both halves) builds and runs only those suites: a
# quicker build and a smaller bundle, for checking one change. GPU_TEST_SKIP="cuda_nvrtc" (run)
# leaves those suites out (a second run beside a first need not compile every kernel again).
# NINFER_CUDA_SHARED_MEMORY_CAP=99K (run) runs the suites as on an RTX 30/40/50 card: every
# kernel takes the variant that fits 99 KB of shared memory per block, and a launch asking for
# more fails its test.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${NINFER_BUNDLE:-target/gpu-bundle}

# test binary : name filters (the CUDA cases of the device-parametrized suites, and the CUDA-only
# tests among them by name)
SUITES=(
  "cuda_nvrtc:"
  "cuda_ops:"
  "cuda_model:"
  "cuda_golden:"
  "golden:::cuda"
  "model:::cuda"
  "expert_slots:::cuda"
  "cuda_device_flag:"
  "prefill_staging:::cuda"
  "candidates_and_host_kv:::cuda"
  "trained_fixture:::cuda"
  "expert_cache:::cuda"
  "speculative_scheduler:::cuda"
  "scoring_requests:::cuda"
  "cuda_tensor_cores:"
  "cuda_tensor_core_attention:"
  "batch_decode:"
  "qwen4_exp_parts:::cuda"
  "prefix_cache:::cuda"
  "prefix_cache_serving:::cuda"
  "prefix_cache_mtp:::cuda"
  "multimodal_positions:::cuda"
  "image_prompt:::cuda"
  "image_serving:::cuda"
  "video_prompt:::cuda"
  "pipeline_split:::cuda peer_crossings_compute_what_the_unsplit_model_computes"
  "pipeline_split_mtp:::cuda"
  "pipeline_split_host_kv:::cuda"
  "cuda_vision:"
  "engine_and_workers:gpu_"
  "perplexity_through_engine:perplexity_on_cuda"
)
# The command-line crate's suites: they start the engine, the expert workers and the gateway as
# processes, whose binaries go beside the bundle's folder, where those tests look for them.
CLI_SUITES=" engine_and_workers perplexity_through_engine "
is_cli_suite() { [[ "$CLI_SUITES" == *" $1 "* ]]; }
if [ -n "${GPU_TEST_SUITES:-}" ]; then
  chosen=()
  for suite in "${SUITES[@]}"; do
    for name in $GPU_TEST_SUITES; do  # intentional word split: a space-separated list
      if [ "${suite%%:*}" = "$name" ]; then chosen+=("$suite"); fi
    done
  done
  if [ ${#chosen[@]} -eq 0 ]; then
    echo "GPU_TEST_SUITES names no suite of this script: $GPU_TEST_SUITES" >&2
    exit 2
  fi
  SUITES=("${chosen[@]}")
fi
if [ -n "${GPU_TEST_SKIP:-}" ]; then
  kept=()
  for suite in "${SUITES[@]}"; do
    skipped=0
    for name in $GPU_TEST_SKIP; do  # intentional word split: a space-separated list
      if [ "${suite%%:*}" = "$name" ]; then skipped=1; fi
    done
    if [ "$skipped" = 0 ]; then kept+=("$suite"); fi
  done
  SUITES=("${kept[@]}")
fi

build() {
  local json=target/gpu_tests_build.json suite name
  mkdir -p target "$bundle"
  local engine_tests=() cli_tests=()
  for suite in "${SUITES[@]}"; do
    name=${suite%%:*}
    if is_cli_suite "$name"; then cli_tests+=(--test "$name"); else engine_tests+=(--test "$name"); fi
  done
  if [ -z "${GPU_TEST_SUITES:-}" ]; then
    engine_tests=()  # every test of the engine crate
  fi
  if [ -n "${GPU_TEST_SUITES:-}" ] && [ ${#engine_tests[@]} -eq 0 ]; then
    cargo build --release -p ninfer-engine --message-format=json >"$json"
  else
    cargo test --release -p ninfer-engine --no-run --message-format=json "${engine_tests[@]}" >"$json"
  fi
  local binaries=(ninfer-engine)
  if [ ${#cli_tests[@]} -gt 0 ]; then
    cargo test --release -p ninfer --no-run --message-format=json "${cli_tests[@]}" >>"$json"
    cargo build --release -p ninfer -p ninfer-expert-worker -p ninfer-gateway \
      --message-format=json >>"$json"
    binaries+=(ninfer ninfer-expert-worker ninfer-gateway)
  fi
  for suite in "${SUITES[@]}"; do rm -f "$bundle/${suite%%:*}"; done
  python3 - "$json" "$bundle" "${binaries[*]}" "${SUITES[@]}" <<'PY'
import json, shutil, sys
path, bundle = sys.argv[1], sys.argv[2]
binaries, suites = sys.argv[3].split(), [s.split(":", 1)[0] for s in sys.argv[4:]]
found = {}
for line in open(path):
    try:
        message = json.loads(line)
    except ValueError:
        continue
    if message.get("reason") != "compiler-artifact" or not message.get("executable"):
        continue
    target = message["target"]
    if target["kind"] == ["test"] and target["name"] in suites:
        found[target["name"]] = message["executable"]
    elif (target["kind"] == ["bin"] and target["name"] in binaries
          and not message["profile"]["test"]):  # the binary, not its unit-test harness
        found[target["name"]] = message["executable"]
missing = [s for s in suites + binaries if s not in found]
if missing:
    sys.exit(f"no executable built for {missing}")
for name, executable in found.items():
    shutil.copy(executable, f"{bundle}/{name}")
PY
  # Debug info is most of the size of a test binary.
  strip --strip-debug "$bundle"/* 2>/dev/null || true
  # Paths compiled into the tests (fixtures, the engine binary) point at this checkout.
  pwd >"$bundle/BUILD_ROOT"
  du -sh "$bundle"
}

run() {
  local root out
  root=$(cat "$bundle/BUILD_ROOT")
  if [ "$root" != "$PWD" ] && [ ! -e "$root" ]; then
    mkdir -p "$(dirname "$root")"
    ln -s "$PWD" "$root"
  fi
  mkdir -p "$root/target/release"
  # The binaries where the tests look: the paths cargo compiled in (target/release, under the
  # build's root) and, for the command-line suites, beside the folder their test binary is in.
  local binary place
  for binary in ninfer ninfer-engine ninfer-expert-worker ninfer-gateway; do
    [ -e "$bundle/$binary" ] || continue
    for place in "$root/target/release" "$(dirname "$bundle")"; do
      if [ ! "$bundle/$binary" -ef "$place/$binary" ]; then
        cp "$bundle/$binary" "$place/$binary"
      fi
    done
  done
  out=${OUT:-/tmp/gpu_tests}
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  if [ -n "${NINFER_CUDA_SHARED_MEMORY_CAP:-}" ]; then
    echo "shared memory per block capped at $NINFER_CUDA_SHARED_MEMORY_CAP"
  fi
  export NINFER_REQUIRE_GPU=1 NINFER_REQUIRE_NVRTC=1 RUST_LOG=${RUST_LOG:-warn} RUST_BACKTRACE=1
  if [ "${GPU_TEST_CANARY:-0}" = 1 ]; then
    canary "$out"
  fi
  local status=0 suite
  for suite in "${SUITES[@]}"; do
    if [ "${GPU_TEST_PARALLEL:-0}" = 1 ]; then
      run_suite "$suite" "$out" &
    else
      run_suite "$suite" "$out"
    fi
  done
  wait
  for suite in "${SUITES[@]}"; do
    local name=${suite%%:*}
    if ! grep -q ' PASS ' "$out/$name.row" 2>/dev/null; then
      status=1
      echo "---- $name failed, last lines:"
      grep -vE '^\s+(at |[0-9]+: )' "$out/$name.log" | tail -25
    fi
  done
  if [ "${GPU_TEST_FIGURES:-1}" = 1 ]; then
    echo "---- matmul figures (not checks)"
    timeout 60 "$bundle/cuda_ops" --ignored --nocapture matmul_bandwidth_figures 2>&1 | grep -E '^matmul' || true
    echo "---- attention decode figures (not checks)"
    timeout 90 "$bundle/cuda_ops" --ignored --nocapture attention_decode_figures 2>&1 | grep -E '^attention' || true
  fi
  echo "---- figures"
  cat "$out"/*.log | grep -E '^trained |on cuda:|vs cpu over|worst|NVRTC [0-9]|bf16 (tied|q_proj)|embed bf16|gated_delta_rule nk 4|cuBLAS|options: KV|cuda backend: KV|slotted vs reference|resident vs 0' | grep -v '^test ' | head -120 || true
  echo
  printf '%-18s %-8s %7s  %s\n' suite status time result
  for suite in "${SUITES[@]}"; do
    cat "$out/${suite%%:*}.row" 2>/dev/null || printf '%-18s %-8s\n' "${suite%%:*}" "NO RESULT"
  done
  return "$status"
}

# The backend's start-up (kernel compilation, self-checks) and the dense ops, alone, first: a
# self-check kernel that faults would poison every suite's CUDA context.
canary() {
  local out=$1 rc
  echo "---- canary: backend start-up + dense ops"
  set +e
  RUST_LOG=info timeout 120 "$bundle/cuda_ops" dense_ops_match_the_cpu_backend --nocapture \
    >"$out/canary.log" 2>&1
  rc=$?
  set -e
  grep -E 'CUDA backend ready|self-check|falls? back|fallback|WARN|ERROR|test result' "$out/canary.log" \
    | cut -c1-600 || true
  if [ "$rc" -ne 0 ] && grep -q 'NINFER_CUDA_REFERENCE_KERNELS' "$out/canary.log"; then
    echo "canary: the newer kernels broke the context; the suites run with the reference kernels only"
    export NINFER_CUDA_REFERENCE_KERNELS=1
  fi
}

# One suite: its log in $2/NAME.log, its summary row in $2/NAME.row.
run_suite() {
  local suite=$1 out=$2
  local name=${suite%%:*} filter=${suite#*:} start end rc summary
  start=$(date +%s.%N)
  set +e
  # shellcheck disable=SC2086 # the filter is zero or more test-binary arguments
  timeout "${GPU_TEST_TIMEOUT:-150}" "$bundle/$name" $filter --nocapture >"$out/$name.log" 2>&1
  rc=$?
  set -e
  end=$(date +%s.%N)
  summary=$(grep -E '^test result:' "$out/$name.log" | tail -1 | sed -E 's/^test result: //; s/; [0-9]+ (ignored|measured|filtered out)//g')
  [ -n "$summary" ] || summary="no result (exit $rc)"
  printf '%-18s %-8s %6.1fs  %s\n' "$name" "$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)" \
    "$(awk "BEGIN { print $end - $start }")" "$summary" >"$out/$name.row"
}

case "${1:-}" in
build) build ;;
run) run ;;
*)
  echo "usage: $0 build|run" >&2
  exit 2
  ;;
esac
