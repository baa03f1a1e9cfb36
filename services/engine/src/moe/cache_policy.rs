//! The expert cache's admission policy for one MoE layer: which missed experts earn a copy
//! into a GPU slot, and which resident expert each one replaces.
//!
//! An expert in a slot saves the CPU computing it each time a token routes to it; a fill costs
//! a copy over PCIe beside the steps (copy engine time, a table update, the host's driver
//! calls). The policy weighs the two in one unit, routed choices (a choice's worth is the CPU
//! time of one expert, the same for every expert of a layer):
//!
//! * each expert's use is counted twice, decaying per routed token: `recent` (about the last
//!   `1 / (1 − recent decay)` = 50 tokens) and `settled` (about the last 500, seeded from the
//!   routing statistics), both read as choices over the recent window;
//! * a newcomer is expected to save its recent count (routing has locality: the recent window
//!   predicts the next tokens best), a resident the higher of its two counts;
//! * a missed expert takes a free slot when its expected saving beats the fill's cost
//!   (`fill_cost_choices`), and evicts the resident with the lowest expected saving among those
//!   the step left alone when it saves more than that resident by the fill's cost plus
//!   `margin`. The resident's higher count is the hysteresis: an expert hot in the long run is
//!   not evicted for a burst, so two sets of experts taking turns, or noise in the recent
//!   window, move few slots, and with statistics that match stable routing almost none, while
//!   a lasting shift moves the slots once the old residents' settled counts have decayed;
//! * fills are paid from a copy budget: each decision earns `fill_credit_per_miss` fills per
//!   missed expert (the CPU time those experts take bounds the step's time from below, so the
//!   copies take a bounded share of it and the copy stream never lags), banked up to the
//!   per-step cap.
//!
//! A prompt chunk of `T` tokens counts as `T` tokens of its mean routing, so the estimates mean
//! the same after a prompt as after decode steps. Everything is a pure function of the routing
//! sequence and the table (deterministic). Counting a step costs O(its routed choices), and a
//! decision that fills nothing O(the step's distinct routed experts): no per-expert sweep.
//! Must not touch: the table (the caller applies the fills), copies, counters.

use crate::backend::ExpertSlotTable;

/// How much the recent count keeps per routed token (about 50 tokens' window).
pub const DEFAULT_DECAY_PER_TOKEN: f64 = 0.98;
/// How much the settled count keeps per routed token (about 500 tokens' window).
pub const DEFAULT_SETTLED_DECAY_PER_TOKEN: f64 = 0.998;
/// What one fill costs, in routed choices the CPU would compute: a fill moves the expert's
/// bytes over PCIe once (~25 GB/s page-locked), a CPU choice streams them from RAM once
/// (~100 GB/s for the expert kernels on the measured hosts), so one copy weighs about four
/// CPU computations of the expert.
pub const DEFAULT_FILL_COST_CHOICES: f64 = 4.0;
/// The share of a step's (modelled) time the fills' copies may take.
pub const DEFAULT_COPY_SHARE_OF_STEP: f64 = 0.5;

/// When a missed expert earns a slot (module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionRule {
    /// Factor the recent count keeps per routed token.
    pub recent_decay_per_token: f64,
    /// Factor the settled count keeps per routed token (equal to the recent one: a single
    /// horizon, no hysteresis between horizons).
    pub settled_decay_per_token: f64,
    /// A fill's cost in routed choices.
    pub fill_cost_choices: f64,
    /// How much more than the fill's cost a newcomer must save over the expert it evicts.
    pub margin: f64,
    /// Fills earned per missed expert of a decision; `None`: no copy budget.
    pub fill_credit_per_miss: Option<f64>,
}

impl AdmissionRule {
    /// One horizon (`decay_per_token`), no fill cost, no margin, no budget: every missed
    /// expert that scores higher than the coldest idle resident takes its slot.
    pub fn single_horizon(decay_per_token: f64) -> Self {
        AdmissionRule {
            recent_decay_per_token: decay_per_token,
            settled_decay_per_token: decay_per_token,
            fill_cost_choices: 0.0,
            margin: 0.0,
            fill_credit_per_miss: None,
        }
    }

