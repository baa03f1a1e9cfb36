//! The dynamic expert cache: GPU expert slots that follow the routing.
//!
//! Owns: the per-layer policy ([`LayerCachePolicy`]: use counts that decay per routed token,
//! seeded from the persisted routing statistics; after a step, the missed experts that score
//! highest go to free slots or evict the lowest-scoring resident expert not used in that step,
//! at most `fills_per_layer` per layer and step), the step hook that applies it to a model's
//! slots ([`ExpertCache::between_steps`]), the hit / miss / fill / eviction / byte counters, and
//! [`simulate_hit_rates`], the same policy and timing on a recorded routing trace.
//!
//! Timing, the same on every backend and in the simulation, so which experts are resident in a
//! step is a pure function of the routings of the steps before it (never of copy timing):
//! * after step `t`'s routing is counted, the hook at the start of step `t + 1` decides the fills
//!   from it and starts their copies ([`ExpertSlotFills::start_fill`]: the slot leaves the table
//!   at once, the copy runs on a copy stream beside step `t + 1`, which waits for nothing);
//! * the hook at the start of step `t + 2` enters them in the table
//!   ([`ExpertSlotFills::complete_fills`]); only there does anything wait for the copy (on a GPU
//!   the compute stream waits for its event; it has long landed in practice).
//!
//! A replayed step graph moves the hook: the hook for step `t + 1` runs while the GPU runs step
//! `t` (`Model::expert_cache_upkeep_ahead`), with the routings up to step `t − 1`, its table
//! changes and copies queued behind step `t`'s graph; fills then enter the table three steps
//! after the routing that chose them. The order of steps and hooks, not timing, still decides.
//!
//! A step is one model forward. Two runs with the same steps give the same bits. An expert's
//! output is the same wherever it is computed; only the order in which the resident and CPU parts
//! of a token are summed follows the placement (f32 rounding), so greedy tokens stay those of
//! static placement (`tests/expert_cache.rs`).
//! Must not touch: slot storage and copies (backends), the start-up placement
//! (`crate::moe::placement`), the routing itself.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLockWriteGuard};

use ninfer_artifact::{Artifact, ExpertBank};

use crate::backend::{ExpertSlotFills, ExpertSlotTable, WithExpertSlotTable};
use crate::error::EngineError;
use crate::service::routing_stats::ExpertStatistics;

/// An MoE layer as the cache sees it: its resident slots and the bank fills copy from (the
/// layer, which reports its routing to the cache, implements it).
pub(crate) trait CachedLayer {
    type Slots: ExpertSlotFills + WithExpertSlotTable;
    /// The layer's resident slots, locked for writing (`None`: the layer has none).
    fn resident_slots_mut(&self) -> Result<RwLockWriteGuard<'_, Option<Self::Slots>>, EngineError>;
    fn expert_bank(&self) -> &ExpertBank;
}

/// `--moe-cache-fills-per-layer` by default.
pub const DEFAULT_FILLS_PER_LAYER: usize = 2;
/// How much an expert's use count keeps per routed token: about the last 1 / (1 − 0.98) = 50
/// tokens' routing weigh as much as everything before (the trained fixture's hit rate peaks
/// there, with a quarter of the fills of 0.9).
pub const DEFAULT_DECAY_PER_TOKEN: f64 = 0.98;

/// How the cache behaves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertCacheOptions {
    /// Fills per MoE layer and step; 0 keeps the start-up placement (`--moe-static-experts`),
    /// the counters still count.
    pub fills_per_layer: usize,
    /// Factor an expert's score is multiplied by per routed token.
    pub decay_per_token: f64,
    /// How much more a missed expert must score than the resident one it would evict
    /// (decayed routed choices): against near ties, where two experts would take turns in a
    /// slot and every swap costs a copy and saves nothing. Free slots take any missed expert.
    pub eviction_margin: f64,
    /// Decide the next step's fills and start their copies while the GPU replays this step's
    /// graph (off: between the steps, in series with them). During the step the host's
    /// driver calls leave the critical path, but on a machine whose expert workers hold every
    /// core they take a worker's core for that time, and every layer waits for that worker.
    pub upkeep_during_steps: bool,
}

