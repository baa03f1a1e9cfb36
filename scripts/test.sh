#!/usr/bin/env bash
# The project's test command (README, CI). GPU tests skip themselves, loudly, without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked --no-fail-fast "$@"
