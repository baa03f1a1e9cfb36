//! The engine: model graphs of the supported architectures over a backend trait, per-sequence
//! state, the MoE path (expert executors, GPU expert placement), sampling, perplexity, and the
//! engine service with its scheduler.
//!
//! Owns: all model math and the only process that talks to the GPU.
//! Must not touch: HTTP, tokenizer-level text handling (gateway), the artifact byte layout
//! (read through `ninfer-artifact`).
//!
//! Module map:
//! * [`backend`] — the `Backend` trait (ops over device-resident buffers) and [`backend::cpu`];
//!   [`backend::same_device`] opens further backends on one device (a layer split checked
//!   without several GPUs).
//! * [`host_math`] — activations, SwiGLU, RoPE frequencies and the host router, shared by the
//!   backends and the executors.
//! * [`weights`] — host views of stored f32/bf16/int8/int4 weights and the CPU matmul.
//! * [`spec`] — architecture → graph switches; refusal of unknown architectures.
//! * [`model`] — weight loading, `SequenceState`, the batched forward pass; a model on one
//!   backend, or its decoder layers split over several as a pipeline (`Model::load_pipeline`:
//!   each stage its layers, their state and expert slots, the hidden state crossing between
//!   stages).
//! * [`profile`] — always-on forward counters (time split, expert bytes) for `ninfer bench`.
//! * [`moe`] — a MoE layer's forward over its route (GPU expert slots / prefill staging / expert
//!   executor), the three expert executors (f32 reference, SIMD kernels in-process, worker
//!   processes) and `--moe-gpu-experts` placement with its memory budget.
//! * [`service`] — the gRPC engine service: scheduler actor (continuous batching), routing stats.
//! * [`sampling`] — greedy / temperature / top-k / top-p / min-p / penalties, seeded.
//! * [`constraint`] — constrained decoding: token masks from a grammar (llguidance), the
//!   reasoning block and its budget.
//! * [`perplexity`] — windowed NLL of a token stream.
//! * [`prefix_cache`] — automatic prefix caching: prompt blocks by hash chain, recurrent-state
//!   checkpoints, LRU eviction within a budget.
//! * [`vision`] — the Qwen3.5 vision tower: its settings, weights, grid index math and the f32
//!   host forward.
//! * [`testing`] — `test_device!` and tiny random-weight artifacts for tests.

pub mod backend;
pub mod constraint;
pub mod error;
pub mod host_math;
pub mod model;
pub mod moe;
pub mod perplexity;
pub mod prefix_cache;
pub mod profile;
pub mod sampling;
pub mod service;
pub mod spec;
pub mod testing;
pub mod vision;
pub mod weights;

pub use backend::cpu::CpuBackend;
pub use backend::{Backend, DeltaRuleForm};
pub use error::EngineError;
pub use model::{
    open_artifact, LayerwiseSummary, LogitsSelection, Model, PipelineStage, PrefillStagingOptions,
    SequenceInput, SequenceState,
};
pub use moe::layerwise::PrefillThroughputs;
pub use moe::{ExpertBatch, ExpertExecutor, NoRoutedExperts, ReferenceExpertExecutor};
pub use perplexity::{score_chunk, token_nlls, PerplexityOptions, TokenNll};
pub use sampling::{Sampler, SamplingParams};
pub use spec::{ModelSpec, SUPPORTED_ARCHITECTURES};
