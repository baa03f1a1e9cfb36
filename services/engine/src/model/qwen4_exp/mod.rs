//! Pieces of the Qwen4-Exp (`qwen4_exp`) text model that are built and tested on their own,
//! ahead of the model graph: the QSA indexer's block selection and the PLE layers' hashed
//! n-gram row ids (and the tie-breaking of PyTorch's top-k the selection must follow). Neither is reachable from an artifact yet: the architecture is still refused
//! by `spec::check_architecture_name` until the whole forward is in place.
//!
//! Owns: the pure host functions of those two pieces (plain slices in, plain values out).
//! Must not touch: backends, artifacts, sequence state.

pub mod ngram_hash;
pub mod qsa_selection;
pub mod torch_topk;
