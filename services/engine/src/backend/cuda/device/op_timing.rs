//! `NINFER_CUDA_OP_TIMING=FILE`: where a forward's time goes, op by op.
//!
//! With the variable set, every backend op is followed by a stream synchronisation and its wall
//! time (launch + GPU execution + the synchronisation) is added to its row; the time between
//! two ops (the model's host code, the expert executor, sampling) gets a row of its own. The
//! table is rewritten to FILE (temp file, then rename) every 200 ms. It slows everything
//! down and is for finding a bottleneck, never for quoting speeds.
//!
//! `NINFER_CUDA_OP_TIMING_MODE=host` leaves the synchronisations out: each row is then the host
//! time spent inside the op (allocations, launches, copies the driver makes synchronous), the
//! overhead a decode step pays before the GPU does any work.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

// Often enough that a run of a second or two leaves a table (the bench kills the engine).
const WRITE_EVERY: Duration = Duration::from_millis(200);
const BETWEEN_OPS: &str = "(host, between ops)";

pub(crate) struct OpTiming {
    path: PathBuf,
    pub(super) synchronise: bool,
    state: Mutex<TimingState>,
}

struct TimingState {
    rows: HashMap<String, (u64, u64)>,
    last_op_end: Option<Instant>,
    last_write: Instant,
}

impl OpTiming {
    pub(crate) fn from_env() -> Option<OpTiming> {
        let path = std::env::var_os("NINFER_CUDA_OP_TIMING")?;
        tracing::warn!(
            file = %PathBuf::from(&path).display(),
            "NINFER_CUDA_OP_TIMING: every op synchronises the GPU (slow; for profiling only)"
        );
        let synchronise =
            std::env::var("NINFER_CUDA_OP_TIMING_MODE").map_or(true, |mode| mode != "host");
        Some(OpTiming {
            path: path.into(),
            synchronise,
            state: Mutex::new(TimingState {
                rows: HashMap::new(),
                last_op_end: None,
                last_write: Instant::now(),
            }),
        })
    }

    pub(super) fn begin(&self) -> Instant {
        let now = Instant::now();
        if let Ok(mut state) = self.state.lock() {
            if let Some(end) = state.last_op_end.take() {
                // Gaps longer than a second are idle time between requests, not host work.
                let gap = now.duration_since(end);
                if gap < Duration::from_secs(1) {
                    add(&mut state.rows, BETWEEN_OPS, gap);
                }
            }
        }
        now
    }

    pub(super) fn end(&self, name: &str, start: Instant) {
        let now = Instant::now();
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        add(&mut state.rows, name, now.duration_since(start));
        state.last_op_end = Some(now);
        if now.duration_since(state.last_write) >= WRITE_EVERY {
            state.last_write = now;
            let table = render(&state.rows);
            let temporary = self.path.with_extension("tmp");
            if std::fs::write(&temporary, table).is_ok() {
                let _ = std::fs::rename(&temporary, &self.path);
            }
        }
    }
}

fn add(rows: &mut HashMap<String, (u64, u64)>, name: &str, elapsed: Duration) {
    let row = rows.entry(name.to_string()).or_insert((0, 0));
    row.0 += 1;
    row.1 += u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
}

fn render(rows: &HashMap<String, (u64, u64)>) -> String {
    let mut sorted: Vec<_> = rows.iter().collect();
    sorted.sort_by_key(|(_, (_, nanos))| std::cmp::Reverse(*nanos));
    let total: u64 = rows.values().map(|row| row.1).sum();
    let mut text = format!(
        "{:<56} {:>10} {:>12} {:>10} {:>6}\n",
        "op", "calls", "total ms", "mean µs", "share"
    );
    for (name, (calls, nanos)) in sorted {
        text += &format!(
            "{:<56} {:>10} {:>12.1} {:>10.1} {:>5.1}%\n",
            name,
            calls,
            *nanos as f64 / 1e6,
            *nanos as f64 / 1e3 / (*calls).max(1) as f64,
            100.0 * *nanos as f64 / total.max(1) as f64
        );
    }
    text
}
