//! The Qwen4-Exp (`qwen4_exp`) text model: its forward over the backend (`graph`, on every
//! backend; the parts with no device op yet run on the host), and the pieces built and tested
//! on their own — the QSA indexer's block selection and the PLE layers' hashed n-gram row ids
//! (and the tie-breaking of PyTorch's top-k the selection must follow).
//!
//! Owns: the pure host functions of those pieces (plain slices in, plain values out) and the
//! Qwen4-Exp layer loop with its per-sequence states.
//! Must not touch: op implementations (backends), the shared Gated DeltaNet and MoE code.

pub mod graph;
pub mod ngram_hash;
pub mod ple_state;
pub mod qsa_selection;
pub mod torch_topk;