    /// The budget of a copy stream allowed `copy_share` of the step: a step is at least as
    /// long as the CPU time of its missed experts, and a fill costs `fill_cost_choices` of
    /// those, so `copy_share / fill_cost_choices` fills per missed expert keep the copies
    /// within that share. `None` (no budget) without a cost or a share.
    pub fn fill_credit_per_miss(copy_share: f64, fill_cost_choices: f64) -> Option<f64> {
        (copy_share > 0.0 && fill_cost_choices > 0.0).then(|| copy_share / fill_cost_choices)
    }
}

/// Use counts that decay per routed token, kept scaled so that a token's decay touches one
/// number, not every expert's: count = `scaled / scale`.
#[derive(Debug, Clone, PartialEq)]
struct DecayingCounts {
    scaled: Vec<f64>,
    scale: f64,
    decay_per_token: f64,
    /// Tokens seen, decayed alike (the window the counts cover so far).
    window: f64,
}

/// Past this scale the counts are rewritten unscaled (f64 keeps ~300 decimal exponents).
const RESCALE_ABOVE: f64 = 1e100;

impl DecayingCounts {
    fn new(num_experts: usize, decay_per_token: f64) -> Self {
        DecayingCounts {
            scaled: vec![0.0; num_experts],
            scale: 1.0,
            decay_per_token,
            window: 0.0,
        }
    }

    /// The full window a long run of one-token steps reaches: `1 / (1 − decay)`.
    fn full_window(&self) -> f64 {
        1.0 / (1.0 - self.decay_per_token).max(1e-6)
    }

    /// Counts as if a full window of tokens routed `experts_per_token` choices each in the
    /// proportions of `seed`.
    fn seed(&mut self, seed: &[u64], experts_per_token: usize) {
        let total: u64 = seed.iter().sum();
        if total == 0 || seed.len() != self.scaled.len() {
            return;
        }
        let mass = experts_per_token as f64 * self.full_window();
        for (count, &seeded) in self.scaled.iter_mut().zip(seed) {
            *count = mass * seeded as f64 / total as f64;
        }
        self.scale = 1.0;
        self.window = self.full_window();
    }

    fn get(&self, expert: usize) -> f64 {
        self.scaled
            .get(expert)
            .map_or(0.0, |scaled| scaled / self.scale)
    }

    /// `tokens` tokens pass, routing `expert_ids` between them: every count decays once per
    /// token, and each choice adds the mean weight of a token of the chunk
    /// (`(1 − dᵀ) / (T (1 − d))`, 1 for one token).
    fn observe(&mut self, expert_ids: &[u32], tokens: usize) {
        let decay = self
            .decay_per_token
            .powi(i32::try_from(tokens).unwrap_or(i32::MAX));
        let weight = if tokens <= 1 {
            1.0
        } else {
            (1.0 - decay) / (tokens as f64 * (1.0 - self.decay_per_token).max(1e-12))
        };
        self.window = self.window * decay + weight * tokens as f64;
        let grown = self.scale / decay;
        if grown.is_finite() && grown <= RESCALE_ABOVE {
            self.scale = grown;
        } else {
            // Rare: the counts take the scale back (the only sweep over every expert).
            let factor = decay / self.scale;
            for count in &mut self.scaled {
                *count *= factor;
            }
            self.scale = 1.0;
        }
        let added = weight * self.scale;
        for &id in expert_ids {
            if let Some(count) = self.scaled.get_mut(id as usize) {
                *count += added;
            }
        }
    }
}

/// One fill the policy decided: `expert` goes to `slot`, evicting `evicted` if it held one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotFill {
    pub slot: usize,
    pub expert: usize,
    pub evicted: Option<usize>,
}

/// One MoE layer's cache policy: the two use counts, the experts routed since the last
/// decision and the copy budget.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCachePolicy {
    recent: DecayingCounts,
    settled: DecayingCounts,
    /// The distinct experts routed since the last decision, in first-routed order.
    routed: Vec<usize>,
    is_routed: Vec<bool>,
    rule: AdmissionRule,
    /// Fills earned and not spent (at most the per-step cap).
    fill_credit: f64,
    /// A lower bound of every resident's expected saving, from the last look at the slots
    /// ([`ColdestResidentBound`]): a decision whose best newcomer cannot beat it by the fill's
    /// cost plus the margin skips the look at every slot.
    coldest_resident: Option<ColdestResidentBound>,
    /// Tokens counted so far (the bound's clock).
    tokens_seen: f64,
    /// Tests: decide without the bound's shortcut (the decisions must not change).
    always_look_at_the_slots: bool,
    /// Decisions that looked at every slot.
    slot_looks: u64,
}

