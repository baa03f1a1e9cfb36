//! Layerwise prefill: a big batch streams each MoE layer's experts from the page-locked banks
//! into double-buffered staging slots while the layer before computes, and the split of each
//! layer's experts between the backend (streamed) and the expert executor is chosen from
//! throughputs the engine measures at start.
//!
//! Owns: the measured throughputs ([`PrefillThroughputs`]), the rule that picks how many of a
//! layer's non-resident experts to stream ([`streamed_expert_count`]), and the per-forward
//! stream ([`LayerwiseStream`]): which layer's experts go into which half of the staging slots,
//! when each half's copy starts (right after the kernels of the layer that last used that half
//! are queued) and when it completes (just before the layer's own expert kernels).
//! Must not touch: the routing and the executor's part (`crate::moe::layer`), the copies
//! themselves (the backends' [`ExpertSlotFills`] batch fills), weight loading.

use std::sync::{Arc, Mutex};

use ninfer_artifact::{Artifact, ExpertBank, NO_EXPERT};

use crate::backend::{Backend, ExpertSlotFills, Routing};
use crate::error::EngineError;

/// What sees a layer's staging slots after its streamed experts computed and before the slots
/// are streamed into again: the slots and the (expert, staging slot) pairs of the streamed ones.
pub type BeforeStagingReuse<'f, B> =
    dyn FnMut(&<B as Backend>::ExpertSlots, &[(usize, usize)]) -> Result<(), EngineError> + 'f;

/// What the engine measured at start about computing routed experts at prefill.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct PrefillThroughputs {
    /// Expert bytes per second copied from the page-locked banks into staging slots (on a GPU
    /// the pinned host-to-device rate over PCIe).
    pub copy_bytes_per_second: f64,
    /// Routed (token, expert) pairs per second the backend computes from slots, for a batch of
    /// prefill size.
    pub backend_pairs_per_second: f64,
    /// Routed pairs per second the expert executor computes (the CPU workers, or the kernels
    /// in process); 0 when it could not be measured (then nothing is left to it).
    pub executor_pairs_per_second: f64,
    /// FLOPs of one pair (`6 · hidden · moe_intermediate`: gate, up and down), to state the
    /// pair rates as FLOP/s.
    pub flops_per_pair: f64,
}

impl PrefillThroughputs {
    /// Before anything is measured: streaming wins every layer (the executor's rate unknown).
    pub fn unmeasured(flops_per_pair: f64) -> Self {
        PrefillThroughputs {
            copy_bytes_per_second: 1.0,
            backend_pairs_per_second: 1.0,
            executor_pairs_per_second: 0.0,
            flops_per_pair,
        }
    }
}

/// One MoE layer call of a batch, as the streaming rule sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerBatch {
    pub tokens: usize,
    pub experts_per_token: usize,
    pub num_experts: usize,
    /// Experts of the layer not in its resident slots (the candidates for streaming).
    pub non_resident: usize,
    pub expert_bytes: usize,
    pub hidden_size: usize,
}

/// How a layer's non-resident experts are split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerSplit {
    /// All of them to the expert executor.
    Executor,
    /// Some streamed and computed on the backend, the rest to the executor at the same time.
    Mixed,
    /// All of them streamed and computed on the backend.
    Backend,
}

impl std::fmt::Display for LayerSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LayerSplit::Executor => "cpu",
            LayerSplit::Mixed => "mixed",
            LayerSplit::Backend => "layerwise-gpu",
        })
    }
}

impl LayerBatch {
    /// Routed pairs per expert under uniform routing (what a big batch of real text nears).
    fn pairs_per_expert(&self) -> f64 {
        (self.tokens * self.experts_per_token) as f64 / self.num_experts.max(1) as f64
    }

    /// Estimated seconds of the layer's non-resident experts with `streamed` of them streamed.
    /// The backend's side is, per streamed expert, its copy or its compute, whichever is longer
    /// (the copy of the next layer overlaps this layer's compute), plus the upload of the
    /// executor's sum, which shares the host-to-device direction with the copies; the
    /// executor's side is its compute after the batch's hidden states are read back. The two
    /// sides run at once.
    pub fn estimated_seconds(&self, throughputs: &PrefillThroughputs, streamed: usize) -> f64 {
        let streamed = streamed.min(self.non_resident);
        let link = throughputs.copy_bytes_per_second.max(1e-9);
        let pairs = self.pairs_per_expert();
        let copy = self.expert_bytes as f64 / link;
        let backend = pairs / throughputs.backend_pairs_per_second.max(1e-9);
        let left = self.non_resident - streamed;
        // One f32 row per token each way: the hidden states down, the executor's sum up.
        let activations = if left == 0 {
            0.0
        } else {
            (4 * self.tokens * self.hidden_size) as f64 / link
        };
        let backend_side = streamed as f64 * copy.max(backend) + activations;
        let executor_side = if left == 0 {
            0.0
        } else if throughputs.executor_pairs_per_second <= 0.0 {
            f64::INFINITY
        } else {
            left as f64 * pairs / throughputs.executor_pairs_per_second + activations
        };
        backend_side.max(executor_side)
    }
}