/// `ExpertCacheOptions::eviction_margin` by default: a newcomer must have been chosen about
/// three more times (in the decayed count) than the expert it replaces. Measured on an H100
/// (synthetic qwen3.5-35b-a3b int4, trained routing, 16 GiB, 4K prompt, 128 tokens, no
/// statistics): 106.75 tok/s against 100.28 at a margin of 1 (static first-N placement 91.21),
/// with 13% fewer fills at the same decode hit rate.
pub const DEFAULT_EVICTION_MARGIN: f64 = 3.0;

impl Default for ExpertCacheOptions {
    fn default() -> Self {
        ExpertCacheOptions {
            fills_per_layer: DEFAULT_FILLS_PER_LAYER,
            decay_per_token: DEFAULT_DECAY_PER_TOKEN,
            eviction_margin: DEFAULT_EVICTION_MARGIN,
            upkeep_during_steps: true,
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

/// One MoE layer's cache policy: decayed use scores and the experts the last step routed to.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCachePolicy {
    scores: Vec<f64>,
    routed_this_step: Vec<bool>,
    decay_per_token: f64,
    eviction_margin: f64,
}

impl LayerCachePolicy {
    /// Scores start from `seed` (the layer's persisted token counts), scaled to the weight the
    /// decay gives a long run of one-token steps (`experts_per_token / (1 − decay)`), so the
    /// statistics count like recent history; without a seed every score is 0.
    pub fn new(
        num_experts: usize,
        seed: Option<&[u64]>,
        experts_per_token: usize,
        decay_per_token: f64,
    ) -> Self {
        let mut scores = vec![0.0; num_experts];
        if let Some(seed) = seed.filter(|seed| seed.len() == num_experts) {
            let total: u64 = seed.iter().sum();
            if total > 0 {
                let mass = experts_per_token as f64 / (1.0 - decay_per_token).max(1e-6);
                for (score, &count) in scores.iter_mut().zip(seed) {
                    *score = mass * count as f64 / total as f64;
                }
            }
        }
        LayerCachePolicy {
            scores,
            routed_this_step: vec![false; num_experts],
            decay_per_token,
            eviction_margin: 0.0,
        }
    }

    /// The policy with [`ExpertCacheOptions::eviction_margin`] `margin`.
    pub fn with_eviction_margin(mut self, margin: f64) -> Self {
        self.eviction_margin = margin.max(0.0);
        self
    }

    /// Counts one call's routing (`expert_ids` of `tokens` tokens; ids outside the layer are
    /// ignored): every score decays once per token, then each routed choice adds 1. Prompt
    /// chunks count like decode steps: their mass damps the churn single decode tokens would
    /// cause (left out, the cache filled ~56 experts per token at a 16 GiB budget for two
    /// points of decode hit rate, and decode lost a fifth).
    pub fn observe(&mut self, expert_ids: &[u32], tokens: usize) {
        let decay = self
            .decay_per_token
            .powi(i32::try_from(tokens).unwrap_or(i32::MAX));
        for score in &mut self.scores {
            *score *= decay;
        }
        for &id in expert_ids {
            if let Some(score) = self.scores.get_mut(id as usize) {
                *score += 1.0;
                self.routed_this_step[id as usize] = true;
            }
        }
    }

    /// The score of `expert` now.
    pub fn score(&self, expert: usize) -> f64 {
        self.scores.get(expert).copied().unwrap_or(0.0)
    }

    /// The fills for the step just observed, at most `max_fills`: the experts it routed to that
    /// `table` does not hold, highest score first (ties: lower id), each into the lowest free
    /// slot, else evicting the lowest-scoring resident expert the step did not use (ties: lower
    /// id) when the newcomer scores more than the eviction margin higher. Forgets which experts
    /// the step routed to.
    pub fn decide(&mut self, table: &ExpertSlotTable, max_fills: usize) -> Vec<SlotFill> {
        // The hook runs for every MoE layer between two steps, on the step's critical path: the
        // common case (nothing worth a copy) returns before any allocation.
        let experts = self.scores.len().min(table.num_experts());
        let mut best_missed = None::<usize>;
        let mut any_missed = false;
        for expert in 0..experts {
            if self.routed_this_step[expert] && !table.is_resident(expert) {
                any_missed = true;
                if best_missed.is_none_or(|best| self.scores[expert] > self.scores[best]) {
                    best_missed = Some(expert);
                }
            }
        }
        let routed = std::mem::take(&mut self.routed_this_step);
        let forget = |policy: &mut Self, mut routed: Vec<bool>| {
            routed.iter_mut().for_each(|flag| *flag = false);
            policy.routed_this_step = routed;
        };
        if max_fills == 0 || table.slot_count() == 0 || !any_missed {
            forget(self, routed);
            return Vec::new();
        }
        let has_free_slot = (0..table.slot_count()).any(|slot| table.expert_in(slot).is_none());
        if !has_free_slot {
            // No copy unless the best newcomer beats the coldest resident the step left alone.
            let coldest = (0..table.slot_count())
                .filter_map(|slot| table.expert_in(slot))
                .filter(|&expert| !routed.get(expert).copied().unwrap_or(false))
                .map(|expert| self.scores[expert])
                .min_by(f64::total_cmp);
            let worth_it = match (best_missed, coldest) {
                (Some(best), Some(coldest)) => coldest + self.eviction_margin < self.scores[best],
                _ => false,
            };
            if !worth_it {
                forget(self, routed);
                return Vec::new();
            }
        }
        let fills = self.decide_fills(table, max_fills, &routed);
        forget(self, routed);
        fills
    }

    /// [`LayerCachePolicy::decide`] once a fill may be worth it.
    fn decide_fills(
        &self,
        table: &ExpertSlotTable,
        max_fills: usize,
        routed: &[bool],
    ) -> Vec<SlotFill> {
        let by_score_descending =
            |a: &usize, b: &usize| self.scores[*b].total_cmp(&self.scores[*a]).then(a.cmp(b));
        let mut missed: Vec<usize> = (0..self.scores.len().min(table.num_experts()))
            .filter(|&expert| routed[expert] && !table.is_resident(expert))
            .collect();
        missed.sort_by(by_score_descending);
        let mut free: Vec<usize> = (0..table.slot_count())
            .filter(|&slot| table.expert_in(slot).is_none())
            .collect();
        free.reverse(); // popped lowest first
        let mut victims: Vec<(usize, usize)> = (0..table.slot_count())
            .filter_map(|slot| table.expert_in(slot).map(|expert| (slot, expert)))
            .filter(|&(_, expert)| !routed.get(expert).copied().unwrap_or(false))
            .collect();
        // Only the `max_fills` coldest can go (a total order: the same ones every time), popped
        // coldest first.
        let coldest_first = |(_, a): &(usize, usize), (_, b): &(usize, usize)| {
            self.scores[*a].total_cmp(&self.scores[*b]).then(a.cmp(b))
        };
        if victims.len() > max_fills {
            victims.select_nth_unstable_by(max_fills, coldest_first);
            victims.truncate(max_fills);
        }
        victims.sort_by(|a, b| coldest_first(b, a));
        let mut fills = Vec::new();
        for expert in missed {
            if fills.len() == max_fills {
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
                Some(&(slot, victim))
                    if self.scores[victim] + self.eviction_margin < self.scores[expert] =>
                {
                    victims.pop();
                    fills.push(SlotFill {
                        slot,
                        expert,
                        evicted: Some(victim),
                    });
                }
                // The rest score no higher than this one: nothing more is worth a copy.
                _ => break,
            }
        }
        fills
    }
}

/// Counters of one MoE layer (cumulative since start).
#[derive(Debug, Default)]
pub struct LayerCacheCounters {
    /// Routed choices (token × expert) whose expert was in a slot.
    pub hits: AtomicU64,
    /// Routed choices whose expert was not.
    pub misses: AtomicU64,
    pub fills: AtomicU64,
    /// Fills that replaced a resident expert.
    pub evictions: AtomicU64,
    pub bytes_copied: AtomicU64,
    /// Host time of the hook between steps for this layer (deciding, starting and completing
    /// fills), nanoseconds: what the cache costs the step outside the copies.
    pub upkeep_nanos: AtomicU64,
    /// Hooks between steps for this layer.
    pub upkeeps: AtomicU64,
}

/// A snapshot of [`LayerCacheCounters`] (or their sum over layers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheCounts {
    pub hits: u64,
    pub misses: u64,
    pub fills: u64,
    pub evictions: u64,
    pub bytes_copied: u64,
}

impl CacheCounts {
    /// Hits over lookups (0 without any).
    pub fn hit_rate(&self) -> f64 {
        let lookups = self.hits + self.misses;
        if lookups == 0 {
            0.0
        } else {
            self.hits as f64 / lookups as f64
        }
    }

