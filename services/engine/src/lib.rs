//! The engine: model graphs of the supported architectures over a backend trait, per-sequence
//! state, sampling, and (later) the engine service with its scheduler.
//!
//! Owns: all model math and the only process that talks to the GPU.
//! Must not touch: HTTP, tokenizer-level text handling (gateway), the artifact byte layout
//! (read through `ninfer-artifact`).