/// The lowest expected saving of any resident when the slots were last looked at, and the
/// clocks it decays by: a resident's saving, the higher of its two counts, falls by at most
/// the recent or the settled decay per token since (the settled count read over a window that
/// may have grown since), unless its expert was routed, which only raises it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ColdestResidentBound {
    saving: f64,
    tokens_seen: f64,
    settled_window: f64,
}

impl LayerCachePolicy {
    /// A single-horizon policy ([`AdmissionRule::single_horizon`]); counts start from `seed`
    /// (the layer's persisted token counts), scaled to the weight the decay gives a long run of
    /// one-token steps (`experts_per_token / (1 − decay)`), so the statistics count like recent
    /// history; without a seed every count is 0.
    pub fn new(
        num_experts: usize,
        seed: Option<&[u64]>,
        experts_per_token: usize,
        decay_per_token: f64,
    ) -> Self {
        Self::with_rule(
            num_experts,
            seed,
            experts_per_token,
            AdmissionRule::single_horizon(decay_per_token),
        )
    }

    /// The policy of `rule`, both counts seeded from `seed` as in [`LayerCachePolicy::new`].
    pub fn with_rule(
        num_experts: usize,
        seed: Option<&[u64]>,
        experts_per_token: usize,
        rule: AdmissionRule,
    ) -> Self {
        let mut recent = DecayingCounts::new(num_experts, rule.recent_decay_per_token);
        let mut settled = DecayingCounts::new(num_experts, rule.settled_decay_per_token);
        if let Some(seed) = seed {
            recent.seed(seed, experts_per_token);
            settled.seed(seed, experts_per_token);
        }
        LayerCachePolicy {
            recent,
            settled,
            routed: Vec::new(),
            is_routed: vec![false; num_experts],
            rule: AdmissionRule {
                margin: rule.margin.max(0.0),
                fill_cost_choices: rule.fill_cost_choices.max(0.0),
                ..rule
            },
            fill_credit: 0.0,
            coldest_resident: None,
            tokens_seen: 0.0,
            always_look_at_the_slots: false,
            slot_looks: 0,
        }
    }

    /// The policy with margin `margin` (`ExpertCacheOptions::eviction_margin`).
    pub fn with_eviction_margin(mut self, margin: f64) -> Self {
        self.rule.margin = margin.max(0.0);
        self
    }

    pub fn rule(&self) -> AdmissionRule {
        self.rule
    }

    /// Counts one call's routing (`expert_ids` of `tokens` tokens; ids outside the layer are
    /// ignored). Costs O(`expert_ids`).
    pub fn observe(&mut self, expert_ids: &[u32], tokens: usize) {
        self.tokens_seen += tokens as f64;
        self.recent.observe(expert_ids, tokens);
        self.settled.observe(expert_ids, tokens);
        for &id in expert_ids {
            let expert = id as usize;
            if let Some(flag) = self.is_routed.get_mut(expert) {
                if !*flag {
                    *flag = true;
                    self.routed.push(expert);
                }
            }
        }
    }

    /// The recent count of `expert` now (decayed routed choices).
    pub fn score(&self, expert: usize) -> f64 {
        self.recent.get(expert)
    }

    /// The settled count of `expert` read over the recent window (choices per recent window,
    /// from a longer history; before a full recent window of history, the count itself).
    pub fn settled_score(&self, expert: usize) -> f64 {
        let window = self.settled.window.max(self.recent.full_window());
        self.settled.get(expert) * self.recent.full_window() / window
    }

    /// What giving `expert` a slot is expected to save, in choices over the recent window: its
    /// recent count (routing has locality: the recent window predicts the next tokens best).
    fn newcomer_use(&self, expert: usize) -> f64 {
        self.score(expert)
    }

    /// What keeping resident `expert` is expected to save: the higher of its two counts, so an
    /// expert hot in the long run keeps its slot through a lull.
    fn resident_use(&self, expert: usize) -> f64 {
        self.score(expert).max(self.settled_score(expert))
    }

