//! Starting a model split over pipeline stages: one backend per card of `--gpus` (or several on
//! one device, `--pipeline-stages-on-one-device`), each stage's layers (`--gpu-split`, else in
//! proportion to each card's usable memory, else equal), and each stage's expert slots for its
//! own MoE layers from the memory its card has left (the single-card rule, per stage). One
//! stage is the unsplit model and takes none of this.
//!
//! The split's decode steps go through step graphs spanning every stage (one recording, one
//! launch per replayed step; `Model`'s step graphs), the staged prefill route and layerwise
//! prefill run on every stage with its own staging slots, and the other non-resident experts
//! go to the expert executor as before.
//!
//! Owns: the stages' backends, layer ranges and expert placement. Must not touch: the model's
//! forward (library), the flags' checks (`gpu_choice.rs`).

use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, Context};
use ninfer_engine::backend::cuda::{CudaBackend, CudaOptions, PeerPath};
use ninfer_engine::backend::same_device::OpenOnSameDevice;
use ninfer_engine::moe::gpu_split::{layer_ranges, stage_host_kv_bytes};
use ninfer_engine::moe::placement::{
    choose_gpu_experts, expert_slot_budget, experts_per_layer, gib_to_bytes, kv_cache_bytes,
    GpuExpertCount, GpuExpertShape, SlotMemoryBudget, WORKING_MEMORY_BYTES,
};
use ninfer_engine::service::routing_stats::ExpertStatistics;
use ninfer_engine::{Backend, Model};

use crate::gpu_choice::GpuChoice;

/// What the stages' expert slots are asked for (the engine's `--moe-gpu-experts` and the
/// figures its memory budget reads).
pub(crate) struct StageExpertSlots<'a> {
    /// `--moe-gpu-experts`.
    pub(crate) count: GpuExpertCount,
    /// `--gpu-mem-budget` in GiB, of the whole card.
    pub(crate) budget_gib: Option<f64>,
    /// Routing statistics that rank the experts (`--moe-expert-stats`).
    pub(crate) statistics: Option<&'a ExpertStatistics>,
    /// Bytes of one cached key or value element.
    pub(crate) kv_element_bytes: u64,
    pub(crate) max_context: usize,
    pub(crate) max_sequences: usize,
    /// `--prefix-cache-gib` in bytes: its blocks are KV caches too.
    pub(crate) prefix_cache_bytes: u64,
    /// `--host-kv-mib` in bytes, over every stage (each holds its share of the pool).
    pub(crate) host_kv_bytes: u64,
    /// Whether the MTP head drafts (`--spec mtp`): its layer's experts then take slots on the
    /// last stage, beside the head; without drafting they are never read.
    pub(crate) speculating: bool,
}

/// The backends of a run's pipeline stages, in layer order.
pub(crate) struct StageBackends<B: Backend> {
    pub(crate) backends: Vec<Arc<B>>,
    /// `--gpu-split`.
    shares: Option<Vec<u64>>,
    /// Stages sharing each stage's device (`--pipeline-stages-on-one-device`, else 1).
    stages_per_device: usize,
    /// The flag that split the run, for messages.
    pub(crate) split_flag: String,
}

impl<B: Backend> StageBackends<B> {
    /// One stage: the unsplit model.
    pub(crate) fn is_split(&self) -> bool {
        self.backends.len() > 1
    }

