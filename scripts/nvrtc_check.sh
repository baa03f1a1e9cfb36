#!/usr/bin/env bash
# Compiles every CUDA kernel of kernels/ with NVRTC for sm_80, sm_86, sm_89, sm_90 and sm_120 (data-
# centre cards and RTX 30/40/50) — no GPU, no CUDA
# toolkit: NVRTC comes from the PyPI wheel nvidia-cuda-nvrtc-cu12, installed into target/.
# A kernel that does not compile fails this (NINFER_REQUIRE_NVRTC=1 also fails a missing NVRTC
# instead of skipping). CI runs it after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel_dir=${NVRTC_WHEEL_DIR:-target/nvrtc-wheel}
lib_dir="$wheel_dir/nvidia/cuda_nvrtc/lib"
if ! ls "$lib_dir"/libnvrtc.so.* >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$wheel_dir" "nvidia-cuda-nvrtc-cu12==${NVRTC_WHEEL_VERSION:-12.9.86}"
fi
case "$lib_dir" in /*) ;; *) lib_dir="$PWD/$lib_dir" ;; esac
# NVRTC_CHECK_PROFILE=release builds the check in the release profile (a checkout whose target/
# holds only release builds compiles far less).
profile=()
if [ -n "${NVRTC_CHECK_PROFILE:-}" ]; then profile=(--profile "$NVRTC_CHECK_PROFILE"); fi
NINFER_NVRTC_PATH="$lib_dir" NINFER_REQUIRE_NVRTC=1 \
  cargo test --locked "${profile[@]}" -p ninfer-engine --test cuda_nvrtc -- --nocapture
