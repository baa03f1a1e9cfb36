//! The expert executor interface: the routed experts a MoE layer leaves to the CPU.
//!
//! Owns: the contract "hidden states + per-token expert ids + routing weights of one MoE layer →
//! weighted sum of the selected experts' SwiGLU outputs". The model calls it once per MoE layer
//! per forward (see [`crate::moe::layer`]); three executors implement it: the f32 reference
//! ([`crate::moe::reference_executor`]), the SIMD kernels in this process
//! ([`crate::moe::kernel_executor`]) and expert worker processes
//! ([`crate::moe::worker_executor`]); a model without MoE layers gets [`NoRoutedExperts`].
//! Must not touch: routing (the model decides ids and weights), the artifact byte layout.

use ninfer_artifact::ExpertBank;

use crate::error::EngineError;

/// One MoE layer's routed-expert work for a batch of tokens (all host memory, row-major).
pub struct ExpertBatch<'a> {
    /// Layer index in the model.
    pub layer: usize,
    /// The artifact's bank of this layer (prefix, offset, stride, count, dtype).
    pub bank: &'a ExpertBank,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// `[tokens, hidden_size]`.
    pub hidden: &'a [f32],
    pub experts_per_token: usize,
    /// `[tokens, experts_per_token]`.
    pub expert_ids: &'a [u32],
    /// `[tokens, experts_per_token]`.
    pub weights: &'a [f32],
}

impl ExpertBatch<'_> {
    pub fn tokens(&self) -> usize {
        self.hidden.len() / self.hidden_size.max(1)
    }
}

/// Computes routed experts. Object-safe; one executor serves every layer and every thread.
pub trait ExpertExecutor: Send + Sync {
    /// Short name for errors and logs.
    fn name(&self) -> &str;
    /// Sees the full routing of a layer (`[tokens, k]` ids) before any expert is moved
    /// elsewhere; routing statistics count here, so they include experts the GPU computes.
    fn observe_routing(&self, _layer: usize, _expert_ids: &[u32], _tokens: usize) {}
    /// Writes `out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(hidden[t])` (`[tokens, hidden]`).
    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError>;
    /// Cumulative nanoseconds of expert computation proper, for executors that run it elsewhere
    /// and can tell it from the waiting (worker processes report theirs per request). `None`:
    /// all the time spent in [`Self::compute`] is computation (in-process executors).
    fn compute_nanos(&self) -> Option<u64> {
        None
    }
    /// The worker channels, for executors whose experts run in worker processes: what a
    /// backend that hands layers off itself needs ([`WorkerChannels`]).
    fn worker_channels(&self) -> Option<&dyn WorkerChannels> {
        None
    }
}

/// The channels of an executor's worker processes, for a hand-off the backend drives itself
/// (a GPU posting requests and collecting answers through its own mapping of the channels).
pub trait WorkerChannels: Send + Sync {
    /// Every worker's channel memory, in worker order; fixed for the executor's life.
    fn channel_memory(&self) -> Vec<ninfer_channel::SegmentMemory>;
    /// Readies the workers for a step whose hand-offs the backend drives. `Some`: the experts
    /// each worker owns (disjoint, in worker order), every worker is up, each was asked to keep
    /// spinning for requests and no earlier give-up is pending. `None`: the host hands this
    /// step's layers off (a worker is missing or ownership overlaps).
    fn prepare_backend_handoff(&self) -> Option<Vec<std::ops::Range<usize>>>;
    /// Why worker `worker` refused its last request, if it did.
    fn refusal(&self, worker: usize) -> Option<String>;
    /// The worker's address, for messages.
    fn worker_address(&self, worker: usize) -> String;
}

/// The executor of a model without MoE layers (every layer a dense MLP): nothing ever calls it,
/// and a call would be a bug, answered with an error rather than made-up numbers.
pub struct NoRoutedExperts;

impl ExpertExecutor for NoRoutedExperts {
    fn name(&self) -> &str {
        "none (no routed experts)"
    }

    fn compute(&self, batch: &ExpertBatch<'_>, _out: &mut [f32]) -> Result<(), EngineError> {
        Err(EngineError::InvalidConfig {
            problem: format!(
                "layer {}: routed experts requested from a model without MoE layers",
                batch.layer
            ),
        })
    }
}
