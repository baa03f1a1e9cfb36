//! Always-on profile counters of the forward pass, for `ninfer bench MODEL`.
//!
//! Owns: the counters (per phase: prefill/mixed forwards and pure decode forwards), the tally a
//! forward keeps in plain integers while it runs, and snapshots with an optional reset.
//! Must not touch: what is measured (the model times its own steps), transport (the gRPC layer
//! turns a snapshot into `EngineProfile`).
//!
//! Cost: a forward adds its tally to the shared atomics once, at its end; a MoE layer call adds a
//! few `Instant::now()` reads and a distinct-expert count over a stack bitset.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::backend::ExpertSlotTable;

/// Which counters a forward goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Some sequence of the batch added more than one token (prompt processing, mixed batches).
    Prefill,
    /// Every sequence of the batch added exactly one token.
    Decode,
}

/// Totals of one phase (or the tally of one forward while it runs).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PhaseTotals {
    pub forwards: u64,
    /// New tokens over all sequences of the batches.
    pub tokens: u64,
    /// Wall time of the forwards, from the embedding to the logits on the host.
    pub forward_nanos: u64,
    /// Time blocked in `ExpertExecutor::compute` (CPU experts, including any channel).
    pub expert_wait_nanos: u64,
    /// The part of `expert_wait_nanos` the experts were computing: as the workers report it,
    /// or all of it for in-process executors (then there is no channel time).
    pub expert_compute_nanos: u64,
    /// Host ↔ device copies of the MoE layers: the download of the MoE input and the upload of
    /// the CPU experts' sum. On a GPU the download first waits for the work queued before it,
    /// so this includes that wait (see `docs/BENCHMARKS.md`).
    pub transfer_nanos: u64,
    pub moe_layer_calls: u64,
    /// Distinct experts computed on the CPU side, summed over MoE layer calls.
    pub cpu_experts: u64,
    /// Distinct experts computed from the backend's resident slots, summed over layer calls.
    pub resident_experts: u64,
    /// `cpu_experts` × each layer's bank stride: expert weight bytes read from RAM (once per
    /// expert per layer call).
    pub cpu_expert_bytes: u64,
    /// `resident_experts` × bank stride: expert bytes read from the backend's memory.
    pub resident_expert_bytes: u64,
    /// Experts copied into the staging slots by layerwise prefill, summed over layer calls,
    /// and their bytes (what crossed the host-to-device link for them).
    pub streamed_experts: u64,
    pub streamed_expert_bytes: u64,
}

const FIELDS: usize = 13;

impl PhaseTotals {
    fn to_array(self) -> [u64; FIELDS] {
        [
            self.forwards,
            self.tokens,
            self.forward_nanos,
            self.expert_wait_nanos,
            self.expert_compute_nanos,
            self.transfer_nanos,
            self.moe_layer_calls,
            self.cpu_experts,
            self.resident_experts,
            self.cpu_expert_bytes,
            self.resident_expert_bytes,
            self.streamed_experts,
            self.streamed_expert_bytes,
        ]
    }

    fn from_array(values: [u64; FIELDS]) -> Self {
        let [forwards, tokens, forward_nanos, expert_wait_nanos, expert_compute_nanos, transfer_nanos, moe_layer_calls, cpu_experts, resident_experts, cpu_expert_bytes, resident_expert_bytes, streamed_experts, streamed_expert_bytes] =
            values;
        PhaseTotals {
            forwards,
            tokens,
            forward_nanos,
            expert_wait_nanos,
            expert_compute_nanos,
            transfer_nanos,
            moe_layer_calls,
            cpu_experts,
            resident_experts,
            cpu_expert_bytes,
            resident_expert_bytes,
            streamed_experts,
            streamed_expert_bytes,
        }
    }
}

/// Nanoseconds of a duration, saturating.
pub fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

#[derive(Default)]
struct PhaseCounters([AtomicU64; FIELDS]);

impl PhaseCounters {
    fn add(&self, totals: &PhaseTotals) {
        for (counter, value) in self.0.iter().zip(totals.to_array()) {
            if value != 0 {
                counter.fetch_add(value, Ordering::Relaxed);
            }
        }
    }

    fn read(&self, reset: bool) -> PhaseTotals {
        let mut values = [0u64; FIELDS];
        for (value, counter) in values.iter_mut().zip(&self.0) {
            *value = if reset {
                counter.swap(0, Ordering::Relaxed)
            } else {
                counter.load(Ordering::Relaxed)
            };
        }
        PhaseTotals::from_array(values)
    }
}

