//! The expert kernels' tuning: one plain value the caller builds and hands to the layer
//! computation (through `LayerScratch`), never process-wide state.
//!
//! Owns: `KernelTuning` (work stealing, the shared decode input, phase 2's split, software
//! prefetch) and the parser of its scheduling words. Must not touch: environment variables or
//! command-line flags (programs read those at their edge and pass the value in).

use crate::KernelError;

/// How phase 2 (`down`) shares work among threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownSplit {
    /// Small batches (≤ 8 tokens per expert): (expert, 16-row block) items are split across
    /// threads, so each thread streams one long contiguous run of `down` rows; results go to a
    /// per-(expert, token) buffer and a fourth phase adds them into the output. Larger batches:
    /// `Rows`.
    Auto,
    /// Output rows split across threads, every thread visits every expert and accumulates into
    /// its own output columns directly.
    Rows,
}

/// Software prefetch of the weight streams by the streaming kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// Bytes ahead of the weight row being read; 0 leaves it to the hardware prefetchers.
    pub distance_bytes: usize,
    /// Prefetch into L2 (`prefetcht1`) rather than L1 (`prefetcht0`).
    pub into_l2: bool,
}

impl Default for Prefetch {
    /// 4096 bytes ahead, into L2: streamed 13–22% faster than none at decode (int4 and int8) on
    /// the 16-core Xeon of `docs/BENCHMARKS.md`.
    fn default() -> Self {
        Prefetch {
            distance_bytes: 4096,
            into_l2: true,
        }
    }
}

/// Scheduling and streaming choices of `compute_layer`. The default is what every program runs;
/// the other values exist for `ninfer bench experts` A/B runs and the agreement tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelTuning {
    /// A thread that has finished its share of a phase's work items takes unstarted items from
    /// the other threads' shares (one atomic counter per share), so a phase ends when the work
    /// does rather than when its slowest thread does.
    pub steal: bool,
    /// Batch of one token (decode): the token's input forms are prepared once (split across
    /// threads), not once per expert.
    pub shared_decode_input: bool,
    /// Phase 2's work split.
    pub down_split: DownSplit,
    /// Software prefetch of the weight streams.
    pub prefetch: Prefetch,
}

impl Default for KernelTuning {
    fn default() -> Self {
        KernelTuning {
            steal: true,
            shared_decode_input: true,
            down_split: DownSplit::Auto,
            prefetch: Prefetch::default(),
        }
    }
}

impl KernelTuning {
    /// The scheduling choices named by `text`, a comma-separated subset of `steal` and `shared`
    /// (or `none`): a named choice is on, an unnamed one off; `down_split` and `prefetch` keep
    /// their defaults.
    pub fn from_scheduling_words(text: &str) -> Result<KernelTuning, KernelError> {
        let mut tuning = KernelTuning {
            steal: false,
            shared_decode_input: false,
            ..KernelTuning::default()
        };
        for word in text.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            match word {
                "steal" => tuning.steal = true,
                "shared" => tuning.shared_decode_input = true,
                "none" => {}
                other => {
                    return Err(KernelError::Input(format!(
                        "unknown scheduling choice `{other}` (expected steal, shared, none)"
                    )))
                }
            }
        }
        Ok(tuning)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduling_words_name_the_choices_that_are_on() {
        let both = KernelTuning::from_scheduling_words("steal, shared").unwrap();
        assert_eq!(both, KernelTuning::default());
        let none = KernelTuning::from_scheduling_words("none").unwrap();
        assert!(!none.steal && !none.shared_decode_input);
        assert!(KernelTuning::from_scheduling_words("steal,ahead").is_err());
    }
}
