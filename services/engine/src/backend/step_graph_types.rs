//! The types of the step graph calls of [`Backend`](super::Backend): what a begun step asks of
//! the caller, how its ops went, and a later pipeline stage's part of a step that spans stages.
//!
//! Owns: those types. Must not touch: how a backend records or replays.

/// What [`Backend::begin_step_graph`] asks of the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepGraphRun {
    /// The recorded step is queued: the step's outputs are the graph's.
    Replayed,
    /// Run the step's ops now, then call [`Backend::end_step_graph`].
    RunOps,
}

/// How the ops run between [`Backend::begin_step_graph`] and [`Backend::end_step_graph`] went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepGraphEnd {
    /// They ran as usual (in the graph's shape, so the next step can record them).
    Ran,
    /// They were recorded, and the recording was queued once: the step ran, and the outputs
    /// the ops returned are the graph's (kept by the caller for the replays).
    Recorded,
    /// Something broke the recording's capture (one of its ops, or a call the capture mode
    /// refuses): nothing ran; the graph records again later.
    Interrupted {
        /// Where the backend saw the capture break, when it knows.
        capture_broken_after: Option<String>,
    },
    /// Recording failed or an op failed: nothing ran, the graph will not be used again.
    Abandoned {
        /// Where the backend saw the recording break, when it knows (the op that later fails
        /// may only report its effect).
        capture_broken_after: Option<String>,
    },
}

/// A later pipeline stage's part of a decode step through a step graph of a split model
/// ([`Backend::begin_split_step_graph`](super::Backend::begin_split_step_graph)): the stage's
/// backend and its own graph (from its own `new_step_graph`), whose buffers hold the tensors of
/// its layers, so that they keep their addresses from one replay to the next.
pub struct FollowingStepGraph<'a, B: super::Backend> {
    pub backend: &'a B,
    pub graph: &'a mut B::StepGraph,
}
