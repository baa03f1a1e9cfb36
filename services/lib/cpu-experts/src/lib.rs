//! CPU compute kernels for routed experts (SwiGLU over f32 / bf16 / int8 / int4 weights).
//!
//! Owns: the SIMD/AMX kernels, their scalar reference, run-time ISA dispatch, the pinned
//! thread pool that runs one MoE layer's experts, and the read-bandwidth / expert benchmarks
//! that `ninfer bench` prints.
//! Must not touch: processes, channels, model graphs or files. Reads weights in the packed
//! layout that `ninfer-artifact` defines (`docs/FORMAT.md`, "Data types and quantization").
//!
//! Module map:
//! - [`isa`]: which instruction-set path runs (`KernelIsa`), CPU feature detection, AMX permission.
//! - [`layout`]: byte layout of one expert's `gate_up` / `down` matrices per weight dtype.
//! - [`layer`]: the entry point — one layer's set of (expert, tokens, routing weights) computed
//!   into `[tokens, H]`, with caller-owned scratch ([`LayerScratch`]).
//! - [`pool`]: thread pool pinned to a NUMA node's cores, spin barrier, cpulist parsing.
//! - [`prepare`]: activation forms the kernels read (f32, permuted f32, bf16, int8 + scales,
//!   AMX tile packing).
//! - [`tuning`]: [`KernelTuning`], the value that chooses work stealing, the shared decode input,
//!   phase 2's split and software prefetch; the caller builds it and hands it to
//!   [`LayerScratch::with_tuning`] (no process-wide tuning state exists).
//! - `kernels`: row-kernel dispatch per (path, dtype, tokens), per-thread buffers.
//! - `scalar`, `avx2`, `avx512`, `amx`: the row kernels of each path.
//! - [`routed`]: one layer from router output (ids + weights per token) — the executor shared by
//!   the engine's in-process path and the expert worker.
//! - [`bench`]: read-bandwidth and expert-throughput measurements.
//! - [`buffer`]: page-aligned, first-touch-parallel byte buffers for weights.

pub mod bench;
pub mod buffer;
pub mod isa;
pub mod layer;
pub mod layout;
pub mod pool;
pub mod prepare;
pub mod routed;
pub mod tuning;

mod kernel_shared;
mod kernels;
mod scalar;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

pub use isa::KernelIsa;
pub use layer::{compute_layer, ExpertTask, ExpertWeights, LayerScratch, ScratchCapacity};
pub use layout::{ExpertLayout, MatrixLayout, WeightDType};
pub use pool::{cpus_by_physical_core, cpus_of_numa_node, ThreadPool};
pub use tuning::{DownSplit, KernelTuning, Prefetch};

/// Errors of this crate: every one names the bad value and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("kernel ISA `{0}` is not supported by this CPU (supported: {1})")]
    UnsupportedIsa(String, String),
    #[error("unknown kernel ISA `{0}` (expected one of scalar, avx2, avx512, avx512-vnni, amx)")]
    UnknownIsa(String),
    #[error("invalid expert layout: {0}")]
    Layout(String),
    #[error("invalid layer input: {0}")]
    Input(String),
    #[error("scratch too small: {0}")]
    ScratchTooSmall(String),
    #[error("thread pool: {0}")]
    Pool(String),
}
