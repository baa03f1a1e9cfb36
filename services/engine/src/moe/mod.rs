//! The MoE path of the engine: how a MoE layer's routed experts are computed, by whom, and
//! which of them the GPU holds.
//!
//! Owns:
//! * [`layer`] — `MoeLayer::forward`: the router, the split of the routed experts over a
//!   `Route` (resident in the backend's slots / staged for a big prefill batch /
//!   the expert executor), the shared expert, and the routing's statistics and profile counts.
//! * [`layerwise`] — layerwise prefill: the measured throughputs, how many of a layer's
//!   experts a big batch streams, and the double-buffered stream of one forward.
//! * [`executor`] — the `ExpertExecutor` interface the CPU side of the split goes through.
//! * [`reference_executor`] — the f32 reference executor (tests hold the others equal to it).
//! * [`kernel_executor`] — the SIMD kernels of `ninfer-cpu-experts` in this process.
//! * [`worker_executor`] — expert worker processes over the shared-memory channel, with
//!   restart and replay.
//! * [`placement`] — `--moe-gpu-experts`: the slot memory budget, experts per layer, and which.
//! * [`gpu_split`] — several GPUs: `--gpus` / `--gpu-split`, the contiguous layer ranges per
//!   card and each card's expert slots for its own layers (the plan; `crate::model` runs it),
//!   and the features a split refuses.
//! * [`expert_cache`] — the dynamic expert cache: which experts the slots hold from step to
//!   step, its timing, counters and hit-rate simulation.
//! * [`cache_policy`] — the cache's admission policy per layer: which missed expert earns a
//!   copy (its expected saving against the fill's cost), which resident it replaces, and the
//!   copy budget.
//!
//! The expert ↔ slot table both backends keep is [`crate::backend::ExpertSlotTable`] (the
//! backends sit below this module).
//! Must not touch: the graph around a MoE layer and weight loading (`crate::model`), op
//! implementations (backends), the expert kernels (`ninfer-cpu-experts`), the channel layout
//! (`ninfer-channel`).

pub mod cache_policy;
pub mod executor;
pub mod expert_cache;
pub mod gpu_split;
pub mod kernel_executor;
pub mod layer;
pub mod layerwise;
pub mod placement;
pub mod reference_executor;
pub mod worker_executor;

pub use executor::{ExpertBatch, ExpertExecutor, NoRoutedExperts};
pub use kernel_executor::KernelExpertExecutor;
pub use reference_executor::ReferenceExpertExecutor;
pub use worker_executor::{WorkerExpertExecutor, WorkerExpertExecutorOptions};
