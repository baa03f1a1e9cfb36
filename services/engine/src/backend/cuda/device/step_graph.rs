//! Decode steps as CUDA graphs: a step's launches recorded once and replayed as one graph
//! launch, so a decode step costs the GPU's time rather than ~1,000 host launch calls.
//!
//! A [`CudaStepGraph`] serves one batch of sequences (its rows' KV caches and states are baked
//! into the recording by address) and goes through three stages:
//! 1. **first step, in the graph's shape**: the ops run as usual, except that the token ids and
//!    positions come from the graph's device inputs and the attention kernels read their
//!    positions there (not from launch arguments), with the split workspace sized for any
//!    position; op outputs come from the graph's own buffer pool, which this step fills.
//! 2. **second step, recorded**: the same ops, recorded (stream capture) instead of run, take
//!    their buffers from that pool (a missing one abandons the recording: nothing may be
//!    allocated inside it), and the recording is launched once. A synchronising call of any
//!    thread on the device (the image encoder reading its output back, say) ends every capture
//!    under way, so a recording whose capture broke is tried again: the broken step runs op by
//!    op, and after the n-th break the graph runs 2ⁿ − 1 steps in its shape before recording
//!    again (at most [`MOST_STEPS_BETWEEN_RECORDINGS`]); each op checks the capture as it ends,
//!    so the failure names where it broke.
//! 3. **every later step, replayed**: new ids and positions are copied into the inputs and the
//!    graph is launched.
//!
//! The graph-shaped kernels compute what the uncaptured ones compute, bit for bit (the split
//! chunk is chosen on the device by the host's rule), so tokens do not depend on whether a step
//! was replayed (`cuda_model::step_graphs_give_the_tokens_of_uncaptured_steps`).
//!
//! Owns: the stages, the inputs, the graph's buffer pool, and the "active step graph" the ops
//! consult ([`ActiveStepGraph`]). Must not touch: which steps go through a graph (the model
//! decides), host-side sequence bookkeeping.

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUresult, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, DevicePtr, DriverError};

use super::graph_census::GraphCensus;
use super::tensor_pool::{RecyclePool, TensorPool};
use super::{driver_error, ActiveStepGraph, CudaBackend};
use crate::backend::cuda::CudaError;
use crate::backend::{StepGraphEnd, StepGraphRun};

/// One batch's decode step: its device inputs, its buffers and how far it got.
pub struct CudaStepGraph {
    rows: usize,
    /// Token id of each row.
    ids: CudaSlice<u32>,
    /// Position of each row (the cache length before the step's append).
    positions: CudaSlice<u32>,
    /// Every op output of the step: filled by the first step, drawn from by the recording, and
    /// kept (never handed to other ops) while the graph lives, since the graph writes them.
    pool: Arc<TensorPool>,
    stage: Stage,
    /// Recordings of this graph whose capture something broke.
    broken_recordings: u32,
    /// Steps to run in the graph's shape before the next recording (after a broken one).
    steps_before_recording: u32,
    /// The step under way is being recorded.
    recording: bool,
}

/// A synchronising call of any thread on the device (another stream's wait, a free) ends every
/// capture under way, so a recording may break through no fault of its own: it is tried again,
/// ever less often while it keeps breaking, at most this many steps apart.
const MOST_STEPS_BETWEEN_RECORDINGS: u32 = 63;

enum Stage {
    /// No step ran through the graph yet.
    New,
    /// A step ran in the graph's shape: the pool holds every buffer a recording needs.
    Shaped,
    Recorded(CudaGraph),
    /// Recording failed; the model stops using this graph.
    Abandoned,
}

/// Where the capture broke, in words, when the watch saw it.
fn broken_capture(broken_after: Option<String>) -> Option<String> {
    broken_after.map(|op| {
        format!(
            "the capture was no longer active after `{op}` (it, or something between it and the \
             op before, or another thread's synchronisation, broke it)"
        )
    })
}

// SAFETY: the CUDA graph handles inside are used by one thread at a time (the model keeps its
// step graphs behind a mutex), and the driver allows a graph's use from any thread bound to its
// context (`CudaGraph::launch` binds it).
unsafe impl Send for CudaStepGraph {}

impl CudaBackend {
    /// The step graph the ops of the current step run in, if any.
    pub(super) fn active_step_graph(&self) -> Option<ActiveStepGraph> {
        self.active_step_graph
            .lock()
            .ok()
            .and_then(|active| active.clone())
    }

    fn set_active_step_graph(&self, active: Option<ActiveStepGraph>) -> Result<(), CudaError> {
        let mut slot = self
            .active_step_graph
            .lock()
            .map_err(|_| CudaError::Invalid {
                problem: "the active step graph's lock is poisoned".into(),
            })?;
        *slot = active;
        Ok(())
    }