    /// Each stage's decoder layers: by `--gpu-split`; else, for stages on cards of their own,
    /// in proportion to the memory each card offers (`memory`: free, or within
    /// `--gpu-mem-budget` less what is already used, as the planner counts it) less its
    /// working memory; else equal.
    pub(crate) fn layer_ranges(
        &self,
        layers: usize,
        memory: &impl Fn(&B) -> Option<(usize, usize)>,
        budget_gib: Option<f64>,
    ) -> anyhow::Result<Vec<Range<usize>>> {
        if !self.is_split() {
            return Ok(std::iter::once(0..layers).collect());
        }
        let by_memory = || -> Option<Vec<u64>> {
            if self.stages_per_device > 1 {
                return None;
            }
            self.backends
                .iter()
                .map(|backend| {
                    memory(backend).map(|(free, total)| {
                        let (free, total) = (free as u64, total as u64);
                        let offered = match budget_gib.map(gib_to_bytes) {
                            Some(cap) => cap.min(total).saturating_sub(total.saturating_sub(free)),
                            None => free,
                        };
                        offered.saturating_sub(WORKING_MEMORY_BYTES).max(1)
                    })
                })
                .collect()
        };
        let shares = match &self.shares {
            Some(shares) => shares.clone(),
            None => by_memory().unwrap_or_else(|| vec![1; self.backends.len()]),
        };
        layer_ranges(&shares, layers).with_context(|| format!("splitting with {}", self.split_flag))
    }
}

/// The CPU stages: `backend`, then one more independent CPU backend per further stage.
pub(crate) fn cpu_stages<B: OpenOnSameDevice>(
    backend: Arc<B>,
    choice: &GpuChoice,
) -> anyhow::Result<StageBackends<B>> {
    let mut backends = vec![Arc::clone(&backend)];
    for _ in 1..choice.stages_on_one_device {
        backends.push(Arc::new(backend.open_on_same_device()?));
    }
    Ok(StageBackends {
        backends,
        shares: choice.split.clone(),
        stages_per_device: choice.stages_on_one_device,
        split_flag: choice.split_flag(),
    })
}

/// The GPU stages: `first` (on the first card), then a backend on each further card of
/// `--gpus`, or further backends on the first card (`--pipeline-stages-on-one-device`).
pub(crate) fn cuda_stages(
    first: Arc<CudaBackend>,
    choice: &GpuChoice,
    options: CudaOptions,
) -> anyhow::Result<StageBackends<CudaBackend>> {
    let mut backends = vec![Arc::clone(&first)];
    for &ordinal in choice.ordinals.iter().skip(1) {
        let backend = CudaBackend::with_options(ordinal, options)
            .with_context(|| format!("{}: cannot open GPU {ordinal}", choice.split_flag()))?;
        backends.push(Arc::new(backend));
    }
    for _ in 1..choice.stages_on_one_device {
        backends.push(Arc::new(first.open_on_same_device().with_context(
            || format!("{}: opening another stage", choice.split_flag()),
        )?));
    }
    // The hidden state crosses from each stage to the next: card to card where they can.
    for (stage, pair) in backends.windows(2).enumerate() {
        let path = pair[0].enable_peer_access(&pair[1]).with_context(|| {
            format!(
                "{}: letting stages {stage} and {} reach each other",
                choice.split_flag(),
                stage + 1
            )
        })?;
        match path {
            PeerPath::SameContext => {}
            PeerPath::Direct => tracing::info!(
                "stages {stage} → {}: GPU {} to GPU {} by peer copies",
                stage + 1,
                pair[0].info().ordinal,
                pair[1].info().ordinal
            ),
            PeerPath::ThroughHost => tracing::warn!(
                "stages {stage} → {}: GPU {} and GPU {} have no peer access; each crossing is staged through host memory by the driver",
                stage + 1,
                pair[0].info().ordinal,
                pair[1].info().ordinal
            ),
        }
    }
    Ok(StageBackends {
        backends,
        shares: choice.split.clone(),
        stages_per_device: choice.stages_on_one_device,
        split_flag: choice.split_flag(),
    })
}

