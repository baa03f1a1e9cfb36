//! While a step graph records (device/step_graph.rs), every backend op checks the capture as it
//! ends, so a recording broken by one op and reported by a later one says where it broke.
//!
//! Owns: the watch's state. Must not touch: the recording itself.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::CudaStream;

/// While a step graph records, which op first left the capture no longer active: something
/// in it (or between it and the op before) broke the recording, whichever op later reports the
/// failure. The recording's abandonment names it.
#[derive(Default)]
pub(super) struct CaptureWatch {
    recording: AtomicBool,
    broken_after: Mutex<Option<String>>,
}

impl CaptureWatch {
    /// Whether a recording is being watched (checked once per op).
    pub(super) fn recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    pub(super) fn start(&self) {
        if let Ok(mut broken) = self.broken_after.lock() {
            *broken = None;
        }
        self.recording.store(true, Ordering::Relaxed);
    }

    /// Stops watching; the op after which the capture was first found broken, if it was.
    pub(super) fn stop(&self) -> Option<String> {
        self.recording.store(false, Ordering::Relaxed);
        self.broken_after
            .lock()
            .ok()
            .and_then(|mut broken| broken.take())
    }

    /// After `op`: notes it if the capture is no longer active and no op was noted before.
    pub(super) fn check_after(&self, stream: &CudaStream, op: String) {
        let active = matches!(
            stream.capture_status(),
            Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
        );
        if active {
            return;
        }
        if let Ok(mut broken) = self.broken_after.lock() {
            broken.get_or_insert(op);
        }
    }
}
