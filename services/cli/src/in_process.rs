//! A model opened in this process, on the CPU or the GPU, for the commands that compute without
//! the serving processes (`perplexity`, `bench mtp`).
//!
//! Owns: choosing the backend (`--device`), the executor of the routed experts left on the CPU,
//! and how many experts per layer are resident on the GPU: the first N (`open`), or, for
//! `bench mtp`, the serving engine's placement options (`open_placed`: `--moe-gpu-experts
//! N|half|all|auto` within `--gpu-mem-budget`, the dynamic expert cache unless
//! `--moe-static-experts`). Must not touch: the serving processes (`serve`, `run`, `bench
//! MODEL` start those), model math, the placement arithmetic (`ninfer_engine::moe::placement`).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use ninfer_cpu_experts::KernelIsa;
use ninfer_engine::backend::cuda::CudaBackend;
use ninfer_engine::moe::expert_cache::{
    ExpertCacheCounters, ExpertCacheOptions, DEFAULT_FILLS_PER_LAYER,
};
use ninfer_engine::moe::placement::{
    choose_gpu_experts, expert_slot_budget, experts_per_layer, kv_cache_bytes, GpuExpertCount,
    GpuExpertShape, SlotMemoryBudget,
};
use ninfer_engine::moe::{KernelExpertExecutor, NoRoutedExperts};
use ninfer_engine::{open_artifact, CpuBackend, ExpertExecutor, Model, ReferenceExpertExecutor};

/// A model on one of the two backends; [`with_model!`] runs code generic over the backend.
pub enum InProcessModel {
    Cpu(Box<Model<CpuBackend>>),
    Cuda(Box<Model<CudaBackend>>),
}

/// Who computes the routed experts that are not on the GPU.
#[derive(Debug, Clone, Copy)]
pub enum CpuExperts {
    /// The f32 reference (exact; what the golden comparisons use).
    Reference,
    /// The SIMD kernels the expert workers run, on this many threads (0: every core).
    Kernels { threads: usize },
}

/// `--moe-gpu-experts` of the in-process commands: `all`, or N experts per layer (the first N).
pub fn parse_gpu_experts(value: &str) -> anyhow::Result<Option<usize>> {
    match value {
        "all" => Ok(None),
        number => number.parse::<usize>().map(Some).map_err(|_| {
            anyhow::anyhow!(
                "--moe-gpu-experts must be `all` or a number of experts per layer, got {value:?}"
            )
        }),
    }
}

/// Opens `path` on `device` (`cpu`, `cuda`, or `auto`: the GPU when one opens). On the GPU,
/// `gpu_experts` experts per layer (`None`: all) are made resident.
pub fn open(
    path: &Path,
    device: &str,
    cpu_experts: CpuExperts,
    gpu_experts: Option<usize>,
) -> anyhow::Result<InProcessModel> {
    let mut model = load(path, device, cpu_experts)?;
    if let InProcessModel::Cuda(model) = &mut model {
        let spec = model.spec().clone();
        let experts = spec.common.num_experts;
        let per_layer = gpu_experts.unwrap_or(experts).min(experts) as u32;
        if per_layer > 0 {
            // The decoder layers only: this command never drafts, so the MTP layer's experts
            // are never read and take no slot.
            let placement: Vec<Vec<u32>> = model
                .placement_layers()
                .into_iter()
                .take(spec.layers())
                .map(|moe| {
                    if moe {
                        (0..per_layer).collect()
                    } else {
                        Vec::new()
                    }
                })
                .collect();
            model
                .place_resident_experts(&placement)
                .context("placing routed experts on the GPU (lower --moe-gpu-experts)")?;
        }
    }
    Ok(model)
}

/// The serving engine's expert placement options, for a model opened in this process.
#[derive(Debug, Clone, Copy)]
pub struct PlacementRequest {
    /// `--moe-gpu-experts`.
    pub count: GpuExpertCount,
    /// `--gpu-mem-budget` in GiB.
    pub budget_gib: Option<f64>,
    /// `--moe-static-experts`: the slots keep the start-up placement.
    pub static_experts: bool,
    /// Longest context of the one sequence (its KV cache comes out of the budget).
    pub max_context: usize,
}

/// Where [`open_placed`] put the routed experts.
pub struct Placement {
    /// Experts per MoE layer in GPU slots (or host copies standing in for them on the CPU).
    pub gpu_experts_per_layer: usize,
    /// The expert cache's counters (`None` without slots); its `fills_per_layer` is 0 when the
    /// placement is static (asked for, or every expert resident).
    pub expert_cache: Option<Arc<ExpertCacheCounters>>,
}

/// Opens `path` on `device` and places routed experts as the serving engine does: `count` per
/// MoE layer within the memory left after the dense weights, one sequence's KV cache and the
/// working memory (on the CPU backend: no limit, the slots are host copies, for tests), then
/// the expert cache over them (moving unless `static_experts` or every expert is resident).
pub fn open_placed(
    path: &Path,
    device: &str,
    cpu_experts: CpuExperts,
    request: &PlacementRequest,
) -> anyhow::Result<(InProcessModel, Placement)> {
    let mut model = load(path, device, cpu_experts)?;
    let placement = match &mut model {
        InProcessModel::Cpu(model) => place(model, request, None)?,
        InProcessModel::Cuda(model) => {
            let memory = model
                .backend()
                .memory_info()
                .context("reading the GPU's free memory")?;
            place(model, request, Some(memory))?
        }
    };
    Ok((model, placement))
}