    /// The bound of [`ColdestResidentBound`] now (`None`: the slots must be looked at).
    fn coldest_resident_bound(&self) -> Option<f64> {
        let bound = self.coldest_resident?;
        let tokens = self.tokens_seen - bound.tokens_seen;
        let full = self.recent.full_window();
        let window_growth =
            bound.settled_window.max(full) / self.settled.window.max(full).max(f64::MIN_POSITIVE);
        let recent = self.recent.decay_per_token.powf(tokens);
        let settled = self.settled.decay_per_token.powf(tokens) * window_growth.min(1.0);
        // Below by a hair: rounding must never make the shortcut skip a real eviction.
        Some(bound.saving * recent.min(settled) * (1.0 - 1e-9))
    }

    fn remember_coldest_resident(&mut self, saving: f64) {
        self.coldest_resident = Some(ColdestResidentBound {
            saving,
            tokens_seen: self.tokens_seen,
            settled_window: self.settled.window,
        });
    }

    /// The fills for the routing counted since the last decision, at most `max_fills` and at
    /// most the budget: the missed experts whose use beats a fill's cost, highest first (ties:
    /// lower id), each into the lowest free slot, else evicting the resident with the lowest
    /// use that the routing left alone (ties: lower id) when the newcomer saves more than the
    /// fill's cost plus the margin over it. Forgets which experts were routed.
    pub fn decide(&mut self, table: &ExpertSlotTable, max_fills: usize) -> Vec<SlotFill> {
        let routed = std::mem::take(&mut self.routed);
        let fills = self.decide_for(table, max_fills, &routed);
        for &expert in &routed {
            self.is_routed[expert] = false;
        }
        self.routed = routed;
        self.routed.clear();
        fills
    }

    fn decide_for(
        &mut self,
        table: &ExpertSlotTable,
        max_fills: usize,
        routed: &[usize],
    ) -> Vec<SlotFill> {
        // Runs for every MoE layer between two steps: the common case (nothing worth a copy)
        // looks at the routed experts only and allocates nothing.
        let experts = table.num_experts();
        let missed = || {
            routed
                .iter()
                .copied()
                .filter(move |&expert| expert < experts && !table.is_resident(expert))
        };
        let allowed = match self.rule.fill_credit_per_miss {
            _ if max_fills == 0 => 0,
            None => max_fills,
            Some(per_miss) => {
                let earned = per_miss * missed().count() as f64;
                self.fill_credit = (self.fill_credit + earned).min(max_fills as f64);
                (self.fill_credit.floor() as usize).min(max_fills)
            }
        };
        let bar = self.rule.fill_cost_choices;
        let best = missed()
            .map(|expert| self.newcomer_use(expert))
            .fold(f64::NEG_INFINITY, f64::max);
        if allowed == 0 || table.slot_count() == 0 || best <= bar {
            return Vec::new();
        }
        // No free slot, and the best newcomer cannot beat even the bound on every resident:
        // nothing to evict, without looking at the slots.
        if !table.has_free_slot() && !self.always_look_at_the_slots {
            if let Some(bound) = self.coldest_resident_bound() {
                if best - bound <= bar + self.rule.margin {
                    return Vec::new();
                }
            }
        }
        let mut candidates: Vec<usize> = missed()
            .filter(|&expert| self.newcomer_use(expert) > bar)
            .collect();
        candidates.sort_by(|&a, &b| {
            self.newcomer_use(b)
                .total_cmp(&self.newcomer_use(a))
                .then(a.cmp(&b))
        });
        let mut free: Vec<usize> = (0..table.slot_count())
            .filter(|&slot| table.expert_in(slot).is_none())
            .collect();
        free.reverse(); // popped lowest first
        self.slot_looks += 1;
        let residents = || (0..table.slot_count()).filter_map(|slot| table.expert_in(slot));
        let coldest = residents()
            .map(|expert| self.resident_use(expert))
            .fold(f64::INFINITY, f64::min);
        let mut victims: Vec<(usize, usize)> = (0..table.slot_count())
            .filter_map(|slot| table.expert_in(slot).map(|expert| (slot, expert)))
            .filter(|&(_, expert)| !self.is_routed.get(expert).copied().unwrap_or(false))
            .collect();
        // Only the `allowed` coldest can go (a total order: the same ones every time), popped
        // coldest first.
        let coldest_first = |(_, a): &(usize, usize), (_, b): &(usize, usize)| {
            self.resident_use(*a)
                .total_cmp(&self.resident_use(*b))
                .then(a.cmp(b))
        };
        if victims.len() > allowed {
            victims.select_nth_unstable_by(allowed, coldest_first);
            victims.truncate(allowed);
        }
        victims.sort_by(|a, b| coldest_first(b, a));
        let fills = pair_with_slots(&candidates, free, victims, allowed, |expert, victim| {
            self.newcomer_use(expert) - self.resident_use(victim) > bar + self.rule.margin
        });
        // Evicted residents leave (the bound still holds); newcomers stay above it unless a
        // free slot took one below.
        let newcomers = fills
            .iter()
            .map(|fill| self.newcomer_use(fill.expert))
            .fold(coldest, f64::min);
        self.remember_coldest_resident(newcomers);
        if self.rule.fill_credit_per_miss.is_some() {
            self.fill_credit = (self.fill_credit - fills.len() as f64).max(0.0);
        }
        fills
    }

