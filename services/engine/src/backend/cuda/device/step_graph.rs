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
//! **A model split over pipeline stages** records one graph for the whole step: the first
//! stage's graph begins the capture on its stream, and each later stage (its own graph lending
//! its inputs and buffer pool, `Followers`) joins it by waiting for an event recorded in the
//! capture, then copies the step's ids and positions into its own inputs; the crossings order
//! the streams both ways as op by op (device/stage_crossing.rs), and before the capture ends
//! every later stage's stream is joined back into the first's (else the capture ends
//! "unjoined"). A replay is one launch on the first stage's stream, after it waited for the
//! later stages' earlier work. A later stage that cannot join, or a recording the driver refuses
//! or cannot launch, abandons the graph: nothing ran, and the batch goes on op by op.
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
use cudarc::driver::{CudaGraph, CudaSlice, DevicePtr, DevicePtrMut, DriverError};

use super::graph_census::GraphCensus;
use super::tensor_pool::{RecyclePool, TensorPool};
use super::{driver_error, wait_for_stream, ActiveStepGraph, CudaBackend};
use crate::backend::cuda::CudaError;
use crate::backend::{Backend, FollowingStepGraph, StepGraphEnd, StepGraphRun};

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

/// A graph's step that spans later pipeline stages (`followers`): the first stage's graph
/// (`CudaStepGraph` above) records and replays; each later stage's own graph lends the step its
/// inputs and its buffer pool and nothing else (its `stage` stays `New`).
type Followers<'f, 'a> = &'f mut [FollowingStepGraph<'a, CudaBackend>];

/// A recording whose capture broke (an op of the step, or a call the relaxed capture mode still
/// refuses) is tried again, ever less often while it keeps breaking, at most this many steps
/// apart.
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