    fn add(&mut self, other: &CacheCounts) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.fills += other.fills;
        self.evictions += other.evictions;
        self.bytes_copied += other.bytes_copied;
    }
}

impl LayerCacheCounters {
    pub fn counts(&self) -> CacheCounts {
        CacheCounts {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            fills: self.fills.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes_copied: self.bytes_copied.load(Ordering::Relaxed),
        }
    }
}

/// Every layer's counters; shared with the service (`/metrics`) and the exit summary.
#[derive(Debug)]
pub struct ExpertCacheCounters {
    /// Indexed by layer (dense layers stay zero).
    pub layers: Vec<LayerCacheCounters>,
    /// Fills per layer and step (0: `--moe-static-experts`).
    pub fills_per_layer: usize,
    /// Slots of each MoE layer that has slots.
    pub slots_per_layer: usize,
    /// Layers with slots.
    pub slot_layers: usize,
}

impl ExpertCacheCounters {
    /// Slots over all layers.
    pub fn total_slots(&self) -> usize {
        self.slots_per_layer * self.slot_layers
    }

    pub fn per_layer(&self) -> Vec<CacheCounts> {
        self.layers.iter().map(LayerCacheCounters::counts).collect()
    }

    pub fn total(&self) -> CacheCounts {
        let mut total = CacheCounts::default();
        for layer in &self.layers {
            total.add(&layer.counts());
        }
        total
    }

