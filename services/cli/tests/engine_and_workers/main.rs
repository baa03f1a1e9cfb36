//! The process boundary, end to end: `ninfer-engine` and `ninfer-expert-worker` started as real
//! processes on unix sockets, spoken to over gRPC. Needs the workspace binaries built next to
//! this test (`scripts/test.sh` / `cargo test --workspace` builds them).

#[path = "../common/mod.rs"]
mod common;
mod helpers;

mod full_stack;
mod generation;
mod killing;
mod supervision;
mod workers;