    pub(super) fn create_step_graph(
        &self,
        rows: usize,
    ) -> Result<Option<CudaStepGraph>, CudaError> {
        if !self.options.step_graphs || self.op_timing.is_some() || rows == 0 {
            return Ok(None);
        }
        Ok(Some(CudaStepGraph {
            rows,
            ids: self.alloc_u32(rows)?,
            positions: self.alloc_u32(rows)?,
            // Unbounded: the graph's buffers must all stay.
            pool: Arc::new(RecyclePool::new(usize::MAX, usize::MAX)),
            stage: Stage::New,
            broken_recordings: 0,
            steps_before_recording: 0,
            recording: false,
        }))
    }

    fn alloc_u32(&self, len: usize) -> Result<CudaSlice<u32>, CudaError> {
        self.stream
            .alloc_zeros::<u32>(len.max(1))
            .map_err(driver_error("allocating a step graph's inputs"))
    }

    pub(super) fn start_step_graph(
        &self,
        graph: &mut CudaStepGraph,
        ids: &[u32],
        positions: &[usize],
    ) -> Result<StepGraphRun, CudaError> {
        if ids.len() != graph.rows || positions.len() != graph.rows {
            return Err(CudaError::Invalid {
                problem: format!(
                    "a step graph of {} rows got {} ids and {} positions",
                    graph.rows,
                    ids.len(),
                    positions.len()
                ),
            });
        }
        let positions: Vec<u32> = positions
            .iter()
            .map(|&p| {
                u32::try_from(p).map_err(|_| CudaError::Invalid {
                    problem: format!("position {p} does not fit a step graph's inputs"),
                })
            })
            .collect::<Result<_, _>>()?;
        self.stream
            .memcpy_htod(ids, &mut graph.ids)
            .map_err(driver_error("copying a step's token ids"))?;
        self.stream
            .memcpy_htod(&positions, &mut graph.positions)
            .map_err(driver_error("copying a step's positions"))?;
        let recording = match &graph.stage {
            Stage::Recorded(recorded) => {
                recorded
                    .launch()
                    .map_err(driver_error("launching a step graph"))?;
                return Ok(StepGraphRun::Replayed);
            }
            Stage::Abandoned => {
                return Err(CudaError::Invalid {
                    problem: "a step graph that failed to record was used again".into(),
                })
            }
            Stage::New => false,
            Stage::Shaped if graph.steps_before_recording > 0 => {
                graph.steps_before_recording -= 1;
                false
            }
            Stage::Shaped => true,
        };
        let active = ActiveStepGraph {
            rows: graph.rows,
            ids: graph.ids.device_ptr(&self.stream).0,
            positions: graph.positions.device_ptr(&self.stream).0,
            pool: Arc::clone(&graph.pool),
            recording,
        };
        if recording {
            // Relaxed: other threads (expert fills, the gateway's calls) may use the driver
            // meanwhile; this thread's ops never wait while recording.
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(driver_error("starting to record a step graph"))?;
            self.capture_watch.start();
        }
        graph.recording = recording;
        self.set_active_step_graph(Some(active))?;
        Ok(StepGraphRun::RunOps)
    }

    pub(super) fn finish_step_graph(
        &self,
        graph: &mut CudaStepGraph,
        ops_succeeded: bool,
    ) -> Result<StepGraphEnd, CudaError> {
        let recording = std::mem::take(&mut graph.recording);
        let broken_after = if recording {
            self.capture_watch.stop()
        } else {
            None
        };
        self.set_active_step_graph(None)?;
        if !recording {
            graph.stage = if ops_succeeded {
                Stage::Shaped
            } else {
                Stage::Abandoned
            };
            return Ok(StepGraphEnd::Ran);
        }
        if ops_succeeded {
            if let Some(census) = GraphCensus::of_capture(self.stream.cu_stream()) {
                tracing::info!(
                    "decode step graph of {} rows recorded: {census}",
                    graph.rows
                );
            }
        }
        // Always end the capture, so the stream leaves capture mode whatever happened.
        let ended = self
            .stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        let capture_broke = broken_after.is_some()
            || matches!(
                &ended,
                Err(DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED))
            );
        let recorded = match ended {
            Ok(Some(recorded)) if ops_succeeded => recorded,
            ended => {
                if let Err(error) = &ended {
                    tracing::debug!(
                        "a decode step's recording ended with {}",
                        super::describe(error)
                    );
                }
                let capture_broken_after = broken_capture(broken_after);
                if capture_broke {
                    // Nothing ran; the graph keeps its shape and records again later.
                    graph.broken_recordings += 1;
                    let wait = (1u32 << graph.broken_recordings.min(6)) - 1;
                    graph.steps_before_recording = wait.min(MOST_STEPS_BETWEEN_RECORDINGS);
                    return Ok(StepGraphEnd::Interrupted {
                        capture_broken_after,
                    });
                }
                graph.stage = Stage::Abandoned;
                return Ok(StepGraphEnd::Abandoned {
                    capture_broken_after,
                });
            }
        };
        recorded
            .launch()
            .map_err(driver_error("launching a step graph"))?;
        graph.stage = Stage::Recorded(recorded);
        Ok(StepGraphEnd::Recorded)
    }
}