    /// One line for the log: totals, then each layer's hit rate.
    pub fn summary(&self) -> String {
        let total = self.total();
        let layers: Vec<String> = self
            .per_layer()
            .iter()
            .enumerate()
            .filter(|(_, counts)| counts.hits + counts.misses > 0)
            .map(|(layer, counts)| format!("{layer}:{:.1}%", 100.0 * counts.hit_rate()))
            .collect();
        let (upkeep_nanos, upkeeps) =
            self.layers
                .iter()
                .fold((0u64, 0u64), |(nanos, calls), layer| {
                    (
                        nanos + layer.upkeep_nanos.load(Ordering::Relaxed),
                        calls.max(layer.upkeeps.load(Ordering::Relaxed)),
                    )
                });
        // Static placement skips the step hook (nothing can change): no upkeep to report.
        let upkeep = if upkeeps == 0 {
            "no upkeep between steps".to_string()
        } else {
            format!(
                "upkeep between steps {:.1} µs per step over {upkeeps} steps",
                upkeep_nanos as f64 / 1e3 / upkeeps as f64
            )
        };
        format!(
            "{} slots per layer, {}: hit rate {:.1}% ({} hits, {} misses), {} fills, {} evictions, {:.1} MiB copied, {upkeep}; per layer {}",
            self.slots_per_layer,
            if self.fills_per_layer == 0 {
                "static placement".to_string()
            } else {
                format!("up to {} fills per layer and step", self.fills_per_layer)
            },
            100.0 * total.hit_rate(),
            total.hits,
            total.misses,
            total.fills,
            total.evictions,
            total.bytes_copied as f64 / (1 << 20) as f64,
            layers.join(" ")
        )
    }
}