/// How many of a layer's non-resident experts to stream: the count with the smallest
/// [`LayerBatch::estimated_seconds`], the larger count on a tie, except that a count leaving
/// experts to the executor must beat streaming all of them by [`EXECUTOR_SHARE_MARGIN`]. A
/// streamed layer copies every expert it streams, routed or not, because its copy starts before
/// its routing is known; for a batch of `T` tokens with uniform routing an expert is left
/// unrouted with probability `(1 − k/E)^T` (below 0.1% from `T ≈ 7·E/k`: 110 tokens at 128
/// experts, top-8), so past the layerwise threshold almost no copied byte is wasted.
pub fn streamed_expert_count(throughputs: &PrefillThroughputs, batch: &LayerBatch) -> usize {
    let all = batch.non_resident;
    let all_seconds = batch.estimated_seconds(throughputs, all);
    let mut best = (all, all_seconds);
    for streamed in (0..all).rev() {
        let seconds = batch.estimated_seconds(throughputs, streamed);
        if seconds < best.1 {
            best = (streamed, seconds);
        }
    }
    if best.1 > all_seconds * (1.0 - EXECUTOR_SHARE_MARGIN) {
        return all;
    }
    best.0
}

/// The share of the estimated time a split that gives experts to the executor must save over
/// streaming them all. The executor's side is the least certain part of the estimate: its
/// start-up measurement runs alone, while at prefill it shares the RAM's bandwidth with the
/// copies and adds a read-back and a wait per layer. (Qwen3-Next-80B-A3B, int4, 4096 tokens on
/// an H200: a mixed split estimated 0.2% faster than streaming everything ran 6× slower.)
pub const EXECUTOR_SHARE_MARGIN: f64 = 0.1;

/// The split a streamed count means.
pub fn layer_split(streamed: usize, non_resident: usize) -> LayerSplit {
    match streamed {
        0 if non_resident > 0 => LayerSplit::Executor,
        count if count >= non_resident => LayerSplit::Backend,
        _ => LayerSplit::Mixed,
    }
}

/// One MoE layer of a layerwise forward: which of its experts are streamed.
pub(crate) struct LayerPlan<'a> {
    /// The layer's index in placement order (`MoeLayer::forward`'s `index`).
    pub layer: usize,
    pub bank: &'a ExpertBank,
    /// Streamed experts, ascending.
    pub streamed: Vec<usize>,
    /// Non-resident experts left to the executor (they exist: the executor has work).
    pub executor_experts: usize,
}

/// The streaming of one forward. Layer `p` of the plan (counting MoE layers only) uses half
/// `p % 2` of the staging slots; its copy starts once the kernels of layer `p − 2` (the last
/// user of that half) are queued, so on a GPU it runs on the copy stream while layers `p − 1`
/// and the attention before `p` compute, and layer `p`'s kernels wait for it on the GPU only.
pub(crate) struct LayerwiseStream<'a, B: Backend> {
    slots: &'a Mutex<B::ExpertSlots>,
    artifact: &'a Arc<Artifact>,
    plans: Vec<LayerPlan<'a>>,
    num_experts: usize,
    /// The next plan to compute and the next plan whose copy has not started.
    cursor: Mutex<(usize, usize)>,
}

