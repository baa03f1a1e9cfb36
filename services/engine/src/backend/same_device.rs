//! Several backends on one physical device, so a layer split over pipeline stages runs, and is
//! checked, on a machine without several GPUs (the split tests, the engine's
//! `--pipeline-stages-on-one-device`).
//!
//! What the backends of one device share: on the CPU, nothing (a CPU backend keeps no state;
//! every stage's weights and caches are its own host allocations). On CUDA, the card and its
//! primary context (cudarc's `CudaContext::new` retains it): one address space and one memory,
//! so the stages' weights, KV caches and expert slots all count against that card, and a
//! pointer of one stage would be valid in the other (the split never relies on it: tensors
//! cross by [`Backend::move_tensor_to`]). Each backend has its own stream, kernel modules,
//! cuBLAS handle, tensor pool, staging buffers and step graphs, as a backend on another card
//! would; their streams are not ordered against each other except through the host.
//!
//! Owns: opening another backend like a given one. Must not touch: the split itself
//! (`crate::model`).

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::error::EngineError;

/// A backend that can open another, independent one on the device it runs on.
pub trait OpenOnSameDevice: Backend + Sized {
    /// A new backend on this one's device, with this one's options.
    fn open_on_same_device(&self) -> Result<Self, EngineError>;
}

impl OpenOnSameDevice for CpuBackend {
    fn open_on_same_device(&self) -> Result<Self, EngineError> {
        // A copy keeps the settings (a test's expert fill delay); there is no state to share.
        Ok(*self)
    }
}

impl OpenOnSameDevice for CudaBackend {
    fn open_on_same_device(&self) -> Result<Self, EngineError> {
        CudaBackend::with_options(self.info().ordinal, self.options()).map_err(|source| {
            EngineError::Device {
                op: "opening a second backend on the same GPU",
                source,
            }
        })
    }
}
