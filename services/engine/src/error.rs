//! Typed errors of the engine library. Every variant names what was wrong and the numbers
//! involved, so a caller can show it to a user unchanged.

use ninfer_artifact::ArtifactError;

use crate::backend::cuda::CudaError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("architecture `{name}` is not supported by this engine (it runs qwen3_moe, qwen3_next, qwen3_5_moe, qwen3_5 and qwen4_exp)")]
    UnsupportedArchitecture { name: String },
    #[error("prompt of {tokens} tokens does not fit the maximum context of {max_context} tokens")]
    PromptTooLong { tokens: usize, max_context: usize },
    #[error("sequence already holds {held} tokens; {added} more would exceed its maximum context of {max_context} tokens")]
    ContextFull {
        held: usize,
        added: usize,
        max_context: usize,
    },
    #[error("token id {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfVocabulary { token: u32, vocab_size: usize },
    #[error("empty input: {what}")]
    EmptyInput { what: String },
    #[error("weight `{name}`: {problem}")]
    InvalidWeight { name: String, problem: String },
    #[error("invalid model configuration: {problem}")]
    InvalidConfig { problem: String },
    #[error("expert executor `{executor}` failed on layer {layer}: {problem}")]
    ExpertExecutor {
        executor: String,
        layer: usize,
        problem: String,
    },
    #[error("invalid sampling parameters: {problem}")]
    InvalidSampling { problem: String },
    /// A backend op failed on its device; `source` is the device's own error, unchanged (an
    /// out-of-memory says so, with the bytes asked for).
    #[error("{op} on the GPU: {source}")]
    Device {
        op: &'static str,
        #[source]
        source: CudaError,
    },
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
}
