//! The dynamic expert cache: GPU expert slots that follow the routing.
//!
//! Owns: the step hook that applies each MoE layer's policy to the model's slots
//! ([`ExpertCache::between_steps`]), the hit / miss / fill / eviction / byte counters, the
//! options, and [`simulate_hit_rates`], the same policy and timing on a recorded routing trace.
//! The policy itself, which missed expert earns a copy and which resident it replaces, is
//! [`crate::moe::cache_policy`] ([`LayerCachePolicy`]).
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
pub use crate::moe::cache_policy::{
    AdmissionRule, LayerCachePolicy, SlotFill, DEFAULT_COPY_SHARE_OF_STEP, DEFAULT_DECAY_PER_TOKEN,
    DEFAULT_FILL_COST_CHOICES, DEFAULT_SETTLED_DECAY_PER_TOKEN,
};
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

/// How the cache behaves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertCacheOptions {
    /// Fills per MoE layer and step; 0 keeps the start-up placement (`--moe-static-experts`),
    /// the counters still count.
    pub fills_per_layer: usize,
    /// Factor an expert's recent use count is multiplied by per routed token.
    pub decay_per_token: f64,
    /// Factor its settled use count (the longer horizon) is multiplied by per routed token.
    pub settled_decay_per_token: f64,
    /// How much more than a fill's cost (routed choices over the recent window) a missed
    /// expert must save over the resident one it would evict: against near ties, where two
    /// experts would take turns in a slot and every swap costs a copy and saves little.
    pub eviction_margin: f64,
    /// What a fill costs in routed choices the CPU would compute (the admission bar; 0: free).
    pub fill_cost_choices: f64,
    /// The share of a step the fills' copies may take, the step modelled by the CPU time of
    /// its missed experts (0: no copy budget beyond `fills_per_layer`).
    pub copy_share_of_step: f64,
    /// A long prompt streamed through layerwise prefill re-places each layer's slots from the
    /// staging slots its experts were streamed into (device copies, no PCIe), by the prompt's
    /// routing ([`LayerCachePolicy::place_from_staging`]). Only with fills (`fills_per_layer`
    /// above 0): static placement stays static.
    pub prompt_placement: bool,
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
            settled_decay_per_token: DEFAULT_SETTLED_DECAY_PER_TOKEN,
            eviction_margin: DEFAULT_EVICTION_MARGIN,
            fill_cost_choices: DEFAULT_FILL_COST_CHOICES,
            copy_share_of_step: DEFAULT_COPY_SHARE_OF_STEP,
            prompt_placement: true,
            upkeep_during_steps: true,
        }
    }
}

impl ExpertCacheOptions {
    /// The admission rule every layer's policy follows.
    pub fn admission_rule(&self) -> AdmissionRule {
        AdmissionRule {
            recent_decay_per_token: self.decay_per_token,
            settled_decay_per_token: self.settled_decay_per_token,
            fill_cost_choices: self.fill_cost_choices,
            margin: self.eviction_margin,
            fill_credit_per_miss: AdmissionRule::fill_credit_per_miss(
                self.copy_share_of_step,
                self.fill_cost_choices,
            ),
        }
    }

    /// The options of the policy before the fill's cost, the settled horizon and the copy
    /// budget: one horizon, a plain margin.
    pub fn single_horizon(self) -> Self {
        ExpertCacheOptions {
            settled_decay_per_token: self.decay_per_token,
            fill_cost_choices: 0.0,
            copy_share_of_step: 0.0,
            ..self
        }
    }
}

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
    /// Experts a long prompt moved from layerwise prefill's staging slots into resident slots
    /// (device copies: neither in `fills` nor in `bytes_copied`).
    pub staging_fills: AtomicU64,
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
        let staging_fills: u64 = self
            .layers
            .iter()
            .map(|layer| layer.staging_fills.load(Ordering::Relaxed))
            .sum();
        format!(
            "{} slots per layer, {}: hit rate {:.1}% ({} hits, {} misses), {} fills, {} evictions, {:.1} MiB copied, {staging_fills} placed from prefill staging, {upkeep}; per layer {}",
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
    running_step_tables: Mutex<RunningStepTables>,
}

