#!/usr/bin/env bash
# The project's test command (README, CI). GPU tests skip themselves, loudly, without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# The process-boundary tests start ninfer-engine / ninfer-expert-worker / ninfer-gateway as real
# processes; `cargo test` only builds the binaries of the package under test, so build all of
# them first (a fresh clone has none).
cargo build --workspace --bins --locked
cargo test --workspace --locked --no-fail-fast "$@"
