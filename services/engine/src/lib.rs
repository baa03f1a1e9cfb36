//! The engine: model graphs of the supported architectures over a backend trait, per-sequence
//! state, the expert-executor interface, sampling and perplexity; (later) the engine service with
//! its scheduler.
//!
//! Owns: all model math and the only process that talks to the GPU.
//! Must not touch: HTTP, tokenizer-level text handling (gateway), the artifact byte layout
//! (read through `ninfer-artifact`).
//!
//! Module map:
//! * [`backend`] — the `Backend` trait (ops over device-resident buffers) and [`backend::cpu`].
//! * [`host_math`] — activations, SwiGLU, RoPE frequencies and the host router, shared by the
//!   backends and the executors.
//! * [`weights`] — host views of stored f32/bf16/int8/int4 weights and the CPU matmul.
//! * [`spec`] — architecture → graph switches; refusal of unknown architectures.
//! * [`model`] — weight loading, `SequenceState`, the batched forward pass.
//! * [`profile`] — always-on forward counters (time split, expert bytes) for `ninfer bench`.
//! * [`experts`] — the `ExpertExecutor` trait and the in-process CPU executor.
//! * [`kernel_experts`] — in-process experts on the SIMD kernels (the worker's executor).
//! * [`remote_experts`] — experts computed by worker processes through the shared-memory channel.
//! * [`gpu_experts`] — `--moe-gpu-experts`: how many experts per layer the GPU holds, and which.
//! * [`service`] — the gRPC engine service: scheduler actor (continuous batching), routing stats.
//! * [`sampling`] — greedy / temperature / top-k / top-p / min-p / penalties, seeded.
//! * [`perplexity`] — windowed NLL of a token stream.
//! * [`testing`] — `test_device!` and tiny random-weight artifacts for tests.

pub mod backend;
pub mod error;
pub mod experts;
pub mod gpu_experts;
pub mod host_math;
pub mod kernel_experts;
pub mod model;
pub mod perplexity;
pub mod profile;
pub mod remote_experts;
pub mod sampling;
pub mod service;
pub mod spec;
pub mod testing;
pub mod weights;

pub use backend::cpu::CpuBackend;
pub use backend::{Backend, DeltaRuleForm};
pub use error::EngineError;
pub use experts::{CpuExpertExecutor, ExpertBatch, ExpertExecutor};
pub use model::{open_artifact, LogitsSelection, Model, SequenceInput, SequenceState};
pub use perplexity::{token_nlls, PerplexityOptions, TokenNll};
pub use sampling::{Sampler, SamplingParams};
pub use spec::{ModelSpec, SUPPORTED_ARCHITECTURES};