fn place<B: ninfer_engine::Backend>(
    model: &mut Model<B>,
    request: &PlacementRequest,
    device_memory: Option<(usize, usize)>,
) -> anyhow::Result<Placement> {
    let none = Placement {
        gpu_experts_per_layer: 0,
        expert_cache: None,
    };
    if request.count == GpuExpertCount::Count(0) {
        return Ok(none);
    }
    let common = model.spec().common.clone();
    let Some(expert_bytes) = model.expert_slot_bytes() else {
        return Ok(none);
    };
    // The MTP layer counts as one more MoE layer (placement_layers lists it last).
    let shape = GpuExpertShape {
        num_experts: common.num_experts,
        moe_layers: model.placement_layers(),
        expert_bytes,
    };
    // The engine's default KV element: bf16.
    let kv_element_bytes = 2;
    let budget = device_memory.map(|(free, total)| {
        expert_slot_budget(&SlotMemoryBudget {
            free_bytes: free as u64,
            total_bytes: total as u64,
            limit_gib: request.budget_gib,
            kv_cache_bytes: kv_cache_bytes(model.spec(), kv_element_bytes, request.max_context, 1),
            host_kv_bytes: 0,
        })
    });
    let per_layer = experts_per_layer(request.count, &shape, budget)
        .map_err(|problem| anyhow::anyhow!("--moe-gpu-experts {}: {problem}", request.count))?;
    if per_layer == 0 {
        return Ok(none);
    }
    model
        .place_resident_experts(&choose_gpu_experts(&shape, per_layer, None))
        .context("filling the GPU expert slots")?;
    let fills_per_layer = if request.static_experts || per_layer >= common.num_experts {
        0
    } else {
        DEFAULT_FILLS_PER_LAYER
    };
    let counters = model
        .enable_expert_cache(
            ExpertCacheOptions {
                fills_per_layer,
                ..ExpertCacheOptions::default()
            },
            None,
        )
        .context("starting the expert cache")?;
    Ok(Placement {
        gpu_experts_per_layer: per_layer,
        expert_cache: Some(counters),
    })
}

/// The model on its backend, every routed expert with the executor.
fn load(path: &Path, device: &str, cpu_experts: CpuExperts) -> anyhow::Result<InProcessModel> {
    let artifact = open_artifact(path).with_context(|| format!("loading {}", path.display()))?;
    let common = artifact.config().common();
    let has_moe_layers = common.num_experts > 0 && common.moe_layers.iter().any(|&moe| moe);
    let executor: Arc<dyn ExpertExecutor> = match cpu_experts {
        _ if !has_moe_layers => Arc::new(NoRoutedExperts),
        CpuExperts::Reference => Arc::new(ReferenceExpertExecutor::new(Arc::clone(&artifact))),
        CpuExperts::Kernels { threads } => {
            let threads = match threads {
                0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
                n => n,
            };
            Arc::new(
                KernelExpertExecutor::new(
                    Arc::clone(&artifact),
                    threads,
                    &[],
                    KernelIsa::best(),
                    4096,
                )
                .context("starting the CPU expert kernels")?,
            )
        }
    };
    let gpu = match device {
        "cpu" => None,
        "cuda" => Some(CudaBackend::new(0).context("--device cuda: cannot use the GPU")?),
        _ => match CudaBackend::new(0) {
            Ok(backend) => Some(backend),
            Err(error) => {
                tracing::warn!("--device auto: no usable GPU, computing on the CPU: {error}");
                None
            }
        },
    };
    let Some(gpu) = gpu else {
        return Ok(InProcessModel::Cpu(Box::new(Model::load(
            Arc::new(CpuBackend::new()),
            artifact,
            executor,
        )?)));
    };
    Ok(InProcessModel::Cuda(Box::new(Model::load(
        Arc::new(gpu),
        artifact,
        executor,
    )?)))
}

/// The tokenizer embedded in the artifact at `path` (`tokenizer.json`).
pub fn tokenizer<B: ninfer_engine::Backend>(
    model: &Model<B>,
    path: &Path,
) -> anyhow::Result<tokenizers::Tokenizer> {
    let json = model
        .artifact()
        .file("tokenizer.json")
        .with_context(|| format!("{} has no embedded tokenizer.json", path.display()))?;
    tokenizers::Tokenizer::from_bytes(json)
        .map_err(|e| anyhow::anyhow!("{}: invalid tokenizer.json: {e}", path.display()))
}

/// Runs `$body` with `$model` bound to the `Model<B>` inside an [`InProcessModel`].
macro_rules! with_model {
    ($in_process:expr, |$model:ident| $body:expr) => {
        match $in_process {
            $crate::in_process::InProcessModel::Cpu($model) => $body,
            $crate::in_process::InProcessModel::Cuda($model) => $body,
        }
    };
}
pub(crate) use with_model;