    /// The slots a long prompt re-places while its layer's experts sit in layerwise prefill's
    /// staging slots (`staged`: the experts there), where a copy into a resident slot costs a
    /// device copy, not PCIe: no copy budget and no fill cost. The prompt's routing, counted
    /// just before, fills the counts, so they describe it well; the missed staged experts,
    /// hottest first (ties: lower id), take the free slots lowest first, then evict the
    /// resident with the lowest expected use (any resident: a prompt routes nearly every
    /// expert; ties: lower id) while they are expected to save more than it. Returns the fills
    /// in that order.
    pub fn place_from_staging(
        &mut self,
        table: &ExpertSlotTable,
        staged: &[usize],
    ) -> Vec<SlotFill> {
        let experts = table.num_experts();
        let mut candidates: Vec<usize> = staged
            .iter()
            .copied()
            .filter(|&expert| {
                expert < experts && !table.is_resident(expert) && self.newcomer_use(expert) > 0.0
            })
            .collect();
        candidates.sort_by(|&a, &b| {
            self.newcomer_use(b)
                .total_cmp(&self.newcomer_use(a))
                .then(a.cmp(&b))
        });
        candidates.dedup();
        if candidates.is_empty() {
            return Vec::new();
        }
        let mut free: Vec<usize> = (0..table.slot_count())
            .filter(|&slot| table.expert_in(slot).is_none())
            .collect();
        free.reverse(); // popped lowest first
        let mut victims: Vec<(usize, usize)> = (0..table.slot_count())
            .filter_map(|slot| table.expert_in(slot).map(|expert| (slot, expert)))
            .collect();
        // Popped coldest first.
        victims.sort_by(|(_, a), (_, b)| {
            self.resident_use(*b)
                .total_cmp(&self.resident_use(*a))
                .then(b.cmp(a))
        });
        let fills = pair_with_slots(&candidates, free, victims, usize::MAX, |expert, victim| {
            self.newcomer_use(expert) > self.resident_use(victim)
        });
        if !fills.is_empty() {
            // The residents changed wholesale: the next decision looks at the slots again.
            self.coldest_resident = None;
        }
        fills
    }
}

