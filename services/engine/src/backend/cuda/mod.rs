//! The CUDA backend: the same [`Backend`](super::Backend) ops as the CPU reference, computed on an
//! NVIDIA GPU by CUDA C kernels (`kernels/*.cu`) compiled at run time with NVRTC.
//!
//! Owns: finding the CUDA libraries ([`loader`]), compiling kernels ([`nvrtc`]) and caching them
//! on disk ([`kernels`]), device buffers for activations, weights, KV caches and recurrent
//! states, and every op's launch ([`device`]). Nothing here needs CUDA at build time: the driver
//! and NVRTC are opened with `dlopen` when a [`CudaBackend`] is created, so a machine without
//! them builds, tests (the GPU cases skip) and runs on the CPU.
//! Must not touch: model structure (`crate::model`), routed experts (they stay with the
//! `ExpertExecutor` on the host: routing comes back to the host after the router), the artifact
//! byte layout.
//!
//! What it computes: f32 activations with f32 accumulation (bf16 activations fail the golden
//! fixtures' 99% top-1 bar, see `cublas`); bf16 matrices stay bf16 on the GPU, every other
//! weight is decoded to f32 at load. Decode runs batch-invariant kernels (a warp-per-output
//! matmul that streams the weights once, split-K flash-decoding over the bf16 KV cache, the
//! recurrent delta rule); prefill runs cuBLAS for bf16 matrices (the activations split into two
//! bf16 terms, [`cublas`]), tiled causal attention and the chunked delta rule, each behind a
//! start-up self-check against the reference kernel. The router runs on the GPU and its routing
//! stays there until the host needs it (`device/pending_routing.rs`); op outputs are recycled
//! (`device/tensor_pool.rs`). Every op returns its error (`EngineError::Device`).
//!
//! Environment: `NINFER_NVRTC_PATH` / `NINFER_CUDA_DRIVER_PATH` / `NINFER_CUBLAS_PATH` (a library file or its folder,
//! tried first; see [`loader`]), `NINFER_KERNEL_CACHE` (the compiled-kernel folder; see
//! [`kernels`]).

pub mod cublas;
pub mod device;
pub mod kernels;
pub mod loader;
pub mod nvrtc;

pub use device::{
    CudaBackend, CudaConvState, CudaExpertSlots, CudaKvCache, CudaRecurrentState, CudaTensor,
    CudaVisionOutput, CudaVisionTower, CudaWeight, DeviceInfo, VisionPrecision,
};

pub use device::{
    parse_memory_gib, parse_shared_memory_bytes, AttentionPath, CudaOptions, DeltaRuleKernel,
    GroupedExpertKernels, KvDtype, PeerPath, CONSUMER_CARD_SHARED_MEMORY, MEMORY_CAP_ENV,
    SHARED_MEMORY_CAP_ENV,
};

/// What went wrong on the CUDA side. Every variant says what was looked for or called.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    #[error("{library} not found (set ${env_var} to the library file or its folder); tried: {}", .tried.join("; "))]
    LibraryNotFound {
        library: String,
        env_var: String,
        tried: Vec<String>,
    },
    #[error("{library} has no symbol `{symbol}` (too old a version?)")]
    MissingSymbol { library: String, symbol: String },
    #[error("cuBLAS: {call} failed: {message}")]
    Cublas { call: String, message: String },
    #[error("NVRTC: {call} failed: {message}")]
    Nvrtc { call: String, message: String },
    #[error("kernels/{kernel} does not compile for {arch}:\n{log}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },
    #[error("kernel cache: cannot store {path}: {problem}")]
    Cache { path: String, problem: String },
    #[error("CUDA driver: {what}: {message}")]
    Driver { what: String, message: String },
    #[error("no usable CUDA device: {problem}")]
    NoDevice { problem: String },
    #[error("unsupported GPU: {problem}")]
    Unsupported { problem: String },
    #[error("{problem}")]
    Invalid { problem: String },
}
