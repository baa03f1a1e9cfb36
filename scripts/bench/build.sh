#!/usr/bin/env bash
# Builds what the benchmark suite runs, on a machine with Rust, into one folder to copy to the
# GPU machine (which needs no Rust toolchain):
#
#   scripts/bench/build.sh                  release ninfer, ninfer-engine, ninfer-expert-worker,
#                                           ninfer-gateway
#   WITH_GPU_TESTS=1 scripts/bench/build.sh  the same plus the GPU test binaries (gpu_tests.sh build)
#
# NINFER_BUNDLE (default target/gpu-bundle) is the folder; copy the checkout with it, or at least
# scripts/, tests/fixtures/ and the folder, and run scripts/bench/run.sh there. Debug info is
# stripped (most of a release binary's size). `ninfer bench` starts the engine and the workers
# found next to its own binary, and `ninfer run` the gateway too, so the four stay together.
#
# BASELINE=PATH copies an older build of `ninfer` in as `ninfer-baseline`, for the `experts_ab`
# stage of run.sh (a kernel change measured against the build before it).
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${NINFER_BUNDLE:-target/gpu-bundle}

if [ "${WITH_GPU_TESTS:-0}" = 1 ]; then
  NINFER_BUNDLE="$bundle" scripts/gpu_tests.sh build
fi
mkdir -p "$bundle"
cargo build --release --locked -p ninfer -p ninfer-engine -p ninfer-expert-worker -p ninfer-gateway
for binary in ninfer ninfer-engine ninfer-expert-worker ninfer-gateway; do
  cp "target/release/$binary" "$bundle/$binary"
done
if [ -n "${BASELINE:-}" ]; then
  cp "$BASELINE" "$bundle/ninfer-baseline"
fi
strip --strip-debug "$bundle"/ninfer* 2>/dev/null || true
du -sh "$bundle"