/// A snapshot of the counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ProfileSnapshot {
    pub prefill: PhaseTotals,
    pub decode: PhaseTotals,
    /// Bytes of the non-expert weights one forward reads, as stored in the artifact: every
    /// dense tensor (attention, norms, routers, shared experts, the output head) and the
    /// embedding table only where it doubles as the head (its lookups read a few rows).
    pub dense_weight_bytes_per_forward: u64,
    /// Whether the expert executor reports its compute time apart from its waiting.
    pub expert_compute_reported: bool,
}

/// The model's counters; shared (`Arc`) with whoever reports them.
#[derive(Default)]
pub struct ForwardProfile {
    prefill: PhaseCounters,
    decode: PhaseCounters,
    dense_weight_bytes_per_forward: u64,
    expert_compute_reported: AtomicBool,
}

impl ForwardProfile {
    pub fn new(dense_weight_bytes_per_forward: u64) -> Self {
        ForwardProfile {
            dense_weight_bytes_per_forward,
            ..Default::default()
        }
    }

    /// Adds one forward's tally.
    pub fn record(&self, phase: Phase, tally: &PhaseTotals) {
        match phase {
            Phase::Prefill => self.prefill.add(tally),
            Phase::Decode => self.decode.add(tally),
        }
    }

    pub(crate) fn note_compute_reported(&self) {
        self.expert_compute_reported.store(true, Ordering::Relaxed);
    }

    /// The counters since start or the last reset; `reset` zeroes them (each counter is read
    /// and zeroed atomically, so nothing recorded meanwhile is lost).
    pub fn snapshot(&self, reset: bool) -> ProfileSnapshot {
        ProfileSnapshot {
            prefill: self.prefill.read(reset),
            decode: self.decode.read(reset),
            dense_weight_bytes_per_forward: self.dense_weight_bytes_per_forward,
            expert_compute_reported: self.expert_compute_reported.load(Ordering::Relaxed),
        }
    }
}

/// Distinct experts among `ids` (`NO_EXPERT` and out-of-range ids skipped): `(elsewhere,
/// resident)`, where `resident` says which experts are in the backend's slots.
pub fn distinct_experts(
    ids: &[u32],
    resident: Option<&ExpertSlotTable>,
    num_experts: usize,
) -> (u64, u64) {
    // A stack bitset covers every released model (≤ 1024 experts per layer); larger ones
    // allocate.
    const WORDS: usize = 16;
    let mut on_stack = [0u64; WORDS];
    let mut on_heap;
    let seen: &mut [u64] = if num_experts <= WORDS * 64 {
        &mut on_stack[..num_experts.div_ceil(64)]
    } else {
        on_heap = vec![0u64; num_experts.div_ceil(64)];
        &mut on_heap
    };
    let (mut elsewhere, mut in_slots) = (0, 0);
    for &id in ids {
        let expert = id as usize;
        if expert >= num_experts {
            continue;
        }
        let (word, bit) = (expert / 64, 1u64 << (expert % 64));
        if seen[word] & bit != 0 {
            continue;
        }
        seen[word] |= bit;
        if resident.is_some_and(|table| table.is_resident(expert)) {
            in_slots += 1;
        } else {
            elsewhere += 1;
        }
    }
    (elsewhere, in_slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_experts_split_by_residence() {
        let ids = [3, 1, 3, u32::MAX, 7, 1, 99];
        assert_eq!(distinct_experts(&ids, None, 8), (3, 0));
        let mut resident = ExpertSlotTable::new(8, 2);
        resident.assign(0, 7).unwrap();
        resident.assign(1, 1).unwrap();
        assert_eq!(distinct_experts(&ids, Some(&resident), 8), (1, 2));
        let many: Vec<u32> = (0..2000).chain(0..2000).collect();
        assert_eq!(distinct_experts(&many, None, 1500), (1500, 0));
    }

    #[test]
    fn snapshot_adds_phases_apart_and_reset_zeroes() {
        let profile = ForwardProfile::new(10);
        let tally = PhaseTotals {
            forwards: 1,
            tokens: 4,
            cpu_expert_bytes: 100,
            ..Default::default()
        };
        profile.record(Phase::Prefill, &tally);
        profile.record(Phase::Decode, &tally);
        profile.record(Phase::Decode, &tally);
        let snapshot = profile.snapshot(true);
        assert_eq!(snapshot.prefill.tokens, 4);
        assert_eq!(snapshot.decode.tokens, 8);
        assert_eq!(snapshot.decode.cpu_expert_bytes, 200);
        assert_eq!(snapshot.dense_weight_bytes_per_forward, 10);
        assert_eq!(profile.snapshot(false).decode, PhaseTotals::default());
    }
}