/// The cache of one model: a policy per MoE layer and the counters.
pub struct ExpertCache {
    options: ExpertCacheOptions,
    /// Indexed by layer; `None` for layers without slots.
    policies: Mutex<Vec<Option<LayerCachePolicy>>>,
    counters: Arc<ExpertCacheCounters>,
    /// The next step's upkeep was done while the step before ran on the device
    /// ([`ExpertCache::mark_upkept_ahead`]).
    upkept_ahead: std::sync::atomic::AtomicBool,
    /// Per layer, the table the running step reads when an upkeep ahead already changed the
    /// layer's table for the next one: its routing is counted against what it used.
    running_step_tables: Mutex<Vec<Option<ExpertSlotTable>>>,
}

impl ExpertCache {
    /// A cache over `num_layers` layers of which those with `slot_layers[layer]` have slots,
    /// `slots_per_layer` each, scores seeded from `statistics`.
    pub fn new(
        options: ExpertCacheOptions,
        slot_layers: &[bool],
        slots_per_layer: usize,
        num_experts: usize,
        experts_per_token: usize,
        statistics: Option<&ExpertStatistics>,
    ) -> Self {
        let policies = slot_layers
            .iter()
            .enumerate()
            .map(|(layer, &has_slots)| {
                has_slots.then(|| {
                    let seed = statistics
                        .and_then(|statistics| statistics.counts.get(layer))
                        .map(Vec::as_slice);
                    LayerCachePolicy::new(
                        num_experts,
                        seed,
                        experts_per_token,
                        options.decay_per_token,
                    )
                    .with_eviction_margin(options.eviction_margin)
                })
            })
            .collect();
        ExpertCache {
            options,
            policies: Mutex::new(policies),
            counters: Arc::new(ExpertCacheCounters {
                layers: slot_layers
                    .iter()
                    .map(|_| LayerCacheCounters::default())
                    .collect(),
                fills_per_layer: options.fills_per_layer,
                slots_per_layer,
                slot_layers: slot_layers.iter().filter(|&&has| has).count(),
            }),
            upkept_ahead: std::sync::atomic::AtomicBool::new(false),
            running_step_tables: Mutex::new(vec![None; slot_layers.len()]),
        }
    }

    pub fn options(&self) -> ExpertCacheOptions {
        self.options
    }

    /// The upkeep for the next step is done (queued behind the running step).
    pub fn mark_upkept_ahead(&self) {
        self.upkept_ahead.store(true, Ordering::Release);
    }

    /// Whether the upkeep for this step was done ahead, clearing the mark. A step starts:
    /// the tables kept for the step before are dropped.
    pub fn take_upkept_ahead(&self) -> bool {
        if let Ok(mut tables) = self.running_step_tables.lock() {
            tables.iter_mut().for_each(|table| *table = None);
        }
        self.upkept_ahead.swap(false, Ordering::AcqRel)
    }

    /// The table layer `layer`'s running step reads, when an upkeep ahead has changed the
    /// layer's own since the step started; `None`: the layer's table is the one.
    pub fn table_of_running_step(&self, layer: usize) -> Option<ExpertSlotTable> {
        self.running_step_tables
            .lock()
            .ok()
            .and_then(|tables| tables.get(layer).cloned().flatten())
    }

    pub fn counters(&self) -> &Arc<ExpertCacheCounters> {
        &self.counters
    }