/// Fills for `candidates` (hottest first), at most `limit`: each takes the next of `free`
/// (popped from the end) while one is left, then evicts the next of `victims` (popped from the
/// end: coldest last in the vector) when `beats(newcomer, victim)`. Candidates come hottest
/// first and victims coldest first, so once one candidate loses, none after it can win.
fn pair_with_slots(
    candidates: &[usize],
    mut free: Vec<usize>,
    mut victims: Vec<(usize, usize)>,
    limit: usize,
    beats: impl Fn(usize, usize) -> bool,
) -> Vec<SlotFill> {
    let mut fills = Vec::new();
    for &expert in candidates {
        if fills.len() == limit {
            break;
        }
        if let Some(slot) = free.pop() {
            fills.push(SlotFill {
                slot,
                expert,
                evicted: None,
            });
            continue;
        }
        match victims.last() {
            Some(&(slot, victim)) if beats(expert, victim) => {
                victims.pop();
                fills.push(SlotFill {
                    slot,
                    expert,
                    evicted: Some(victim),
                });
            }
            _ => break,
        }
    }
    fills
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(num_experts: usize, residents: &[Option<usize>]) -> ExpertSlotTable {
        let mut table = ExpertSlotTable::new(num_experts, residents.len());
        for (slot, expert) in residents.iter().enumerate() {
            if let Some(expert) = expert {
                table.assign(slot, *expert).unwrap();
            }
        }
        table
    }

    #[test]
    fn seeds_scale_to_the_decay_window_and_decay_per_token() {
        let policy = LayerCachePolicy::new(4, Some(&[3, 1, 0, 0]), 2, 0.5);
        // Mass k / (1 − d) = 4, split 3 : 1.
        assert_eq!((policy.score(0), policy.score(1)), (3.0, 1.0));
        let mut policy = policy;
        policy.observe(&[2, 2, 3, 0], 2);
        // Two tokens: × 0.25, then each choice the mean weight of the chunk's tokens,
        // (1 − 0.25) / (2 × 0.5) = 0.75.
        assert_eq!(policy.score(0), 0.75 + 0.75);
        assert_eq!(policy.score(2), 1.5);
        // One token: × 0.5, + 1 per choice.
        policy.observe(&[2], 1);
        assert_eq!(policy.score(2), 1.75);
        assert_eq!(policy.score(1), 0.125);
        // Ids outside the layer (no expert) are ignored.
        policy.observe(&[u32::MAX], 0);
        assert_eq!(
            LayerCachePolicy::new(2, Some(&[0, 0]), 1, 0.9).score(0),
            0.0
        );
        assert_eq!(LayerCachePolicy::new(2, Some(&[1]), 1, 0.9).score(0), 0.0);
    }

    #[test]
    fn missed_experts_fill_free_slots_first_then_evict_the_coldest_unused() {
        let mut policy = LayerCachePolicy::new(6, Some(&[10, 1, 5, 0, 0, 0]), 1, 0.9);
        // Slots: expert 0, expert 1, free.
        let slots = table(6, &[Some(0), Some(1), None]);
        policy.observe(&[3, 4, 5, 0], 4);
        let scores: Vec<f64> = (0..6).map(|e| policy.score(e)).collect();
        assert!(scores[3] == scores[4] && scores[4] == scores[5]);
        let fills = policy.decide(&slots, 2);
        // Ties: lower id first; the free slot first, then expert 1 (unused, coldest) evicted.
        assert_eq!(
            fills,
            vec![
                SlotFill {
                    slot: 2,
                    expert: 3,
                    evicted: None
                },
                SlotFill {
                    slot: 1,
                    expert: 4,
                    evicted: Some(1)
                },
            ]
        );
        // The step is forgotten: nothing is missed any more.
        assert!(policy.decide(&slots, 2).is_empty());
    }

    #[test]
    fn experts_used_in_the_step_or_hotter_are_never_evicted() {
        let mut policy = LayerCachePolicy::new(4, Some(&[100, 100, 0, 0]), 1, 0.99);
        let slots = table(4, &[Some(0), Some(1)]);
        // Expert 2 is missed once: far colder than both residents, no eviction.
        policy.observe(&[2], 1);
        assert!(policy.decide(&slots, 2).is_empty());
        // Both residents routed this step: neither may go, however cold.
        let mut cold = LayerCachePolicy::new(4, None, 1, 0.5);
        for _ in 0..5 {
            cold.observe(&[3], 1);
        }
        cold.observe(&[0, 1, 3], 1);
        assert!(cold.decide(&slots, 2).is_empty());
        // No fills allowed, no slots: nothing.
        cold.observe(&[3], 1);
        assert!(cold.decide(&slots, 0).is_empty());
        cold.observe(&[3], 1);
        assert!(cold.decide(&table(4, &[]), 2).is_empty());
    }

    #[test]
    fn a_near_tie_does_not_evict_within_the_margin() {
        // Slot: expert 0 (score 0.75, unused in the last step); expert 1 missed, score 1.5.
        let slots = table(3, &[Some(0)]);
        let fresh = || {
            let mut policy = LayerCachePolicy::new(3, None, 1, 0.5);
            policy.observe(&[0], 1);
            policy.observe(&[0, 1], 1);
            // A step with no fills: the routed experts are forgotten.
            assert!(policy.decide(&slots, 0).is_empty());
            policy.observe(&[1], 1);
            policy
        };
        let (score_0, score_1) = {
            let policy = fresh();
            (policy.score(0), policy.score(1))
        };
        assert!(
            score_1 > score_0 && score_1 - score_0 < 1.0,
            "{score_0} {score_1}"
        );
        // Without a margin the newcomer takes the slot; within a margin of 1 it does not.
        assert_eq!(fresh().decide(&slots, 1).len(), 1);
        assert!(fresh()
            .with_eviction_margin(1.0)
            .decide(&slots, 1)
            .is_empty());
        // A free slot takes it whatever the margin.
        let free = table(3, &[Some(0), None]);
        assert_eq!(fresh().with_eviction_margin(1.0).decide(&free, 1).len(), 1);
    }

    #[test]
    fn fills_per_step_are_bounded() {
        let mut policy = LayerCachePolicy::new(8, None, 1, 0.9);
        policy.observe(&[1, 2, 3, 4, 5], 5);
        let fills = policy.decide(&table(8, &[None; 4]), 2);
        assert_eq!(fills.len(), 2);
        assert_eq!((fills[0].slot, fills[1].slot), (0, 1));
    }

    #[test]
    fn counts_keep_their_value_across_rescaling_and_chunks_count_as_their_tokens() {
        // The scaled counts against a direct sweep per token, over far more decay than one
        // scale factor holds.
        let decay = 0.9;
        let mut counts = DecayingCounts::new(3, decay);
        let mut direct = [0.0f64; 3];
        for step in 0..5_000u32 {
            let id = step % 3;
            counts.observe(&[id], 1);
            direct.iter_mut().for_each(|count| *count *= decay);
            direct[id as usize] += 1.0;
        }
        for (expert, &value) in direct.iter().enumerate() {
            assert!(
                (counts.get(expert) - value).abs() < 1e-9 * value,
                "{expert}"
            );
        }
        // A chunk of 1,000 tokens routing one expert at rate ½ gives the count of a long run
        // at that rate, ½ / (1 − d), as a run of one-token steps would.
        let mut chunked = DecayingCounts::new(2, decay);
        let ids: Vec<u32> = (0..1_000).map(|token| token % 2).collect();
        chunked.observe(&ids, 1_000);
        assert!((chunked.get(0) - 0.5 / (1.0 - decay)).abs() < 1e-9);
        assert!((chunked.window - 1.0 / (1.0 - decay)).abs() < 1e-9);
        // A chunk too long for the scale leaves the chunk's counts alone.
        chunked.observe(&[1; 20_000], 20_000);
        assert_eq!(chunked.get(0), 0.0);
        assert!((chunked.get(1) - 1.0 / (1.0 - decay)).abs() < 1e-9);
    }

    #[test]
    fn a_burst_does_not_evict_an_expert_hot_in_the_long_run() {
        let rule = AdmissionRule {
            recent_decay_per_token: 0.9,
            settled_decay_per_token: 0.99,
            fill_cost_choices: 2.0,
            margin: 1.0,
            fill_credit_per_miss: None,
        };
        let slots = table(4, &[Some(0)]);
        // Expert 0 settled hot (seeded), expert 1 hot for the last few tokens only: its recent
        // count beats expert 0's recent count by more than cost and margin, not its settled one.
        let mut policy = LayerCachePolicy::with_rule(4, Some(&[1, 0, 0, 0]), 1, rule);
        for _ in 0..20 {
            policy.observe(&[1], 1);
        }
        assert!(policy.score(1) > policy.score(0) + 3.0);
        assert!(policy.settled_score(1) < policy.settled_score(0));
        assert!(policy.decide(&slots, 1).is_empty());
        // Lasting: the settled count follows and the newcomer evicts.
        for _ in 0..400 {
            policy.observe(&[1], 1);
        }
        assert_eq!(
            policy.decide(&slots, 1),
            vec![SlotFill {
                slot: 0,
                expert: 1,
                evicted: Some(0)
            }]
        );
        // A free slot still asks the fill's cost: a single choice is not worth a copy.
        let mut once = LayerCachePolicy::with_rule(4, None, 1, rule);
        once.observe(&[2], 1);
        assert!(once.decide(&table(4, &[None]), 1).is_empty());
        once.observe(&[2], 1);
        once.observe(&[2], 1);
        assert_eq!(once.decide(&table(4, &[None]), 1).len(), 1);
    }

    #[test]
    fn the_bound_on_the_residents_skips_looks_but_never_changes_a_decision() {
        // Routing whose hot set moves every 300 tokens, one token a step, sometimes a chunk.
        let rule = AdmissionRule {
            recent_decay_per_token: DEFAULT_DECAY_PER_TOKEN,
            settled_decay_per_token: DEFAULT_SETTLED_DECAY_PER_TOKEN,
            fill_cost_choices: DEFAULT_FILL_COST_CHOICES,
            margin: 1.0,
            fill_credit_per_miss: AdmissionRule::fill_credit_per_miss(0.5, 4.0),
        };
        for seed in [None, Some(&[5u64; 32][..])] {
            let mut fast = LayerCachePolicy::with_rule(32, seed, 4, rule);
            let mut slow = fast.clone();
            slow.always_look_at_the_slots = true;
            let mut slots = table(32, &[None; 8]);
            for (slot, expert) in (0..8).enumerate() {
                slots.assign(slot, expert).unwrap();
            }
            let mut state = 0x2545_F491_4F6C_DD1Du64;
            let mut fills = 0;
            for step in 0..3_000u64 {
                let tokens = if step % 500 == 0 { 64 } else { 1 };
                let hot = 8 * (step / 300 % 4);
                let ids: Vec<u32> = (0..4 * tokens)
                    .map(|_| {
                        state = state
                            .wrapping_mul(6_364_136_223_846_793_005)
                            .wrapping_add(1_442_695_040_888_963_407);
                        let draw = (state >> 33) % 32;
                        // Three in four choices from the hot set of 8.
                        (if draw < 24 { hot + draw % 8 } else { draw }) as u32
                    })
                    .collect();
                fast.observe(&ids, tokens as usize);
                slow.observe(&ids, tokens as usize);
                let decided = fast.decide(&slots, 2);
                assert_eq!(decided, slow.decide(&slots, 2), "step {step}");
                for fill in decided {
                    slots.assign(fill.slot, fill.expert).unwrap();
                    fills += 1;
                }
            }
            assert!(
                fills > 10,
                "{fills} fills: the routing never moved the slots"
            );
            assert!(
                fast.slot_looks * 4 < slow.slot_looks,
                "{} looks against {}",
                fast.slot_looks,
                slow.slot_looks
            );
        }
    }

    #[test]
    fn a_prompt_re_places_its_staged_experts_by_use_without_a_budget() {
        // Slots 0..3 hold experts 0, 1, 2, slot 3 is free; the prompt routes 5 and 6 most,
        // then 1, then 4, and never 0 or 2.
        let mut policy = LayerCachePolicy::with_rule(
            8,
            None,
            2,
            AdmissionRule {
                fill_credit_per_miss: Some(0.01),
                fill_cost_choices: 4.0,
                margin: 3.0,
                ..AdmissionRule::single_horizon(0.98)
            },
        );
        let slots = table(8, &[Some(0), Some(1), Some(2), None]);
        let mut ids = Vec::new();
        for token in 0..64u32 {
            ids.extend([5, 6]);
            ids.extend([if token % 2 == 0 { 1 } else { 4 }, 6]);
        }
        policy.observe(&ids, 128);
        // Expert 7 is staged but never routed: no candidate, and the copy budget (a hundredth
        // of a fill per miss) and the margin do not apply.
        let fills = policy.place_from_staging(&slots, &[4, 5, 6, 7, 1]);
        assert_eq!(
            fills,
            vec![
                SlotFill {
                    slot: 3,
                    expert: 6,
                    evicted: None
                },
                // Experts 0 and 2 tie at no use: the lower id goes first.
                SlotFill {
                    slot: 0,
                    expert: 5,
                    evicted: Some(0)
                },
                SlotFill {
                    slot: 2,
                    expert: 4,
                    evicted: Some(2)
                },
            ]
        );
        // Nothing the prompt used less than a resident displaces it.
        let mut slots = slots;
        for fill in &fills {
            slots.assign(fill.slot, fill.expert).unwrap();
        }
        assert!(policy.place_from_staging(&slots, &[0, 2, 7]).is_empty());
    }
}
