//! The scheduler's counters the status RPC reports: sequences running, tokens in and out, KV in
//! use, and the MTP drafts' acceptance per depth.
//!
//! Owns: the counters and the speculation summary logged at shutdown. Must not touch: the
//! scheduling decisions that feed them.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::limits::MAX_DRAFT_TOKENS;
use crate::prefix_cache::PrefixCacheCounters;

/// Counters the status RPC reports.
#[derive(Default)]
pub struct SchedulerCounters {
    /// The prefix cache's counters (all zero while it is off).
    pub prefix_cache: Arc<PrefixCacheCounters>,
    pub running: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub kv_used_tokens: AtomicU64,
    /// Verification steps of sequences that drafted, probes included.
    pub speculative_steps: AtomicU64,
    /// Probes (one draft checked against the pending token's row; counted at depth 1 too) and
    /// those whose draft was accepted (each yields one token, not two).
    pub probes: AtomicU64,
    pub accepted_probes: AtomicU64,
    /// `drafted_at_depth[j]`: drafts made at depth `j + 1` of a chain.
    pub drafted_at_depth: [AtomicU64; MAX_DRAFT_TOKENS],
    /// `accepted_at_depth[j]`: chains whose drafts `1..=j + 1` were all accepted.
    pub accepted_at_depth: [AtomicU64; MAX_DRAFT_TOKENS],
}

impl SchedulerCounters {
    /// Counts one verification of `drafted` drafts whose first `accepted` were accepted.
    pub fn record_verification(&self, drafted: usize, accepted: usize) {
        self.speculative_steps.fetch_add(1, Ordering::Relaxed);
        for depth in 0..drafted.min(MAX_DRAFT_TOKENS) {
            self.drafted_at_depth[depth].fetch_add(1, Ordering::Relaxed);
            if depth < accepted {
                self.accepted_at_depth[depth].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Counts one probe ([`DraftPlan::Probe`](crate::model::DraftPlan::Probe)), accepted or not.
    pub fn record_probe(&self, accepted: bool) {
        self.record_verification(1, usize::from(accepted));
        self.probes.fetch_add(1, Ordering::Relaxed);
        self.accepted_probes
            .fetch_add(u64::from(accepted), Ordering::Relaxed);
    }

    /// `(drafted, accepted)` over every depth.
    pub fn draft_totals(&self) -> (u64, u64) {
        let sum = |counters: &[AtomicU64]| {
            counters
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .sum::<u64>()
        };
        (sum(&self.drafted_at_depth), sum(&self.accepted_at_depth))
    }

    /// Logs the drafts' acceptance overall and per depth (nothing when no sequence drafted).
    pub fn log_speculation_summary(&self) {
        let (drafted, accepted) = self.draft_totals();
        let steps = self.speculative_steps.load(Ordering::Relaxed);
        let (probes, accepted_probes) = (
            self.probes.load(Ordering::Relaxed),
            self.accepted_probes.load(Ordering::Relaxed),
        );
        if drafted == 0 {
            return;
        }
        let per_depth: Vec<String> = self
            .drafted_at_depth
            .iter()
            .zip(&self.accepted_at_depth)
            .map(|(d, a)| (d.load(Ordering::Relaxed), a.load(Ordering::Relaxed)))
            .take_while(|&(d, _)| d > 0)
            .map(|(d, a)| format!("{:.1}%", 100.0 * a as f64 / d as f64))
            .collect();
        tracing::info!(
            drafted,
            accepted,
            acceptance = format!("{:.1}%", 100.0 * accepted as f64 / drafted as f64),
            acceptance_per_depth = per_depth.join(" "),
            probes,
            // An accepted probe's draft is its step's one token.
            tokens_per_speculative_step = format!(
                "{:.2}",
                (steps + accepted - accepted_probes.min(accepted)) as f64 / steps.max(1) as f64
            ),
            "MTP speculative decoding"
        );
    }
}
