//! A model opened in this process, on the CPU or the GPU, for the commands that compute without
//! the serving processes (`perplexity`, `bench mtp`).
//!
//! Owns: choosing the backend (`--device`), the executor of the routed experts left on the CPU,
//! and how many experts per layer are resident on the GPU. Must not touch: the serving
//! processes (`serve`, `run`, `bench MODEL` start those), model math.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use ninfer_cpu_experts::KernelIsa;
use ninfer_engine::backend::cuda::CudaBackend;
use ninfer_engine::moe::{KernelExpertExecutor, NoRoutedExperts};
use ninfer_engine::spec::FeedForwardKind;
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
    let mut model = Model::load(Arc::new(gpu), artifact, executor)?;
    let spec = model.spec().clone();
    let experts = spec.common.num_experts;
    let per_layer = gpu_experts.unwrap_or(experts).min(experts) as u32;
    if per_layer > 0 {
        let placement: Vec<Vec<u32>> = spec
            .feed_forwards
            .iter()
            .map(|kind| match kind {
                FeedForwardKind::Moe => (0..per_layer).collect(),
                FeedForwardKind::Dense => Vec::new(),
            })
            .collect();
        model
            .place_resident_experts(&placement)
            .context("placing routed experts on the GPU (lower --moe-gpu-experts)")?;
    }
    Ok(InProcessModel::Cuda(Box::new(model)))
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