    /// Counts one layer call's routing against `table` (the slots the call used): a hit per
    /// routed choice of a resident expert, a miss per other choice, and the policy's scores.
    /// Layers without slots are not counted.
    pub fn observe(
        &self,
        layer: usize,
        expert_ids: &[u32],
        tokens: usize,
        table: Option<&ExpertSlotTable>,
    ) {
        let (Some(counters), Some(table)) = (self.counters.layers.get(layer), table) else {
            return;
        };
        let Ok(mut policies) = self.policies.lock() else {
            return;
        };
        let Some(Some(policy)) = policies.get_mut(layer) else {
            return;
        };
        let hits = expert_ids
            .iter()
            .filter(|&&id| table.is_resident(id as usize))
            .count() as u64;
        counters.hits.fetch_add(hits, Ordering::Relaxed);
        counters
            .misses
            .fetch_add(expert_ids.len() as u64 - hits, Ordering::Relaxed);
        policy.observe(expert_ids, tokens);
    }

    /// The hook at the start of every step for MoE layer `index`: enters the fills started at the previous hook in
    /// the table, then decides this layer's fills from the routing counted since and starts
    /// their copies. Nothing here waits for a copy started at this hook.
    ///
    /// `ahead`: the step the changes are for has not started, and the running one still reads
    /// the layer's current table, which is kept for counting its routing
    /// ([`ExpertCache::table_of_running_step`]).
    pub(crate) fn between_steps<Layer: CachedLayer>(
        &self,
        index: usize,
        layer: &Layer,
        artifact: &Arc<Artifact>,
        ahead: bool,
    ) -> Result<(), EngineError> {
        let started = std::time::Instant::now();
        let mut resident = layer.resident_slots_mut()?;
        let bank = layer.expert_bank();
        let Some(slots) = resident.as_mut() else {
            return Ok(());
        };
        // Every expert resident and nothing moving: no fill can be decided, and the step pays
        // nothing for the cache (all-GPU decode replays its graph at once).
        if slots.fills_in_flight() == 0 && slots.slot_table().every_expert_resident() {
            return Ok(());
        }
        // Static placement (no fills) with nothing in flight: the table never changes, so the
        // running step's copy, once kept, stays right and there is nothing to decide.
        let fixed = self.options.fills_per_layer == 0 && slots.fills_in_flight() == 0;
        if ahead {
            if let Ok(mut tables) = self.running_step_tables.lock() {
                if let Some(kept) = tables.get_mut(index) {
                    if !fixed || kept.is_none() {
                        *kept = Some(slots.slot_table().clone());
                    }
                }
            }
        }
        if fixed {
            return Ok(());
        }
        let Some(counters) = self.counters.layers.get(index) else {
            return Ok(());
        };
        // The policy decides on the table with the landed fills entered; the backend makes the
        // completions and the new fills one table update.
        let mut decided = Vec::new();
        let mut lock_failed = false;
        let mut decide = |table: &ExpertSlotTable| -> Vec<(usize, usize)> {
            let Ok(mut policies) = self.policies.lock() else {
                lock_failed = true;
                return Vec::new();
            };
            decided = match policies.get_mut(index) {
                Some(Some(policy)) => policy.decide(table, self.options.fills_per_layer),
                _ => Vec::new(),
            };
            decided
                .iter()
                .map(|fill| (fill.slot, fill.expert))
                .collect()
        };
        slots.refresh_fills(&mut decide, artifact, bank)?;
        if lock_failed {
            return Err(EngineError::InvalidConfig {
                problem: "the expert cache's lock is poisoned".into(),
            });
        }
        for fill in &decided {
            counters.fills.fetch_add(1, Ordering::Relaxed);
            counters
                .bytes_copied
                .fetch_add(bank.expert_stride, Ordering::Relaxed);
            if fill.evicted.is_some() {
                counters.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        counters.upkeep_nanos.fetch_add(
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        counters.upkeeps.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The routing of one MoE layer over a run, one entry per step: the expert ids of that step
/// (`tokens × experts_per_token`) and its token count.
pub type LayerRoutingTrace = Vec<(Vec<u32>, usize)>;

/// Hit rates of one layer's `trace` with `slots` slots: static placement (the `slots` experts
/// `seed` counts most, else the first ones) and the cache from that same placement, with the
/// engine's timing (fills decided after step `t`, resident from step `t + 2`).
pub fn simulate_hit_rates(
    trace: &LayerRoutingTrace,
    num_experts: usize,
    experts_per_token: usize,
    seed: Option<&[u64]>,
    slots: usize,
    options: ExpertCacheOptions,
) -> (CacheCounts, CacheCounts) {
    let slots = slots.min(num_experts);
    let start: Vec<u32> = match seed {
        Some(seed) => {
            ExpertStatistics {
                counts: vec![seed.to_vec()],
            }
            .placement(slots)
            .remove(0)
            .0
        }
        None => (0..slots as u32).collect(),
    };
    let run = |fills_per_layer: usize| {
        let mut table = ExpertSlotTable::new(num_experts, slots);
        for (slot, &expert) in start.iter().enumerate() {
            let _ = table.assign(slot, expert as usize);
        }
        let mut policy = LayerCachePolicy::new(
            num_experts,
            seed,
            experts_per_token,
            options.decay_per_token,
        )
        .with_eviction_margin(options.eviction_margin);
        let mut in_flight: Vec<SlotFill> = Vec::new();
        let mut counts = CacheCounts::default();
        for (ids, tokens) in trace {
            for fill in in_flight.drain(..) {
                let _ = table.assign(fill.slot, fill.expert);
            }
            for fill in policy.decide(&table, fills_per_layer) {
                table.clear(fill.slot);
                counts.fills += 1;
                counts.evictions += u64::from(fill.evicted.is_some());
                in_flight.push(fill);
            }
            let hits = ids
                .iter()
                .filter(|&&id| table.is_resident(id as usize))
                .count() as u64;
            counts.hits += hits;
            counts.misses += ids.len() as u64 - hits;
            policy.observe(ids, *tokens);
        }
        counts
    };
    (run(0), run(options.fills_per_layer))
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
        // Two tokens: × 0.25, then +1 per choice.
        assert_eq!(policy.score(0), 0.75 + 1.0);
        assert_eq!(policy.score(2), 2.0);
        assert_eq!(policy.score(1), 0.25);
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
    fn the_simulation_follows_the_engine_timing() {
        // One slot, expert 0 placed; the routing moves to expert 1 for good.
        let trace: LayerRoutingTrace = (0..6).map(|step| (vec![u32::from(step > 0)], 1)).collect();
        let options = ExpertCacheOptions {
            fills_per_layer: 1,
            decay_per_token: 0.5,
            eviction_margin: 0.0,
            ..ExpertCacheOptions::default()
        };
        let (fixed, cache) = simulate_hit_rates(&trace, 2, 1, None, 1, options);
        assert_eq!((fixed.hits, fixed.misses, fixed.fills), (1, 5, 0));
        // Step 1 misses expert 1; the fill is decided at the start of step 2 (the slot is empty
        // then: a miss), and expert 1 is resident from step 3 on.
        assert_eq!((cache.hits, cache.misses), (4, 2));
        assert_eq!((cache.fills, cache.evictions), (1, 1));
        assert!((cache.hit_rate() - 4.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn counters_sum_and_summarize() {
        let cache = ExpertCache::new(ExpertCacheOptions::default(), &[false, true], 1, 4, 2, None);
        let mut slots = ExpertSlotTable::new(4, 1);
        slots.assign(0, 2).unwrap();
        cache.observe(1, &[2, 3, 2, 0], 2, Some(&slots));
        cache.observe(0, &[2, 3], 1, Some(&slots));
        cache.observe(1, &[2, 3], 1, None);
        let total = cache.counters().total();
        assert_eq!((total.hits, total.misses), (2, 2));
        assert_eq!(cache.counters().per_layer()[0], CacheCounts::default());
        let summary = cache.counters().summary();
        assert!(summary.contains("hit rate 50.0%"), "{summary}");
        assert!(summary.contains("1:50.0%"), "{summary}");
    }
}