/// The tables kept for the running step ([`ExpertCache::table_of_running_step`]).
#[derive(Default)]
struct RunningStepTables {
    /// Indexed by layer; `None`: the layer's own table is the one.
    tables: Vec<Option<Arc<ExpertSlotTable>>>,
    /// Whether any is kept (a step start that finds none has nothing to drop).
    any: bool,
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
                    LayerCachePolicy::with_rule(
                        num_experts,
                        seed,
                        experts_per_token,
                        options.admission_rule(),
                    )
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
            running_step_tables: Mutex::new(RunningStepTables {
                tables: vec![None; slot_layers.len()],
                any: false,
            }),
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
        if let Ok(mut kept) = self.running_step_tables.lock() {
            if std::mem::take(&mut kept.any) {
                kept.tables.iter_mut().for_each(|table| *table = None);
            }
        }
        self.upkept_ahead.swap(false, Ordering::AcqRel)
    }

    /// The table layer `layer`'s running step reads, when an upkeep ahead has changed the
    /// layer's own since the step started; `None`: the layer's table is the one.
    pub fn table_of_running_step(&self, layer: usize) -> Option<Arc<ExpertSlotTable>> {
        let kept = self.running_step_tables.lock().ok()?;
        if !kept.any {
            return None;
        }
        kept.tables.get(layer).cloned().flatten()
    }

    fn keep_running_step_table(&self, layer: usize, table: Arc<ExpertSlotTable>) {
        if let Ok(mut kept) = self.running_step_tables.lock() {
            if let Some(entry) = kept.tables.get_mut(layer) {
                *entry = Some(table);
                kept.any = true;
            }
        }
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

    /// Right after a layerwise prefill chunk's routing of MoE layer `index` was counted, while
    /// its streamed experts sit in `staging` (`staged`: (expert, staging slot) pairs): moves
    /// the experts the prompt uses more than residents into the layer's slots by device copies
    /// ([`ExpertSlotFills::copy_from_slots`]), queued before anything reuses the staging slots.
    /// A pure function of the routing, as every other decision of the cache.
    pub(crate) fn place_from_staging<Layer: CachedLayer>(
        &self,
        index: usize,
        layer: &Layer,
        staging: &Layer::Slots,
        staged: &[(usize, usize)],
    ) -> Result<(), EngineError> {
        if !self.options.prompt_placement || self.options.fills_per_layer == 0 || staged.is_empty()
        {
            return Ok(());
        }
        let Some(counters) = self.counters.layers.get(index) else {
            return Ok(());
        };
        let mut resident = layer.resident_slots_mut()?;
        let Some(slots) = resident.as_mut() else {
            return Ok(());
        };
        // The decision sees the table with the fills in flight entered.
        slots.complete_fills()?;
        let experts: Vec<usize> = staged.iter().map(|&(expert, _)| expert).collect();
        let fills = {
            let mut policies = self
                .policies
                .lock()
                .map_err(|_| EngineError::InvalidConfig {
                    problem: "the expert cache's lock is poisoned".into(),
                })?;
            match policies.get_mut(index) {
                Some(Some(policy)) => policy.place_from_staging(slots.slot_table(), &experts),
                _ => return Ok(()),
            }
        };
        if fills.is_empty() {
            return Ok(());
        }
        let pairs: Vec<(usize, usize)> = fills
            .iter()
            .filter_map(|fill| {
                staged
                    .iter()
                    .find(|&&(expert, _)| expert == fill.expert)
                    .map(|&(_, staging_slot)| (fill.slot, staging_slot))
            })
            .collect();
        slots.copy_from_slots(&pairs, staging)?;
        counters
            .staging_fills
            .fetch_add(pairs.len() as u64, Ordering::Relaxed);
        counters.evictions.fetch_add(
            fills.iter().filter(|fill| fill.evicted.is_some()).count() as u64,
            Ordering::Relaxed,
        );
        Ok(())
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
        // running step reads the layer's own and there is nothing to decide.
        if self.options.fills_per_layer == 0 && slots.fills_in_flight() == 0 {
            return Ok(());
        }
        let Some(counters) = self.counters.layers.get(index) else {
            return Ok(());
        };
        // The policy decides on the table with the landed fills entered; the backend makes the
        // completions and the new fills one table update. Ahead of a step, the running step's
        // table is kept for counting its routing, but only when this hook changes it:
        // completions change it before the decision, fills after.
        let mut kept =
            (ahead && slots.fills_in_flight() > 0).then(|| Arc::new(slots.slot_table().clone()));
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
            if ahead && kept.is_none() && !decided.is_empty() {
                kept = Some(Arc::new(table.clone()));
            }
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
        if let Some(kept) = kept {
            self.keep_running_step_table(index, kept);
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
/// engine's timing (fills decided after step `t`, resident from step `t + 2`). Steps of at
/// least `layerwise_min_tokens` tokens are prompts streamed layerwise: with
/// `options.prompt_placement` the cache re-places the slots right after counting them, every
/// non-resident expert being in the staging slots.
pub fn simulate_hit_rates(
    trace: &[(Vec<u32>, usize)],
    num_experts: usize,
    experts_per_token: usize,
    seed: Option<&[u64]>,
    slots: usize,
    options: ExpertCacheOptions,
    layerwise_min_tokens: Option<usize>,
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
        let mut policy = LayerCachePolicy::with_rule(
            num_experts,
            seed,
            experts_per_token,
            options.admission_rule(),
        );
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
            let layerwise = layerwise_min_tokens.is_some_and(|min| *tokens >= min.max(1));
            if layerwise && options.prompt_placement && fills_per_layer > 0 {
                // The engine enters the fills in flight before it decides.
                for fill in in_flight.drain(..) {
                    let _ = table.assign(fill.slot, fill.expert);
                }
                let staged: Vec<usize> = (0..num_experts)
                    .filter(|&expert| !table.is_resident(expert))
                    .collect();
                for fill in policy.place_from_staging(&table, &staged) {
                    let _ = table.assign(fill.slot, fill.expert);
                    counts.evictions += u64::from(fill.evicted.is_some());
                }
            }
        }
        counts
    };
    (run(0), run(options.fills_per_layer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_simulation_follows_the_engine_timing() {
        // One slot, expert 0 placed; the routing moves to expert 1 for good.
        let trace: LayerRoutingTrace = (0..6).map(|step| (vec![u32::from(step > 0)], 1)).collect();
        let options = ExpertCacheOptions {
            fills_per_layer: 1,
            decay_per_token: 0.5,
            eviction_margin: 0.0,
            ..ExpertCacheOptions::default()
        }
        .single_horizon();
        let (fixed, cache) = simulate_hit_rates(&trace, 2, 1, None, 1, options, None);
        assert_eq!((fixed.hits, fixed.misses, fixed.fills), (1, 5, 0));
        // Step 1 misses expert 1; the fill is decided at the start of step 2 (the slot is empty
        // then: a miss), and expert 1 is resident from step 3 on.
        assert_eq!((cache.hits, cache.misses), (4, 2));
        assert_eq!((cache.fills, cache.evictions), (1, 1));
        assert!((cache.hit_rate() - 4.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn a_simulated_long_prompt_places_the_slots_at_once() {
        // One slot, expert 0 placed; a 4-token prompt routes to expert 1 only, then decode
        // steps keep to expert 1. Streamed layerwise (from 4 tokens), the prompt puts expert 1
        // in the slot by itself: every decode step hits, and no fill crosses the bus.
        let mut trace: LayerRoutingTrace = vec![(vec![1; 4], 4)];
        trace.extend((0..5).map(|_| (vec![1], 1)));
        let options = ExpertCacheOptions {
            fills_per_layer: 1,
            ..ExpertCacheOptions::default()
        };
        let (_, placed) = simulate_hit_rates(&trace, 2, 1, None, 1, options, Some(4));
        assert_eq!((placed.hits, placed.misses), (5, 4));
        assert_eq!((placed.fills, placed.evictions), (0, 1));
        // Below the layerwise threshold, or with prompt placement off, the fills must do it.
        let (_, short) = simulate_hit_rates(&trace, 2, 1, None, 1, options, Some(5));
        let off = ExpertCacheOptions {
            prompt_placement: false,
            ..options
        };
        let (_, unplaced) = simulate_hit_rates(&trace, 2, 1, None, 1, off, Some(4));
        assert_eq!(short, unplaced);
        assert!(short.hits < placed.hits, "{short:?}");
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