/// Where the capture broke, in words, when a watch saw it (`broken_after`: the op, quoted, and
/// on a later stage of a split step, which).
fn broken_capture(broken_after: Option<String>) -> Option<String> {
    broken_after.map(|op| {
        format!(
            "the capture was no longer active after {op} (it, or something between it and the \
             op before, broke it)"
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
        followers: Followers<'_, '_>,
        ids: &[u32],
        positions: &[usize],
    ) -> Result<StepGraphRun, CudaError> {
        if let Some(other) = followers.iter().find(|f| f.graph.rows != graph.rows) {
            return Err(CudaError::Invalid {
                problem: format!(
                    "a step graph of {} rows followed by a later stage's of {}",
                    graph.rows, other.graph.rows
                ),
            });
        }
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
        // The step (its inputs' upload, then its replay, or its ops and their recording's one
        // launch) comes after what the later stages queued before it: the graph's nodes on
        // their streams are ordered by this stream alone.
        for follower in followers.iter() {
            wait_for_stream(&self.stream, &follower.backend.stream).map_err(driver_error(
                "ordering a step graph after a later stage's work",
            ))?;
        }
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
                self.order_followers_after_graph(followers)?;
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
        if let Err(error) = self.start_followers(graph, followers) {
            // Nothing ran: the recording (if one began) is dropped with the graph.
            self.drop_split_step(graph, followers);
            return Err(error);
        }
        Ok(StepGraphRun::RunOps)
    }

    /// Each later stage's part of a step whose ops run now: its stream ordered after this one
    /// (under capture: joined to the recording), the step's ids and positions copied into its
    /// graph's inputs (its kernels read them there, on its own card), and its graph active, so
    /// its ops draw their outputs from its graph's pool.
    fn start_followers(
        &self,
        graph: &CudaStepGraph,
        followers: Followers<'_, '_>,
    ) -> Result<(), CudaError> {
        let recording = graph.recording;
        for follower in followers.iter_mut() {
            let later = follower.backend;
            wait_for_stream(&later.stream, &self.stream)
                .map_err(driver_error("a later stage joining the step"))?;
            // From here the stage is in the capture (if one is under way): a failure below
            // joins it back before the capture is dropped.
            follower.graph.recording = recording;
            let bytes = graph.rows.max(1) * std::mem::size_of::<u32>();
            let inputs = [
                (&graph.ids, &mut follower.graph.ids),
                (&graph.positions, &mut follower.graph.positions),
            ];
            for (from, to) in inputs {
                let (source, _) = from.device_ptr(&self.stream);
                let (destination, _) = to.device_ptr_mut(&later.stream);
                // SAFETY: both hold `rows` u32 (each graph's inputs, kept while the graph lives,
                // which the model keeps past any queued replay); the later stream waits above for
                // this one, which queued the inputs' upload.
                unsafe { self.copy_to_stage(later, source, destination, bytes)? };
            }
            later.set_active_step_graph(Some(ActiveStepGraph {
                rows: follower.graph.rows,
                ids: follower.graph.ids.device_ptr(&later.stream).0,
                positions: follower.graph.positions.device_ptr(&later.stream).0,
                pool: Arc::clone(&follower.graph.pool),
                recording,
            }))?;
            if recording {
                later.capture_watch.start();
            }
        }
        Ok(())
    }

    /// After a failure inside [`CudaBackend::start_step_graph`] of a split step: no graph
    /// active, no watch running, the capture (if one began) ended and dropped, and the graph not
    /// used again (the model runs the step op by op).
    fn drop_split_step(&self, graph: &mut CudaStepGraph, followers: Followers<'_, '_>) {
        let recording = std::mem::take(&mut graph.recording);
        for follower in followers.iter_mut() {
            if std::mem::take(&mut follower.graph.recording) {
                follower.backend.capture_watch.stop();
                // A stream that joined the capture must be joined back for it to end.
                let _ = wait_for_stream(&self.stream, &follower.backend.stream);
            }
            let _ = follower.backend.set_active_step_graph(None);
        }
        let _ = self.set_active_step_graph(None);
        if recording {
            self.capture_watch.stop();
            let _ = self.stream.end_capture(
                CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            );
        }
        graph.stage = Stage::Abandoned;
    }

    /// Ends each later stage's part of the step: its watch stopped, its graph no longer active,
    /// and while recording its stream joined back into this one, which ending the capture
    /// requires. Returns, while recording, each later stage's break (the op after which its
    /// watch saw the capture broken, if it did) with its backend's name, and the first failure
    /// to join back.
    fn finish_followers(
        &self,
        followers: Followers<'_, '_>,
        recording: bool,
    ) -> (Vec<(Option<String>, String)>, Option<String>) {
        let (mut breaks, mut unjoined) = (Vec::new(), None);
        for (index, follower) in followers.iter_mut().enumerate() {
            let later = follower.backend;
            let stage = index + 1;
            follower.graph.recording = false;
            if recording {
                breaks.push((later.capture_watch.stop(), later.name()));
                let joined = wait_for_stream(&self.stream, &later.stream);
                // A capture something else broke ends as interrupted, whatever its joins did.
                if let Err(error) = unless_invalidated(joined) {
                    unjoined.get_or_insert(format!(
                        "stage {stage}'s stream could not join the recording back: {}",
                        super::describe(&error)
                    ));
                }
            }
            if let Err(error) = later.set_active_step_graph(None) {
                unjoined.get_or_insert(error.to_string());
            }
        }
        (breaks, unjoined)
    }

    pub(super) fn finish_step_graph(
        &self,
        graph: &mut CudaStepGraph,
        followers: Followers<'_, '_>,
        ops_succeeded: bool,
    ) -> Result<StepGraphEnd, CudaError> {
        let recording = std::mem::take(&mut graph.recording);
        // The later stages first: their streams must be back in this one before the capture ends.
        let (later_breaks, unjoined) = self.finish_followers(followers, recording);
        let broken_after = match recording {
            true => {
                let here = (self.capture_watch.stop(), self.name());
                first_break(std::iter::once(here).chain(later_breaks).collect())
            }
            false => None,
        };
        self.set_active_step_graph(None)?;
        if !recording {
            if let Some(problem) = unjoined {
                return Err(CudaError::Invalid { problem });
            }
            graph.stage = if ops_succeeded {
                Stage::Shaped
            } else {
                Stage::Abandoned
            };
            return Ok(StepGraphEnd::Ran);
        }
        let ops_succeeded = ops_succeeded && unjoined.is_none();
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
                if capture_broke && unjoined.is_none() {
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
                    capture_broken_after: join_reasons(capture_broken_after, unjoined),
                });
            }
        };
        if let Err(error) = recorded.launch() {
            if followers.is_empty() {
                return Err(driver_error("launching a step graph")(error));
            }
            // A graph over several stages' streams (and maybe cards) is one the driver may
            // refuse only at its launch; nothing ran, so the batch goes on op by op.
            graph.stage = Stage::Abandoned;
            return Ok(StepGraphEnd::Abandoned {
                capture_broken_after: Some(format!(
                    "launching the step recorded over {} stages failed: {}",
                    followers.len() + 1,
                    super::describe(&error)
                )),
            });
        }
        self.order_followers_after_graph(followers)?;
        graph.stage = Stage::Recorded(recorded);
        Ok(StepGraphEnd::Recorded)
    }

    /// Each later stage's stream ordered after the graph just launched on this one: the graph's
    /// nodes on a later stage's card run in this stream's order, so what that stage queues next
    /// (the logits' copy, the next step's ops) would otherwise race them.
    fn order_followers_after_graph(
        &self,
        followers: &[FollowingStepGraph<'_, CudaBackend>],
    ) -> Result<(), CudaError> {
        for follower in followers {
            wait_for_stream(&follower.backend.stream, &self.stream).map_err(driver_error(
                "ordering a later stage after a step graph's launch",
            ))?;
        }
        Ok(())
    }
}