/// `--moe-gpu-experts` on a split model: each stage puts experts of its own MoE layers in its
/// slots, as many per layer as the count asks and its card's memory (less its layers' share
/// of the KV caches and its working memory) holds. Returns the fewest and the most per layer
/// over the stages.
pub(crate) fn place_gpu_experts_per_stage<B: Backend>(
    model: &mut Model<B>,
    request: &StageExpertSlots<'_>,
    stages: &StageBackends<B>,
    memory: &impl Fn(&B) -> Option<(usize, usize)>,
) -> anyhow::Result<(u32, u32)> {
    let num_experts = model.spec().common.num_experts;
    let Some(expert_bytes) = model.expert_slot_bytes() else {
        bail!("--moe-gpu-experts: the model has no routed experts");
    };
    // The decoder layers, then the MTP head's layer when the model has one.
    let mut moe_layers = model.placement_layers();
    if model.has_mtp() && !request.speculating {
        if let Some(mtp_layer) = moe_layers.get_mut(model.mtp_layer_index()) {
            *mtp_layer = false;
        }
    }
    let ranges = model.pipeline_stage_layers();
    let last_stage = ranges.len().saturating_sub(1);
    // A stage's placement layers: its decoder layers, and on the last stage the MTP layer.
    let stage_owns = |stage: usize, range: &Range<usize>, layer: usize| {
        range.contains(&layer) || (stage == last_stage && layer >= range.end)
    };
    let layers = moe_layers.len().max(1) as u64;
    // The prefix cache's blocks are KV caches too, spread over the stages as the layers are.
    let kv_bytes = kv_cache_bytes(
        model.spec(),
        request.kv_element_bytes,
        request.max_context,
        request.max_sequences,
    ) + request.prefix_cache_bytes;
    let sharing = stages.stages_per_device.max(1) as u64;
    let host_kv_shares =
        stage_host_kv_bytes(request.host_kv_bytes, &model.attention_layers_per_stage());
    let mut placement = vec![Vec::new(); moe_layers.len()];
    let (mut fewest, mut most) = (usize::MAX, 0);
    for (stage, (backend, range)) in stages.backends.iter().zip(&ranges).enumerate() {
        let shape = GpuExpertShape {
            num_experts,
            moe_layers: moe_layers
                .iter()
                .enumerate()
                .map(|(layer, &moe)| moe && stage_owns(stage, range, layer))
                .collect(),
            expert_bytes,
        };
        let budget = memory(backend).map(|(free, total)| {
            expert_slot_budget(&SlotMemoryBudget {
                free_bytes: free as u64 / sharing,
                total_bytes: total as u64 / sharing,
                limit_gib: request.budget_gib.map(|gib| gib / sharing as f64),
                kv_cache_bytes: kv_bytes * range.len() as u64 / layers,
                host_kv_bytes: host_kv_shares.get(stage).copied().unwrap_or(0),
            })
        });
        let per_layer = experts_per_layer(request.count, &shape, budget).map_err(|problem| {
            anyhow::anyhow!(
                "--moe-gpu-experts {} with {}: stage {stage} (layers {}..={}, {}): {problem}",
                request.count,
                stages.split_flag,
                range.start,
                range.end.saturating_sub(1),
                backend.name()
            )
        })?;
        let chosen = choose_gpu_experts(&shape, per_layer, request.statistics);
        for layer in (0..moe_layers.len()).filter(|&layer| stage_owns(stage, range, layer)) {
            if let (Some(slot), Some(experts)) = (placement.get_mut(layer), chosen.get(layer)) {
                slot.clone_from(experts);
            }
        }
        fewest = fewest.min(per_layer);
        most = most.max(per_layer);
        tracing::info!(
            stage,
            device = %backend.name(),
            first_layer = range.start,
            last_layer = range.end.saturating_sub(1),
            experts_per_layer = per_layer,
            "pipeline stage: expert slots of its own MoE layers"
        );
    }
    let report = model
        .place_resident_experts(&placement)
        .context("filling the expert slots of every stage")?;
    tracing::info!(
        layers = report.layers,
        mtp_layer_resident_experts = model.mtp_resident_experts(),
        gib = format!("{:.2}", report.bytes as f64 / (1u64 << 30) as f64),
        "GPU expert slots filled over the stages"
    );
    let clamp = |count: usize| u32::try_from(count).unwrap_or(u32::MAX);
    Ok((clamp(fewest.min(most)), clamp(most)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ninfer_engine::testing::golden_fixture_dir;
    use ninfer_engine::{open_artifact, CpuBackend, PipelineStage, ReferenceExpertExecutor};

    const GIB: usize = 1 << 30;

    /// On a split model that drafts, the MTP head's layer takes as many expert slots as every
    /// MoE layer, on the last stage; without drafting its experts are never read and take none.
    #[test]
    fn the_mtp_layer_takes_slots_on_the_last_stage_when_drafting() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("qwen3_5_moe.ninfer");
        let options = ninfer_convert::ConvertOptions {
            experts_dtype: ninfer_artifact::DType::F32,
            dense_dtype: ninfer_artifact::DType::F32,
            ..ninfer_convert::ConvertOptions::new(golden_fixture_dir("qwen3_5_moe"), &path)
        };
        ninfer_convert::convert_checkpoint(&options, &ninfer_convert::NoProgress).unwrap();
        for speculating in [false, true] {
            let artifact = open_artifact(&path).unwrap();
            let layers = artifact.config().common().num_hidden_layers;
            let backends = vec![Arc::new(CpuBackend::new()), Arc::new(CpuBackend::new())];
            let stages = StageBackends {
                backends: backends.clone(),
                shares: None,
                stages_per_device: 2,
                split_flag: "--pipeline-stages-on-one-device 2".into(),
            };
            let pipeline = PipelineStage::over(&backends, &[0..1, 1..layers]);
            let executor = Arc::new(ReferenceExpertExecutor::new(Arc::clone(&artifact)));
            let mut model = Model::load_pipeline(pipeline, artifact, executor, 0).unwrap();
            let request = StageExpertSlots {
                count: GpuExpertCount::Count(3),
                budget_gib: None,
                statistics: None,
                kv_element_bytes: 2,
                max_context: 256,
                max_sequences: 1,
                prefix_cache_bytes: 0,
                host_kv_bytes: 0,
                speculating,
            };
            let placed = place_gpu_experts_per_stage(&mut model, &request, &stages, &|_| None);
            assert_eq!(placed.unwrap(), (3, 3));
            let expected = if speculating { 3 } else { 0 };
            assert_eq!(model.mtp_resident_experts(), Some(expected));
        }
    }

    /// Two stages on cards of their own: by default the layers follow the memory each card
    /// offers (within `--gpu-mem-budget`, less working memory); `--gpu-split` overrides it;
    /// stages sharing one device split evenly.
    #[test]
    fn stage_layers_follow_the_cards_memory_the_budget_and_the_split() {
        let backends = vec![Arc::new(CpuBackend::new()), Arc::new(CpuBackend::new())];
        let first = Arc::clone(&backends[0]);
        // Card 0: 41 GiB free of 48; card 1: 21 GiB free of 24.
        let memory = |backend: &CpuBackend| {
            Some(match std::ptr::eq(backend, &*first) {
                true => (41 * GIB, 48 * GIB),
                false => (21 * GIB, 24 * GIB),
            })
        };
        let stages = |shares: Option<Vec<u64>>, stages_per_device: usize| StageBackends {
            backends: backends.clone(),
            shares,
            stages_per_device,
            split_flag: "--gpus 0,1".into(),
        };
        // 40 : 20 GiB after working memory.
        assert_eq!(
            stages(None, 1).layer_ranges(12, &memory, None).unwrap(),
            vec![0..8, 8..12]
        );
        // A 24 GiB budget: 24 − 7 − 1 = 16 against 24 − 3 − 1 = 20.
        let budgeted = stages(None, 1)
            .layer_ranges(18, &memory, Some(24.0))
            .unwrap();
        assert_eq!(budgeted, vec![0..8, 8..18]);
        assert_eq!(
            stages(Some(vec![25, 75]), 1)
                .layer_ranges(12, &memory, None)
                .unwrap(),
            vec![0..3, 3..12]
        );
        assert_eq!(
            stages(None, 2).layer_ranges(12, &memory, None).unwrap(),
            vec![0..6, 6..12]
        );
        assert_eq!(
            stages(None, 1).layer_ranges(12, &|_| None, None).unwrap(),
            vec![0..6, 6..12]
        );
        let error = stages(None, 1)
            .layer_ranges(1, &memory, None)
            .unwrap_err()
            .to_string();
        assert!(error.contains("--gpus 0,1"), "{error}");
    }
}
