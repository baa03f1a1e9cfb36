//! How a conversion reports its progress: the callbacks the CLI implements (a bar on a
//! terminal, log lines otherwise) and a sink that only logs.
//!
//! Owns: the progress trait. Must not touch: the conversion itself.

/// Progress callbacks; the CLI draws a bar on a terminal and logs lines otherwise.
pub trait ConvertProgress: Sync {
    /// Called once with the number of output tensors.
    fn start(&self, _total_tensors: u64) {}
    /// Called after each output tensor is written.
    fn tensor_written(&self, _name: &str, _bytes: u64) {}
    /// A decision worth telling the user (skipped or kept extra tensors, reuse).
    fn note(&self, message: &str) {
        tracing::info!("{message}");
    }
    /// Polled between tensors; `true` aborts the conversion and deletes partial output.
    fn cancelled(&self) -> bool {
        false
    }
}

/// Progress sink that only logs notes.
pub struct NoProgress;
impl ConvertProgress for NoProgress {}
