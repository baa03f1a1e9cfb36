//! When the engine pool polls an engine next: at the base interval while anything about the
//! engine changes, less and less often while it stays the same.
//!
//! Owns: [`PollSchedule`] and what counts as "the same" ([`SteadyState`]: readiness, the
//! reason for not being ready, the engine instance and its model files; counters that move
//! with every token do not count).
//! Must not touch: the RPCs themselves or what the pool does with their answers (that is
//! `engine_pool`).

use std::time::Duration;

use ninfer_protocol::v1::{EngineStatus, ModelInfo};

/// A steady engine is polled at most this many times less often than the base interval.
pub const STEADY_POLL_BACKOFF: u32 = 8;

/// What must stay equal between two polls for the engine to count as steady.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SteadyState {
    ready: bool,
    not_ready_reason: String,
    engine_instance_id: String,
    model_name: String,
    model_files_digest: String,
}

impl SteadyState {
    pub fn of(info: &ModelInfo, status: &EngineStatus) -> Self {
        SteadyState {
            ready: status.ready,
            not_ready_reason: status.not_ready_reason.clone(),
            engine_instance_id: info.engine_instance_id.clone(),
            model_name: info.model_name.clone(),
            model_files_digest: info.model_files_digest.clone(),
        }
    }
}

/// The wait before each next poll of one engine.
#[derive(Debug)]
pub struct PollSchedule {
    base: Duration,
    wait: Duration,
    last: Option<SteadyState>,
}

impl PollSchedule {
    pub fn new(base: Duration) -> Self {
        PollSchedule {
            base,
            wait: base,
            last: None,
        }
    }

    /// The wait after a poll that saw `observed` (`None`: the poll failed). A ready engine seen
    /// the same as last time waits twice as long as before, up to [`STEADY_POLL_BACKOFF`] times
    /// the base; anything else goes back to the base interval.
    pub fn after(&mut self, observed: Option<SteadyState>) -> Duration {
        let steady = observed
            .as_ref()
            .is_some_and(|state| state.ready && self.last.as_ref() == Some(state));
        self.wait = if steady {
            (self.wait * 2).min(self.base * STEADY_POLL_BACKOFF)
        } else {
            self.base
        };
        self.last = observed;
        self.wait
    }

    /// Something outside the polls suggests the engine changed (a request found it gone): the
    /// next wait is the base interval again.
    pub fn restart(&mut self) {
        self.wait = self.base;
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(ready: bool, instance: &str) -> SteadyState {
        SteadyState::of(
            &ModelInfo {
                model_name: "m".into(),
                engine_instance_id: instance.into(),
                ..Default::default()
            },
            &EngineStatus {
                ready,
                ..Default::default()
            },
        )
    }

    #[test]
    fn a_steady_ready_engine_is_polled_less_and_less_often_up_to_the_cap() {
        let base = Duration::from_millis(500);
        let mut schedule = PollSchedule::new(base);
        let waits: Vec<Duration> = (0..6)
            .map(|_| schedule.after(Some(state(true, "a"))))
            .collect();
        let millis: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(millis, [500, 1000, 2000, 4000, 4000, 4000]);
    }

    #[test]
    fn any_change_a_failure_or_not_being_ready_polls_at_the_base_interval() {
        let base = Duration::from_millis(500);
        let mut schedule = PollSchedule::new(base);
        schedule.after(Some(state(true, "a")));
        assert_eq!(schedule.after(Some(state(true, "a"))), base * 2);
        assert_eq!(schedule.after(Some(state(true, "b"))), base);
        assert_eq!(schedule.after(Some(state(true, "b"))), base * 2);
        assert_eq!(schedule.after(None), base);
        assert_eq!(schedule.after(Some(state(false, "b"))), base);
        assert_eq!(schedule.after(Some(state(false, "b"))), base);
        schedule.after(Some(state(true, "b")));
        assert_eq!(schedule.after(Some(state(true, "b"))), base * 2);
        schedule.restart();
        assert_eq!(schedule.after(Some(state(true, "b"))), base);
    }
}
