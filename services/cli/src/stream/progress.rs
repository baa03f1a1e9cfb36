//! The progress line of a streaming conversion: tensors written, bytes fetched and the rate,
//! cache use against its bound, and the time left; and the summary printed at the end.
//!
//! Owns: the wording and pacing of those lines on stderr.
//! Must not touch: the counters' meaning (`cache::FetchStats`), the conversion.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ninfer_convert::ConvertProgress;

use super::cache::FetchStats;

const MIB: f64 = (1u64 << 20) as f64;

/// Progress of one streaming conversion.
pub struct StreamProgress {
    stats: Arc<FetchStats>,
    bound: u64,
    total: AtomicU64,
    done: AtomicU64,
    last_line: Mutex<Option<Instant>>,
    terminal: bool,
}

impl StreamProgress {
    pub fn new(stats: Arc<FetchStats>, bound: u64) -> Self {
        StreamProgress {
            stats,
            bound,
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
            last_line: Mutex::new(None),
            terminal: std::io::stderr().is_terminal(),
        }
    }

    fn line(&self) -> String {
        let fetched = self.stats.fetched.load(Ordering::Relaxed);
        let planned = self.stats.planned.load(Ordering::Relaxed);
        let consumed = self.stats.consumed.load(Ordering::Relaxed);
        let seconds = self.stats.started.elapsed().as_secs_f64().max(1e-3);
        let rate = fetched as f64 / seconds;
        let left = planned.saturating_sub(consumed);
        let eta = if rate > 0.0 {
            format!("{:.0}s", left as f64 / rate)
        } else {
            "?".into()
        };
        format!(
            "{}/{} tensors, fetched {:.1} of {:.1} MiB at {:.1} MiB/s, cache {:.1} of {:.1} MiB, \
             about {eta} left",
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
            fetched as f64 / MIB,
            planned as f64 / MIB,
            rate / MIB,
            self.stats.cached.load(Ordering::Relaxed) as f64 / MIB,
            self.bound as f64 / MIB,
        )
    }

    /// The last progress line, ending the one a terminal rewrites.
    pub fn finish(&self) {
        let line = self.line();
        if self.terminal {
            eprintln!("\r{line}");
        } else {
            eprintln!("{line}");
        }
    }
}

impl ConvertProgress for StreamProgress {
    fn start(&self, total_tensors: u64) {
        self.total.store(total_tensors, Ordering::Relaxed);
    }

    fn tensor_written(&self, name: &str, _bytes: u64) {
        let tensors = if name.ends_with(".moe.experts") { 2 } else { 1 };
        self.done.fetch_add(tensors, Ordering::Relaxed);
        let Ok(mut last) = self.last_line.lock() else {
            return;
        };
        // A terminal line is redrawn twice a second; a log gets a line every ten seconds.
        let every = if self.terminal {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(10)
        };
        if last.is_some_and(|at| at.elapsed() < every) {
            return;
        }
        *last = Some(Instant::now());
        if self.terminal {
            eprint!("\r{}", self.line());
        } else {
            eprintln!("{}", self.line());
        }
    }

    fn note(&self, message: &str) {
        eprintln!("{}note: {message}", if self.terminal { "\n" } else { "" });
    }

    fn cancelled(&self) -> bool {
        crate::interrupt::interrupted()
    }
}
