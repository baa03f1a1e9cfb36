//! The time share between prompt work and decode steps while both exist: how long a long
//! prompt's next chunk waits so that the decoding streams keep their share of the wall time.
//!
//! Owns: the debt accounting ([`PrefillShare`]). Must not touch: which prompts are chunked
//! (`prompt_chunks.rs`), the forwards.

use std::time::Duration;

/// Debt of decode time below which [`PrefillShare`] counts it paid.
const PREFILL_SHARE_ROUNDING_SECONDS: f64 = 1e-6;

/// The time-share rule between prompt work and decode steps while both exist.
///
/// Prompt work (a prompt chunk's own forward, or a generation step that a prompt's rest
/// joins) that ran beside decoding sequences adds its wall time × `(1 − share) / share` to a
/// debt of decode time; each decode-only step pays its wall time off the debt, never below
/// zero. Prompt work may run only while nothing is owed, so the first chunk runs at once and
/// each later one waits until the decode steps since the last have taken `(1 − share) /
/// share` of its time: the cumulative rule `prompt time ≤ share / (1 − share) × decode time`
/// with no credit banked (decode time with no prompt waiting never pays for a later
/// prompt's chunks), overshooting by at most one decode step per chunk. With nothing
/// decoding there is nothing to protect and the debt is forgotten ([`PrefillShare::reset`]).
/// Share 1: no debt ever, a chunk every step.
#[derive(Debug, Clone)]
pub struct PrefillShare {
    /// Decode seconds owed per second of prompt work: `(1 − share) / share`.
    decode_per_prefill: f64,
    /// Decode seconds still owed before the next prompt work.
    owed: f64,
}

impl PrefillShare {
    /// `share` in (0, 1]; anything else is taken as 1 (flags are checked where parsed).
    pub fn new(share: f64) -> Self {
        let share = if share > 0.0 && share <= 1.0 {
            share
        } else {
            1.0
        };
        PrefillShare {
            decode_per_prefill: (1.0 - share) / share,
            owed: 0.0,
        }
    }

    /// Whether prompt work may run beside the decoding sequences now (a debt under a
    /// microsecond is rounding left by paying seconds off in floating point).
    pub fn may_prefill(&self) -> bool {
        self.owed <= PREFILL_SHARE_ROUNDING_SECONDS
    }

    /// Prompt work that took `took` beside decoding sequences.
    pub fn record_prefill(&mut self, took: Duration) {
        self.owed += took.as_secs_f64() * self.decode_per_prefill;
    }

    /// A decode-only step that took `took`.
    pub fn record_decode(&mut self, took: Duration) {
        self.owed = (self.owed - took.as_secs_f64()).max(0.0);
    }

    /// Nothing is decoding: what was owed is forgotten.
    pub fn reset(&mut self) {
        self.owed = 0.0;
    }

    /// Decode time still owed before the next prompt work.
    pub fn owed(&self) -> Duration {
        Duration::from_secs_f64(self.owed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(milliseconds: u64) -> Duration {
        Duration::from_millis(milliseconds)
    }

    /// Share 0.45: after a 300 ms chunk, prompts wait for 300 × 0.55 / 0.45 ≈ 366.7 ms of
    /// decode steps (five of 80 ms: four are 320 ms); the first chunk runs at once.
    #[test]
    fn prefill_share_waits_for_the_decode_time_a_chunk_owes() {
        let mut share = PrefillShare::new(0.45);
        assert!(share.may_prefill(), "the first chunk runs at once");
        share.record_prefill(ms(300));
        let owed = share.owed().as_secs_f64();
        assert!((owed - 0.3 * 0.55 / 0.45).abs() < 1e-9, "{owed}");
        let mut steps = 0;
        while !share.may_prefill() {
            share.record_decode(ms(80));
            steps += 1;
        }
        assert_eq!(steps, 5);
    }

    /// Over many chunk/decode cycles prompt work never takes more than its share of the time
    /// (decode steps overshoot by at most one step per chunk), at several shares and step
    /// sizes.
    #[test]
    fn prefill_share_holds_the_prompt_work_to_its_share() {
        for share_value in [0.1, 0.25, 0.45, 0.5, 0.8] {
            for (chunk, step) in [(300, 5), (600, 20), (40, 40), (10, 70)] {
                let mut share = PrefillShare::new(share_value);
                let (mut prefill, mut decode) = (0u64, 0u64);
                let mut chunks = 0;
                // Whole cycles (a chunk, then the decode steps that pay for it): the share
                // holds at every cycle's end, not in the middle of one.
                while chunks < 50 || !share.may_prefill() {
                    if share.may_prefill() {
                        share.record_prefill(ms(chunk));
                        prefill += chunk;
                        chunks += 1;
                    }
                    // A decode step follows every chunk (the scheduler's step).
                    share.record_decode(ms(step));
                    decode += step;
                }
                let fraction = prefill as f64 / (prefill + decode) as f64;
                assert!(
                    fraction <= share_value + 1e-9,
                    "share {share_value}, chunk {chunk} ms, step {step} ms: {fraction}"
                );
                // And not much less: the overshoot is under one decode step per chunk.
                let floor =
                    prefill as f64 / (prefill as f64 / share_value + (chunks * step) as f64);
                assert!(
                    fraction >= floor - 1e-9,
                    "share {share_value}, chunk {chunk} ms, step {step} ms: {fraction} < {floor}"
                );
            }
        }
    }

    /// Decode time with no prompt waiting is not banked: a chunk after a long solo decode
    /// still owes its decode time before the next one.
    #[test]
    fn prefill_share_banks_no_credit() {
        let mut share = PrefillShare::new(0.5);
        for _ in 0..1000 {
            share.record_decode(ms(10));
        }
        share.record_prefill(ms(100));
        assert!(!share.may_prefill());
        share.record_decode(ms(99));
        assert!(!share.may_prefill());
        share.record_decode(ms(1));
        assert!(share.may_prefill());
    }

    /// Share 1 never holds a prompt (a chunk every step); a reset (nothing decoding) forgets
    /// the debt; shares outside (0, 1] are taken as 1.
    #[test]
    fn prefill_share_of_one_never_waits_and_a_reset_forgets() {
        let mut share = PrefillShare::new(1.0);
        share.record_prefill(ms(10_000));
        assert!(share.may_prefill());
        for bad in [0.0, -1.0, 1.5, f64::NAN] {
            let mut share = PrefillShare::new(bad);
            share.record_prefill(ms(10_000));
            assert!(share.may_prefill(), "{bad}");
        }
        let mut share = PrefillShare::new(0.2);
        share.record_prefill(ms(10));
        assert!(!share.may_prefill());
        share.reset();
        assert!(share.may_prefill());
        assert_eq!(share.owed(), Duration::ZERO);
    }
}