/// Where a step's capture first broke, by stage order (each stage's ops ran after the stage
/// before's): per stage, the op after which its watch saw the capture broken (if it did) and
/// its backend's name; a later stage is named.
fn first_break(stages: Vec<(Option<String>, String)>) -> Option<String> {
    stages
        .into_iter()
        .enumerate()
        .find_map(|(stage, (op, name))| {
            op.map(|op| match stage {
                0 => format!("`{op}`"),
                _ => format!("`{op}` on stage {stage} ({name})"),
            })
        })
}

/// Both reasons, or the one there is.
fn join_reasons(first: Option<String>, second: Option<String>) -> Option<String> {
    match (first, second) {
        (Some(first), Some(second)) => Some(format!("{first}; {second}")),
        (first, second) => first.or(second),
    }
}

/// A wait's failure, unless it failed because the capture was already broken.
fn unless_invalidated(result: Result<(), DriverError>) -> Result<(), DriverError> {
    match result {
        Err(DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)) => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stages(breaks: &[Option<&str>]) -> Vec<(Option<String>, String)> {
        breaks
            .iter()
            .enumerate()
            .map(|(stage, op)| (op.map(str::to_string), format!("cuda:{stage}")))
            .collect()
    }

    #[test]
    fn the_first_stage_that_saw_the_capture_broken_is_named() {
        assert_eq!(first_break(stages(&[None, None, None])), None);
        // One stage (unsplit): the op alone, as before stages.
        assert_eq!(
            first_break(stages(&[Some("matmul")])).as_deref(),
            Some("`matmul`")
        );
        // The first stage's ops ran before the later stages': its break comes first.
        assert_eq!(
            first_break(stages(&[Some("rope"), Some("matmul"), None])).as_deref(),
            Some("`rope`")
        );
        assert_eq!(
            first_break(stages(&[None, None, Some("add_rms_norm")])).as_deref(),
            Some("`add_rms_norm` on stage 2 (cuda:2)")
        );
        assert_eq!(
            first_break(stages(&[None, Some("embed"), Some("matmul")])).as_deref(),
            Some("`embed` on stage 1 (cuda:1)")
        );
    }

    #[test]
    fn reasons_join_and_a_broken_capture_is_no_failure_to_join() {
        let text = |s: &str| Some(s.to_string());
        assert_eq!(join_reasons(None, None), None);
        assert_eq!(join_reasons(text("a"), None), text("a"));
        assert_eq!(join_reasons(None, text("b")), text("b"));
        assert_eq!(join_reasons(text("a"), text("b")), text("a; b"));
        let invalidated = DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        let unjoined = DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
        assert!(unless_invalidated(Err(invalidated)).is_ok());
        assert!(unless_invalidated(Ok(())).is_ok());
        assert!(matches!(
            unless_invalidated(Err(unjoined)),
            Err(DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED))
        ));
    }
}
