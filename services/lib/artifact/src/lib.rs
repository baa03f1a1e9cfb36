//! The `.ninfer` model artifact: its on-disk format, the normalised model configuration types,
//! weight quantization codecs, a streaming writer and a zero-copy (mmap) reader.
//!
//! Owns: every byte-level decision about `.ninfer` files (see `docs/FORMAT.md`).
//! Must not touch: Hugging Face checkpoints (that is `ninfer-convert`), model math, processes.
//! Depends on no other crate of this workspace.

pub mod config;
pub mod error;
pub mod header;
pub mod quant;
pub mod reader;
pub mod summary;
pub mod tensor_spec;
pub mod writer;

pub use config::{
    Architecture, CommonConfig, GenerationDefaults, HybridConfig, LayerType, ModelConfig,
    OutputGateActivation, Qwen3MoeConfig, Qwen4ExpConfig,
};
pub use error::ArtifactError;
pub use header::{
    Checksum, DType, ExpertBank, Header, QuantizationParams, SourceInfo, TensorClass, TensorEntry,
    NO_EXPERT,
};
pub use quant::{QuantizedLayout, GROUP_SIZE};
pub use reader::{Artifact, TensorView};
pub use writer::{part_path, ArtifactWriter, TensorSpec, WriterOptions};