impl<'a, B: Backend> LayerwiseStream<'a, B> {
    /// Starts the stream: completes anything a failed forward left in flight, then starts the
    /// copies of the first two layers.
    pub fn start(
        slots: &'a Mutex<B::ExpertSlots>,
        artifact: &'a Arc<Artifact>,
        plans: Vec<LayerPlan<'a>>,
        num_experts: usize,
    ) -> Result<Self, EngineError> {
        let stream: LayerwiseStream<'a, B> = LayerwiseStream {
            slots,
            artifact,
            plans,
            num_experts,
            cursor: Mutex::new((0, 0)),
        };
        {
            let mut slots: std::sync::MutexGuard<'a, B::ExpertSlots> = stream.lock_slots()?;
            if slots.fills_in_flight() > 0 {
                slots.complete_fills()?;
            }
            let mut cursor = stream.lock_cursor()?;
            while cursor.1 < 2.min(stream.plans.len()) {
                stream.prefetch(&mut slots, cursor.1)?;
                cursor.1 += 1;
            }
        }
        Ok(stream)
    }

    fn lock_slots(&self) -> Result<std::sync::MutexGuard<'a, B::ExpertSlots>, EngineError> {
        self.slots.lock().map_err(|_| EngineError::InvalidConfig {
            problem: "the prefill staging slots' lock is poisoned".into(),
        })
    }

    fn lock_cursor(&self) -> Result<std::sync::MutexGuard<'_, (usize, usize)>, EngineError> {
        self.cursor.lock().map_err(|_| EngineError::InvalidConfig {
            problem: "the layerwise stream's lock is poisoned".into(),
        })
    }

    /// The plan of MoE layer `layer`, if this forward streams it.
    pub fn plan(&self, layer: usize) -> Option<&LayerPlan<'a>> {
        self.plans.iter().find(|plan| plan.layer == layer)
    }

    /// Starts the copy of plan `position` into its half (nothing for a plan without streamed
    /// experts).
    fn prefetch(&self, slots: &mut B::ExpertSlots, position: usize) -> Result<(), EngineError> {
        let Some(plan) = self.plans.get(position) else {
            return Ok(());
        };
        if plan.streamed.is_empty() {
            return Ok(());
        }
        let first_slot = (position % 2) * self.num_experts;
        slots.start_batch_fill(first_slot, &plan.streamed, self.artifact, plan.bank)
    }

    /// The streamed experts of `layer` (the next plan: layers come in order) computed on the
    /// backend for the pairs of `routing` that chose them; `None` when no pair did. Then
    /// `before_reuse` sees the staging slots and the streamed experts' (expert, staging slot)
    /// pairs (the expert cache copies the ones it keeps from there), and the copy of the layer
    /// two plans on into the half this one used starts, queued after both.
    pub fn compute(
        &self,
        backend: &B,
        layer: usize,
        x: &B::Tensor,
        routing: &Routing,
        before_reuse: &mut BeforeStagingReuse<'_, B>,
    ) -> Result<Option<B::Tensor>, EngineError> {
        let mut cursor = self.lock_cursor()?;
        let position = cursor.0;
        let plan = self
            .plans
            .get(position)
            .filter(|plan| plan.layer == layer)
            .ok_or_else(|| EngineError::InvalidConfig {
                problem: format!(
                    "layerwise prefill: MoE layer {layer} came out of order (expected plan {position})"
                ),
            })?;
        let mut slots = self.lock_slots()?;
        let mut sum = None;
        if !plan.streamed.is_empty() {
            slots.complete_batch_fill()?;
            let mut streamed = vec![false; self.num_experts];
            for &expert in &plan.streamed {
                if let Some(flag) = streamed.get_mut(expert) {
                    *flag = true;
                }
            }
            // Only the streamed experts' pairs: an id whose expert is elsewhere (resident, left
            // to the executor, or of a stale table entry) adds nothing here.
            let expert_ids: Vec<u32> = routing
                .expert_ids
                .iter()
                .map(|&id| {
                    if streamed.get(id as usize).copied().unwrap_or(false) {
                        id
                    } else {
                        NO_EXPERT
                    }
                })
                .collect();
            if expert_ids.iter().any(|&id| id != NO_EXPERT) {
                let masked = Routing {
                    experts_per_token: routing.experts_per_token,
                    expert_ids,
                    weights: routing.weights.clone(),
                };
                sum = Some(backend.slotted_experts(&slots, x, &masked)?);
            }
        }
        cursor.0 += 1;
        if !plan.streamed.is_empty() {
            let first_slot = (position % 2) * self.num_experts;
            let staged: Vec<(usize, usize)> = plan
                .streamed
                .iter()
                .enumerate()
                .map(|(offset, &expert)| (expert, first_slot + offset))
                .collect();
            before_reuse(&slots, &staged)?;
        }
        // This half's next user: queued after this layer's kernels.
        if cursor.1 < self.plans.len() {
            self.prefetch(&mut slots, cursor.1)?;
            cursor.1 += 1;
        }
        Ok(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(tokens: usize) -> LayerBatch {
        // Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, int8 experts of ~4.7 MB.
        LayerBatch {
            tokens,
            experts_per_token: 8,
            num_experts: 128,
            non_resident: 128,
            expert_bytes: 3 * 2048 * 768 + 3 * 2048 * 768 / 32,
            hidden_size: 2048,
        }
    }

    fn h200_like() -> PrefillThroughputs {
        let flops_per_pair = 6.0 * 2048.0 * 768.0;
        PrefillThroughputs {
            copy_bytes_per_second: 55e9,
            backend_pairs_per_second: 300e12 / flops_per_pair,
            executor_pairs_per_second: 4e12 / flops_per_pair,
            flops_per_pair,
        }
    }

    #[test]
    fn long_batches_stream_every_expert_and_short_ones_share_with_the_cpu() {
        let throughputs = h200_like();
        let long = batch(16_384);
        assert_eq!(streamed_expert_count(&throughputs, &long), 128);
        assert_eq!(layer_split(128, 128), LayerSplit::Backend);
        let short = batch(256);
        let streamed = streamed_expert_count(&throughputs, &short);
        assert!(
            streamed > 0 && streamed < 128,
            "256 tokens should split the layer, streamed {streamed}"
        );
        // The chosen split is no slower than either extreme.
        let chosen = short.estimated_seconds(&throughputs, streamed);
        assert!(chosen <= short.estimated_seconds(&throughputs, 0));
        assert!(chosen <= short.estimated_seconds(&throughputs, 128));
    }

    #[test]
    fn an_unmeasured_or_absent_executor_gets_nothing() {
        let mut throughputs = h200_like();
        throughputs.executor_pairs_per_second = 0.0;
        assert_eq!(streamed_expert_count(&throughputs, &batch(64)), 128);
        let unmeasured = PrefillThroughputs::unmeasured(1.0);
        assert_eq!(streamed_expert_count(&unmeasured, &batch(64)), 128);
    }

    #[test]
    fn a_slow_link_leaves_most_of_the_layer_to_a_fast_executor() {
        let mut throughputs = h200_like();
        // PCIe 4 ×4 against a fast CPU.
        throughputs.copy_bytes_per_second = 5e9;
        throughputs.executor_pairs_per_second = 20e12 / throughputs.flops_per_pair;
        let streamed = streamed_expert_count(&throughputs, &batch(4096));
        assert!(streamed > 0 && streamed < 32, "streamed {streamed}");
        // Without a usable backend, everything goes to the executor.
        throughputs.backend_pairs_per_second = 1e-3;
        assert_eq!(streamed_expert_count(&throughputs, &batch(4096)), 0);
        assert_eq!(layer_split(0, 128), LayerSplit::Executor);
        assert_eq!(layer_split(5, 128), LayerSplit::Mixed);
    }

    #[test]
    fn a_split_that_saves_little_streams_everything() {
        // Qwen3-Next-80B-A3B, int4 experts (group 32, f16 scales), as measured on an H200: the
        // best mixed split was estimated 0.2% faster than streaming every expert.
        let (hidden, width) = (2048usize, 512usize);
        let flops_per_pair = 6.0 * hidden as f64 * width as f64;
        let throughputs = PrefillThroughputs {
            copy_bytes_per_second: 50.8e9,
            backend_pairs_per_second: 49.8e12 / flops_per_pair,
            executor_pairs_per_second: 0.6e12 / flops_per_pair,
            flops_per_pair,
        };
        let batch = LayerBatch {
            tokens: 4096,
            experts_per_token: 10,
            num_experts: 512,
            non_resident: 512,
            expert_bytes: 3 * hidden * width / 2 + 3 * hidden * width / 32 * 2,
            hidden_size: hidden,
        };
        let all = batch.estimated_seconds(&throughputs, 512);
        let best = (0..512)
            .map(|streamed| batch.estimated_seconds(&throughputs, streamed))
            .fold(f64::INFINITY, f64::min);
        assert!(best < all, "the estimate favours a split ({best} < {all})");
        assert!(best > all * (1.0 - EXECUTOR_SHARE_MARGIN));
        assert_eq!(streamed_expert_count(&throughputs, &batch), 512);
    }

    #[test]
    fn resident_experts_are_not_streamed() {
        let throughputs = h200_like();
        let mut half = batch(8192);
        half.non_resident = 64;
        assert_eq!(streamed_expert_count(&throughputs, &half), 64);
        half.non_resident = 0;
        assert_eq!(streamed_expert_count(&throughputs, &half), 0);
    }
}
