//! The f32 reference expert executor, noting what it was asked: the suites that compare a
//! split model with the unsplit one hold the routes equal too (on the CPU, which side computed
//! an expert leaves the values alike).
//!
//! Owns: [`NotingExecutor`]. Must not touch: what a suite checks.

use std::sync::{Arc, Mutex};

use ninfer_artifact::Artifact;
use ninfer_engine::{EngineError, ExpertBatch, ExpertExecutor, ReferenceExpertExecutor};

/// The f32 reference executor, noting the layer and rows of every call.
pub struct NotingExecutor {
    inner: ReferenceExpertExecutor,
    calls: Mutex<Vec<(usize, usize)>>,
}

impl NotingExecutor {
    pub fn new(artifact: &Arc<Artifact>) -> Arc<Self> {
        Arc::new(NotingExecutor {
            inner: ReferenceExpertExecutor::new(Arc::clone(artifact)),
            calls: Mutex::new(Vec::new()),
        })
    }

    /// (layer, rows) of each call so far, in order.
    pub fn calls(&self) -> Vec<(usize, usize)> {
        self.calls.lock().unwrap().clone()
    }
}

impl ExpertExecutor for NotingExecutor {
    fn name(&self) -> &str {
        "noting reference"
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        self.calls
            .lock()
            .unwrap()
            .push((batch.layer, batch.tokens()));
        self.inner.compute(batch, out)
    }
}
