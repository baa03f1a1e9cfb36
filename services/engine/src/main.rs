//! `ninfer-engine`: the engine process. Loads the model, computes routed experts in-process or
//! through CPU expert workers (`--experts`), and serves the gateway's gRPC API.
//!
//! Owns: process start-up and shutdown, the routing-statistics file (the flags are `args.rs`).
//! Must not touch: model math (library), HTTP (gateway).

mod args;
mod gpu_choice;
mod pipeline_start;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use ninfer_cpu_experts::KernelIsa;
use ninfer_engine::backend::cuda::{CudaBackend, CudaOptions, KvDtype};
use ninfer_engine::backend::{DeviceKvShare, HostKvRequest};
use ninfer_engine::moe::expert_cache::{
    ExpertCacheCounters, ExpertCacheOptions, DEFAULT_FILLS_PER_LAYER,
};
use ninfer_engine::moe::placement::{
    choose_gpu_experts, expert_slot_budget, experts_per_layer, gib_to_bytes, kv_cache_bytes,
    GpuExpertCount, GpuExpertShape, SlotMemoryBudget,
};
use ninfer_engine::moe::worker_executor::ControlSecret;
use ninfer_engine::moe::{
    ExpertExecutor, KernelExpertExecutor, NoRoutedExperts, WorkerExpertExecutor,
    WorkerExpertExecutorOptions,
};
use ninfer_engine::prefix_cache::PrefixCacheSettings;
use ninfer_engine::profile::ForwardProfile;
use ninfer_engine::service::images::{ImageEncoding, TowerDevice};
use ninfer_engine::service::routing_stats::{CountingExecutor, ExpertStatistics, RoutingCounters};
use ninfer_engine::service::scheduler::{
    self, SchedulerCommand, SchedulerCounters, SchedulerLimits, SpeculativeDecoding,
    MAX_DRAFT_TOKENS,
};
use ninfer_engine::service::{
    AlwaysReady, DeviceBandwidthProbe, EngineService, Profiling, Readiness,
};
use ninfer_engine::{
    open_artifact, Backend, CpuBackend, Model, PipelineStage, PrefillStagingOptions,
};
use ninfer_protocol::v1::engine_server::EngineServer;

use args::{cuda_options, Args, Device, Speculation};

/// A way of drafting tokens for speculative decoding.
fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    init_logging(args.log_json);
    // Segments of engines killed outright (their pid is gone) would stay in /dev/shm for good.
    let stale = ninfer_channel::remove_stale_segments("ninfer");
    if stale > 0 {
        tracing::info!(
            segments = stale,
            "removed shared-memory segments of engines that no longer run"
        );
    }
    let result = run(args);
    // Every way out unlinks this engine's channel segments: threads still hold the channels,
    // so their own drop would never run.
    ninfer_channel::unlink_created_segments();
    result
}

fn run(args: Args) -> anyhow::Result<()> {
    let control_secret = ninfer_protocol::control_secret::load(args.control_secret_file.as_deref())
        .context("--control-secret-file")?;
    const ENGINE_REACH: &str = "generate, cancel and read the model files";
    ninfer_protocol::control_secret::check_listen(
        &args.listen,
        control_secret.is_some(),
        args.insecure_listen,
        ENGINE_REACH,
    )?;
    if control_secret.is_none() && !args.listen.starts_with("unix:") {
        tracing::warn!(listen = %args.listen, "the engine listens on TCP without a control secret: anyone who reaches the port can {ENGINE_REACH} (prefer --listen unix:PATH, or set --control-secret-file)");
    }
    // The GPU is opened before anything else is loaded, so `--device cuda` fails fast.
    let gpu_choice = gpu_choice::chosen_gpus(&args)?;
    let device = select_device(
        args.device,
        gpu_choice.first_ordinal(),
        args.kv_dtype,
        cuda_options(&args),
    )?;
    let artifact =
        open_artifact(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let speculation = speculation_of(&args, &artifact)?;
    let common = artifact.config().common().clone();
    let model_name = args.model_name.clone().unwrap_or_else(|| {
        args.model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let max_context = args
        .max_context
        .unwrap_or(common.max_position_embeddings.min(8192));
    if max_context == 0 || max_context > common.max_position_embeddings {
        bail!(
            "--max-context {max_context} must be in 1..={}",
            common.max_position_embeddings
        );
    }
    let routing = Arc::new(RoutingCounters::new(
        common.num_hidden_layers,
        common.num_experts,
    ));
    let statistics = match &args.moe_expert_stats {
        Some(path) => Some(
            ExpertStatistics::load(path, common.num_hidden_layers, common.num_experts)
                .map_err(|problem| anyhow::anyhow!("--moe-expert-stats: {problem}"))?,
        ),
        None => None,
    };
    let has_moe_layers = common.num_experts > 0 && common.moe_layers.iter().any(|&moe| moe);
    if has_moe_layers && args.dense_mlp_offload_layers > 0 {
        bail!(
            "--dense-mlp-offload-layers: only a model without MoE layers offloads its dense MLPs"
        );
    }
    // What the executor serves: routed experts, or a dense model's offloaded MLPs (one expert
    // per layer, routing weight 1).
    let offloads_dense_mlps = args.dense_mlp_offload_layers > 0;
    let (served_experts, served_top_k) = if offloads_dense_mlps {
        (1, 1)
    } else {
        (common.num_experts, common.num_experts_per_tok)
    };
    let (experts, readiness): (Arc<dyn ExpertExecutor>, Arc<dyn Readiness>) =
        if !has_moe_layers && !offloads_dense_mlps {
            if !args.experts.is_empty() {
                tracing::warn!("--experts: the model has no routed experts; the workers go unused");
            }
            (Arc::new(NoRoutedExperts), Arc::new(AlwaysReady))
        } else if args.experts.is_empty() {
            let isa = match &args.kernel_isa {
                Some(name) => name
                    .parse::<KernelIsa>()
                    .map_err(|e| anyhow::anyhow!("--kernel-isa: {e}"))?,
                None => KernelIsa::best(),
            };
            let threads = if args.moe_threads == 0 {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            } else {
                args.moe_threads
            };
            let executor = KernelExpertExecutor::new(
                Arc::clone(&artifact),
                threads,
                &[],
                isa,
                args.channel_max_tokens,
            )?;
            (Arc::new(executor), Arc::new(AlwaysReady))
        } else {
            let remote = Arc::new(WorkerExpertExecutor::start(WorkerExpertExecutorOptions {
                addresses: args.experts.clone(),
                model_id: artifact.model_id(),
                hidden_size: common.hidden_size,
                num_experts: served_experts,
                top_k: served_top_k,
                max_tokens_per_request: args.channel_max_tokens,
                hang_timeout: Duration::from_millis(args.worker_hang_ms),
                worker_timeout: Duration::from_secs_f64(args.worker_timeout.max(0.0)),
                control_secret: control_secret.clone().map(ControlSecret::new),
            })?);
            (
                Arc::clone(&remote) as Arc<dyn ExpertExecutor>,
                remote as Arc<dyn Readiness>,
            )
        };
    let expert_executor = experts.name().to_string();
    let counting = Arc::new(CountingExecutor {
        inner: experts,
        counters: Arc::clone(&routing),
    });
    let limits = SchedulerLimits {
        max_context,
        max_sequences: args.max_sequences.max(1),
        prefill_chunk_tokens: args.prefill_chunk_tokens,
        prefill_time_share: args.prefill_time_share,
    };
    let scheduler_counters = Arc::new(SchedulerCounters::default());
    let exit_counters = Arc::clone(&scheduler_counters);
    if !(args.prefix_cache_gib.is_finite() && args.prefix_cache_gib >= 0.0) {
        bail!(
            "--prefix-cache-gib {}: give a number of GiB, 0 or more",
            args.prefix_cache_gib
        );
    }
    if !(args.moe_prefill_cpu_rate_share.is_finite() && args.moe_prefill_cpu_rate_share >= 0.0) {
        bail!(
            "--moe-prefill-cpu-rate-share {}: give a share of the measured rate, 0 or more",
            args.moe_prefill_cpu_rate_share
        );
    }
    let prefix_cache = PrefixCacheSettings::with_budget(gib_to_bytes(args.prefix_cache_gib));
    let host_kv_bytes = args
        .host_kv_mib
        .checked_mul(1 << 20)
        .with_context(|| format!("--host-kv-mib {} is too large", args.host_kv_mib))?;
    let host_kv = HostKvRequest {
        host_bytes: host_kv_bytes,
        device_share: DeviceKvShare::Auto {
            budget_bytes: args.gpu_mem_budget.map(gib_to_bytes),
        },
    };
    let gpu_experts = GpuExpertsRequest {
        dense_mlp_offload_layers: args.dense_mlp_offload_layers,
        count: args.moe_gpu_experts,
        budget_gib: args.gpu_mem_budget,
        statistics,
        kv_element_bytes: if args.kv_dtype == Some(KvDtype::F32) {
            4
        } else {
            2
        },
        limits,
        speculation,
        prefill_staging_min_tokens: args.moe_prefill_gpu_min_tokens,
        layerwise_min_tokens: args.moe_prefill_layerwise_min_tokens,
        cpu_rate_share: args.moe_prefill_cpu_rate_share,
        host_kv,
        prefix_cache,
        cache_fills_per_layer: default_cache_fills(
            args.moe_static_experts,
            args.moe_cache_fills_per_layer,
            args.moe_expert_stats.is_some(),
        ),
        cache_eviction_margin: args.moe_cache_eviction_margin,
        cache_fill_cost: args.moe_cache_fill_cost,
        cache_upkeep_during_steps: args.moe_cache_upkeep_during_steps,
        cache_prompt_placement: args.moe_cache_prompt_placement,
    };
    let tower_device = match &device {
        SelectedDevice::Cpu => TowerDevice::Host,
        SelectedDevice::Cuda(backend) => TowerDevice::Cuda {
            ordinal: backend.info().ordinal,
            options: backend.options(),
        },
    };
    let (started, (device_name, device_bandwidth)) = match device {
        SelectedDevice::Cpu => {
            if args.moe_gpu_experts != GpuExpertCount::Count(0) {
                tracing::warn!("--moe-gpu-experts on the CPU backend keeps copies of those experts in host memory (useful for tests only)");
            }
            let backend = Arc::new(CpuBackend::new());
            let started = start_scheduler(
                pipeline_start::cpu_stages(backend, &gpu_choice)?,
                &artifact,
                counting,
                &GpuExpertsRequest {
                    prefill_staging_min_tokens: 0,
                    layerwise_min_tokens: 0,
                    ..gpu_experts
                },
                |_| None,
                &*readiness,
                &scheduler_counters,
            )?;
            (started, ("cpu", None))
        }
        SelectedDevice::Cuda(backend) => {
            let probed = Arc::clone(&backend);
            let probe: DeviceBandwidthProbe = Box::new(move || {
                probed
                    .measure_copy_bandwidth()
                    .map_err(|error| error.to_string())
            });
            let stages = pipeline_start::cuda_stages(backend, &gpu_choice, cuda_options(&args))?;
            let started = start_scheduler(
                stages,
                &artifact,
                counting,
                &gpu_experts,
                |backend: &CudaBackend| backend.memory_info().ok(),
                &*readiness,
                &scheduler_counters,
            )?;
            (started, ("cuda", Some(probe)))
        }
    };
    let started_cache = started.expert_cache.clone();
    let created_unix_seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let service = EngineService {
        artifact: Arc::clone(&artifact),
        model_name: model_name.clone(),
        instance_id: format!(
            "{:016x}",
            created_unix_seconds.rotate_left(20) ^ u64::from(std::process::id())
        ),
        created_unix_seconds,
        limits,
        scheduler: Mutex::new(started.sender),
        scheduler_counters,
        routing: Arc::clone(&routing),
        readiness,
        guidance: Default::default(),
        profiling: Profiling {
            counters: started.profile,
            device: device_name.into(),
            expert_stride_bytes: started.expert_stride_bytes,
            gpu_experts_per_layer: started.gpu_experts_per_layer,
            expert_executor,
            device_bandwidth,
            expert_cache: started.expert_cache.clone(),
            prefill_throughputs: started.prefill_throughputs,
        },
        sequence_permits: Arc::new(tokio::sync::Semaphore::new(limits.max_sequences)),
        images: ImageEncoding::for_artifact(&artifact)
            .context("reading the vision tower's settings")?
            .map(|images| Arc::new(images.on_device(tower_device))),
        token_socket_path: ninfer_protocol::token_socket::path_beside(&args.listen),
    };
    tracing::info!(model = %args.model.display(), name = %model_name, listen = %args.listen, max_context, "engine ready");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the gRPC runtime")?;
    let stats_file = args.moe_record_stats.clone();
    if let Some(path) = stats_file.clone() {
        let (routing, name) = (Arc::clone(&routing), model_name.clone());
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                if let Err(error) = routing.write_file(&path, &name) {
                    tracing::warn!(file = %path.display(), "cannot write routing statistics: {error}");
                }
            }
        });
    }
    let served = runtime.block_on(serve(&args.listen, service, control_secret));
    // Connection tasks and blocking calls left after the drain must not hold the exit.
    runtime.shutdown_timeout(Duration::from_millis(100));
    if let Some(cache) = &started_cache {
        tracing::info!("expert cache: {}", cache.summary());
    }
    exit_counters.log_speculation_summary();
    served?;
    if let Some(path) = stats_file {
        routing
            .write_file(&path, &model_name)
            .with_context(|| format!("writing routing statistics to {}", path.display()))?;
    }
    Ok(())
}

/// `--spec mtp --draft-tokens N`, checked against the artifact: a clear error for a model
/// without an MTP head.
fn speculation_of(
    args: &Args,
    artifact: &ninfer_artifact::Artifact,
) -> anyhow::Result<SpeculativeDecoding> {
    let Some(Speculation::Mtp) = args.spec else {
        return Ok(SpeculativeDecoding::default());
    };
    if !(1..=MAX_DRAFT_TOKENS).contains(&args.draft_tokens) {
        bail!(
            "--draft-tokens {}: give 1..={MAX_DRAFT_TOKENS}",
            args.draft_tokens
        );
    }
    if artifact.get("mtp.fc").is_none() {
        bail!(
            "--spec mtp: {} has no MTP head (no `mtp.*` tensors); drop --spec, or convert a checkpoint that has one",
            args.model.display()
        );
    }
    Ok(SpeculativeDecoding {
        max_draft_tokens: args.draft_tokens,
    })
}

/// Where the dense layers run, decided once at start-up.
enum SelectedDevice {
    Cpu,
    Cuda(Arc<CudaBackend>),
}

/// Fills per layer and step of the dynamic expert cache: 0 (static placement) with
/// `--moe-static-experts`; else the number asked for; else, by measurement, static placement
/// where routing statistics place the experts and [`DEFAULT_FILLS_PER_LAYER`] where none do.
fn default_cache_fills(static_experts: bool, asked: Option<usize>, has_statistics: bool) -> usize {
    match (static_experts, asked) {
        (true, _) => 0,
        (false, Some(fills)) => fills,
        (false, None) if has_statistics => 0,
        (false, None) => DEFAULT_FILLS_PER_LAYER,
    }
}

/// `cpu`: the CPU. `cuda`: GPU `ordinal` or a clear error naming what was looked for (driver,
/// NVRTC, device). `auto`: GPU `ordinal` when it opens, else the CPU with a warning saying why.
fn select_device(
    device: Device,
    ordinal: usize,
    kv_dtype: Option<KvDtype>,
    options: CudaOptions,
) -> anyhow::Result<SelectedDevice> {
    let cpu = || {
        if kv_dtype == Some(KvDtype::Bf16) {
            tracing::warn!("--kv-dtype bf16 is for the GPU; the CPU backend keeps an f32 KV cache");
        }
        Ok(SelectedDevice::Cpu)
    };
    match device {
        Device::Cpu => cpu(),
        Device::Cuda => {
            let backend = CudaBackend::with_options(ordinal, options).context(
                "--device cuda: cannot use the GPU (use --device cpu, or --device auto to fall back)",
            )?;
            log_gpu(&backend);
            Ok(SelectedDevice::Cuda(Arc::new(backend)))
        }
        Device::Auto => match CudaBackend::with_options(ordinal, options) {
            Ok(backend) => {
                log_gpu(&backend);
                Ok(SelectedDevice::Cuda(Arc::new(backend)))
            }
            Err(error) => {
                tracing::warn!("--device auto: no usable GPU, running on the CPU: {error}");
                cpu()
            }
        },
    }
}

fn log_gpu(backend: &CudaBackend) {
    let info = backend.info();
    tracing::info!(
        gpu = %info.name,
        arch = format!("sm_{}{}", info.compute_capability.0, info.compute_capability.1),
        driver = info.driver_version,
        nvrtc = format!("{}.{} ({})", info.nvrtc_version.0, info.nvrtc_version.1, info.nvrtc_library),
        kernels_cached = info.kernels_cached,
        kernels_compiled = info.kernels_compiled,
        cublas = info.cublas_library.as_deref().unwrap_or("off (the matmul kernel does every GEMM)"),
        kv_dtype = %info.kv_dtype,
        programmatic_dependent_launch = info.programmatic_dependent_launch,
        "dense layers on the GPU"
    );
}

/// What `--moe-gpu-experts` and its companions ask for.
struct GpuExpertsRequest {
    /// `--dense-mlp-offload-layers`.
    dense_mlp_offload_layers: usize,
    count: GpuExpertCount,
    budget_gib: Option<f64>,
    statistics: Option<ExpertStatistics>,
    /// Bytes of one cached key or value element (`--kv-dtype`).
    kv_element_bytes: u64,
    limits: SchedulerLimits,
    /// `--spec mtp --draft-tokens N`.
    speculation: SpeculativeDecoding,
    /// `--moe-prefill-gpu-min-tokens` (0: off; always off on the CPU backend).
    prefill_staging_min_tokens: usize,
    /// `--moe-prefill-layerwise-min-tokens` (0: off; always off on the CPU backend).
    layerwise_min_tokens: usize,
    /// `--moe-prefill-cpu-rate-share`.
    cpu_rate_share: f64,
    /// `--host-kv-mib`: KV caches that may live in host memory instead (each stage of a split
    /// its share).
    host_kv: HostKvRequest,
    /// `--prefix-cache-gib`.
    prefix_cache: PrefixCacheSettings,
    /// `--moe-cache-fills-per-layer`, 0 with `--moe-static-experts`.
    cache_fills_per_layer: usize,
    cache_eviction_margin: f64,
    /// `--moe-cache-fill-cost`.
    cache_fill_cost: f64,
    cache_upkeep_during_steps: bool,
    cache_prompt_placement: bool,
}

/// A started scheduler and what `GetProfile` reports about its model.
struct StartedScheduler {
    sender: std::sync::mpsc::Sender<SchedulerCommand>,
    profile: Arc<ForwardProfile>,
    expert_stride_bytes: u64,
    gpu_experts_per_layer: u32,
    expert_cache: Option<Arc<ExpertCacheCounters>>,
    prefill_throughputs: Option<ninfer_engine::PrefillThroughputs>,
}

/// Loads the model on the stages' backends (one: the unsplit model), places the GPU experts,
/// and starts the scheduler over it. `device_memory` gives a backend's `(free, total)` GPU
/// bytes (`None`: no limit, the CPU backend).
fn start_scheduler<B: Backend>(
    stages: pipeline_start::StageBackends<B>,
    artifact: &Arc<ninfer_artifact::Artifact>,
    experts: Arc<dyn ExpertExecutor>,
    request: &GpuExpertsRequest,
    device_memory: impl Fn(&B) -> Option<(usize, usize)>,
    readiness: &dyn Readiness,
    counters: &Arc<SchedulerCounters>,
) -> anyhow::Result<StartedScheduler> {
    let layers = artifact.config().common().num_hidden_layers;
    let ranges = stages.layer_ranges(layers, &device_memory, request.budget_gib)?;
    let mut model = Model::load_pipeline(
        PipelineStage::over(&stages.backends, &ranges),
        Arc::clone(artifact),
        experts,
        request.dense_mlp_offload_layers,
    )
    .with_context(|| match stages.is_split() {
        true => format!("loading the model split with {}", stages.split_flag),
        false => "loading the model".into(),
    })?;
    if request.host_kv.host_bytes > 0 {
        // Before the expert slots: their budget leaves the pooled KV caches' room to them.
        model
            .reserve_host_kv(&request.host_kv)
            .context("--host-kv-mib: reserving page-locked host memory")?;
    }
    if stages.is_split() {
        for (stage, (backend, layers)) in stages.backends.iter().zip(&ranges).enumerate() {
            tracing::info!(
                stage,
                device = %backend.name(),
                first_layer = layers.start,
                last_layer = layers.end.saturating_sub(1),
                "pipeline stage"
            );
        }
        tracing::info!(
            "layer split: decode steps are recorded as one CUDA graph spanning every stage (where the driver allows it; else op by op), the hidden state crosses between stages by device copies (peer copies between cards), each stage stages and streams its own layers' experts at prefill and hands its MoE layers to the expert workers itself where the backend can"
        );
    }
    if request.dense_mlp_offload_layers > 0 {
        tracing::info!(
            layers = model.offloaded_dense_mlp_layers(),
            "dense MLPs of these layers computed by the expert executor"
        );
    }
    let layerwise_min_tokens = if model.spec().has_moe_layers() {
        request.layerwise_min_tokens
    } else {
        0
    };
    // A split stages and streams on every stage: its own slots for its own layers.
    if request.prefill_staging_min_tokens > 0 || layerwise_min_tokens > 0 {
        // Before the expert slots, so their budget sees this memory as used.
        let bytes = model
            .enable_prefill_staging_with(PrefillStagingOptions {
                staged_min_tokens: request.prefill_staging_min_tokens,
                layerwise_min_tokens,
            })
            .context("allocating the prefill staging slots")?;
        tracing::info!(
            min_tokens = request.prefill_staging_min_tokens,
            layerwise_min_tokens,
            mib = bytes >> 20,
            "prefill staging: big batches compute their routed experts on the GPU"
        );
    }
    // Unsplit: every layer holds the same count (`gpu_experts_per_layer`); split, each stage
    // its own, the fewest here.
    let mut fewest_gpu_experts_per_layer = u32::MAX;
    let gpu_experts_per_layer = if !model.spec().has_moe_layers() {
        // An all-dense model: `auto` (the CLI's default on a GPU) has nothing to place.
        if !matches!(
            request.count,
            GpuExpertCount::Count(0) | GpuExpertCount::Auto
        ) {
            tracing::warn!(
                count = %request.count,
                "--moe-gpu-experts: the model has no routed experts, nothing to place"
            );
        }
        0
    } else if request.count == GpuExpertCount::Count(0) {
        0
    } else if stages.is_split() {
        let slots = pipeline_start::StageExpertSlots {
            count: request.count,
            budget_gib: request.budget_gib,
            statistics: request.statistics.as_ref(),
            kv_element_bytes: request.kv_element_bytes,
            max_context: request.limits.max_context,
            max_sequences: request.limits.max_sequences,
            prefix_cache_bytes: request.prefix_cache.budget_bytes,
            host_kv_bytes: request.host_kv.host_bytes,
            speculating: request.speculation.max_draft_tokens > 0,
        };
        let (fewest, most) = pipeline_start::place_gpu_experts_per_stage(
            &mut model,
            &slots,
            &stages,
            &device_memory,
        )?;
        fewest_gpu_experts_per_layer = fewest;
        most
    } else {
        let memory = stages
            .backends
            .first()
            .and_then(|backend| device_memory(backend));
        place_gpu_experts(&mut model, request, memory)?
    };
    // The cache counts whenever experts are in slots; it moves them only when some of a
    // layer's experts are in slots and some are not.
    let num_experts = model.spec().common.num_experts;
    let expert_cache = if gpu_experts_per_layer > 0 {
        let fills_per_layer =
            if fewest_gpu_experts_per_layer.min(gpu_experts_per_layer) as usize >= num_experts {
                0
            } else {
                request.cache_fills_per_layer
            };
        let counters = model
            .enable_expert_cache(
                ExpertCacheOptions {
                    fills_per_layer,
                    eviction_margin: request.cache_eviction_margin,
                    fill_cost_choices: request.cache_fill_cost,
                    upkeep_during_steps: request.cache_upkeep_during_steps,
                    prompt_placement: request.cache_prompt_placement,
                    ..ExpertCacheOptions::default()
                },
                request.statistics.as_ref(),
            )
            .context("starting the expert cache")?;
        if fills_per_layer > 0 {
            tracing::info!(
                fills_per_layer,
                "dynamic expert cache: the GPU expert slots follow the routing (--moe-static-experts keeps the placement)"
            );
        }
        Some(counters)
    } else {
        None
    };
    let prefill_throughputs = if layerwise_min_tokens > 0 {
        Some(measure_prefill_throughputs(
            &model,
            readiness,
            request.cpu_rate_share,
        )?)
    } else {
        None
    };
    let profile = Arc::clone(model.profile());
    let stride = model.expert_slot_bytes().unwrap_or(0);
    if request.speculation.max_draft_tokens > 0 {
        tracing::info!(
            draft_tokens = request.speculation.max_draft_tokens,
            "speculative decoding with the MTP head"
        );
    }
    if request.prefix_cache.budget_bytes > 0 {
        tracing::info!(
            gib = format!(
                "{:.2}",
                request.prefix_cache.budget_bytes as f64 / (1u64 << 30) as f64
            ),
            block_tokens = request.prefix_cache.block_tokens,
            "prefix cache"
        );
    }
    let sender = scheduler::start_serving(
        Arc::new(model),
        request.limits,
        request.speculation,
        request.prefix_cache,
        Arc::clone(counters),
    )
    .context("starting the scheduler")?;
    Ok(StartedScheduler {
        sender,
        profile,
        expert_stride_bytes: stride,
        gpu_experts_per_layer,
        expert_cache,
        prefill_throughputs,
    })
}

/// Rows of the GPU's timed slotted-experts batch and of the executor's, at start: a prompt
/// chunk's size on the GPU (its tensor-core tiles full), and a size at which the CPU kernels
/// are past their per-expert weight reads.
const MEASURED_GPU_TOKENS: usize = 4096;
const MEASURED_EXECUTOR_TOKENS: usize = 512;
/// How long start-up waits for the expert workers before measuring them.
const EXECUTOR_READY_WAIT: Duration = Duration::from_secs(120);

/// Measures what layerwise prefill chooses from (after the resident experts are placed, so
/// the logged splits are those a prompt will get) and logs it with the split of a few prompt
/// sizes.
fn measure_prefill_throughputs<B: Backend>(
    model: &Model<B>,
    readiness: &dyn Readiness,
    cpu_rate_share: f64,
) -> anyhow::Result<ninfer_engine::PrefillThroughputs> {
    let waiting = std::time::Instant::now();
    // With no share for the workers their rate is not needed: no wait, no measurement.
    while let Some(reason) = (cpu_rate_share > 0.0)
        .then(|| readiness.not_ready_reason())
        .flatten()
    {
        if waiting.elapsed() > EXECUTOR_READY_WAIT {
            tracing::warn!(%reason, "the expert executor is not ready: layerwise prefill leaves it nothing");
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let executor_tokens = if cpu_rate_share > 0.0 && readiness.not_ready_reason().is_none() {
        MEASURED_EXECUTOR_TOKENS
    } else {
        0
    };
    let mut throughputs = model
        .measure_prefill_throughputs(MEASURED_GPU_TOKENS, executor_tokens)
        .context("measuring the layerwise prefill throughputs")?;
    if cpu_rate_share != 1.0 && throughputs.executor_pairs_per_second > 0.0 {
        throughputs.executor_pairs_per_second *= cpu_rate_share;
        model
            .set_prefill_throughputs(throughputs)
            .context("setting the layerwise prefill throughputs")?;
    }
    tracing::info!(
        copy_gb_per_s = format!("{:.1}", throughputs.copy_bytes_per_second / 1e9),
        gpu_expert_tflops = format!(
            "{:.1}",
            throughputs.backend_pairs_per_second * throughputs.flops_per_pair / 1e12
        ),
        cpu_expert_tflops = format!(
            "{:.2}",
            throughputs.executor_pairs_per_second * throughputs.flops_per_pair / 1e12
        ),
        "layerwise prefill: measured pinned host-to-device copy, GPU and CPU expert rates"
    );
    for tokens in [512, 4096, 16_384, 32_768] {
        if let Some(summary) = model.layerwise_split_summary(tokens) {
            tracing::info!(
                tokens,
                layerwise_gpu_layers = summary.layerwise_gpu_layers,
                mixed_layers = summary.mixed_layers,
                cpu_layers = summary.cpu_layers,
                estimated_expert_ms = format!("{:.1}", summary.seconds * 1e3),
                streamed_gib =
                    format!("{:.2}", summary.streamed_bytes as f64 / (1u64 << 30) as f64),
                "layerwise prefill: split of a batch"
            );
        }
    }
    Ok(throughputs)
}

/// Puts `--moe-gpu-experts` experts per MoE layer in GPU slots, within the memory left after
/// the dense weights, the KV caches and 1 GiB of working memory; returns how many per layer.
fn place_gpu_experts<B: Backend>(
    model: &mut Model<B>,
    request: &GpuExpertsRequest,
    device_memory: Option<(usize, usize)>,
) -> anyhow::Result<u32> {
    let common = model.spec().common.clone();
    let Some(expert_bytes) = model.expert_slot_bytes() else {
        bail!("--moe-gpu-experts: the model has no routed experts");
    };
    // The MTP layer, when the model has one with routed experts and speculation is on, is
    // placed like one more MoE layer (its experts count against the same budget); without
    // speculation its experts are never read, so they take no slot.
    let mut placement_layers = model.placement_layers();
    if request.speculation.max_draft_tokens == 0 && model.has_mtp() {
        if let Some(mtp_layer) = placement_layers.get_mut(model.mtp_layer_index()) {
            *mtp_layer = false;
        }
    }
    let shape = GpuExpertShape {
        num_experts: common.num_experts,
        moe_layers: placement_layers.clone(),
        expert_bytes,
    };
    let budget = device_memory.map(|(free, total)| {
        expert_slot_budget(&SlotMemoryBudget {
            free_bytes: free as u64,
            total_bytes: total as u64,
            limit_gib: request.budget_gib,
            // The prefix cache's blocks are KV caches too: the slots leave them their room.
            kv_cache_bytes: kv_cache_bytes(
                model.spec(),
                request.kv_element_bytes,
                request.limits.max_context,
                request.limits.max_sequences,
            ) + request.prefix_cache.budget_bytes,
            host_kv_bytes: request.host_kv.host_bytes,
        })
    });
    let per_layer = experts_per_layer(request.count, &shape, budget)
        .map_err(|problem| anyhow::anyhow!("--moe-gpu-experts {}: {problem}", request.count))?;
    let placement = choose_gpu_experts(&shape, per_layer, request.statistics.as_ref());
    let started = std::time::Instant::now();
    let report = model
        .place_resident_experts(&placement)
        .context("filling the GPU expert slots")?;
    let share = request.statistics.as_ref().map(|statistics| {
        let ranked = statistics.placement(per_layer);
        let moe: Vec<f64> = ranked
            .iter()
            .enumerate()
            .filter(|(layer, _)| placement_layers.get(*layer).copied().unwrap_or(false))
            .map(|(_, (_, share))| *share)
            .collect();
        moe.iter().sum::<f64>() / moe.len().max(1) as f64
    });
    tracing::info!(
        experts_per_layer = per_layer,
        layers = report.layers,
        mtp_layer_resident_experts = model.mtp_resident_experts(),
        gib = format!("{:.2}", report.bytes as f64 / (1u64 << 30) as f64),
        seconds = format!("{:.1}", started.elapsed().as_secs_f64()),
        routed_share_from_stats = share.map(|s| format!("{:.1}%", 100.0 * s)),
        "GPU expert slots filled"
    );
    Ok(u32::try_from(per_layer).unwrap_or(u32::MAX))
}

async fn serve(
    listen: &str,
    service: EngineService,
    control_secret: Option<String>,
) -> anyhow::Result<()> {
    use tonic::service::interceptor::InterceptedService;
    let service = Arc::new(service);
    let secret = ninfer_protocol::control_secret::RequireSecret::new(control_secret.clone());
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<EngineServer<EngineService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ninfer_protocol::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building gRPC reflection")?;
    let router = tonic::transport::Server::builder()
        .add_service(InterceptedService::new(health, secret.clone()))
        .add_service(InterceptedService::new(reflection, secret.clone()))
        .add_service(InterceptedService::new(
            EngineServer::from_arc(Arc::clone(&service))
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(256 << 20),
            secret,
        ));
    // Bound before the gRPC socket, whose readiness the gateway waits for.
    let token_socket = match service.token_socket_path.clone() {
        Some(path) => Some((bind_token_socket(&path)?, path)),
        None => None,
    };
    let stopping = tokio::sync::watch::channel(false);
    let grpc = ninfer_protocol::listen::serve(router, listen, {
        let stop = stopping.0.clone();
        async move {
            ninfer_protocol::listen::shutdown_signal().await;
            tracing::info!("shutting down");
            let _ = stop.send(true);
        }
    });
    let Some((token_listener, token_path)) = token_socket else {
        grpc.await?;
        return Ok(());
    };
    // A gRPC server that fails to start or ends stops the token socket too.
    let grpc = async move {
        let served = grpc.await;
        let _ = stopping.0.send(true);
        served
    };
    let mut stopped = stopping.1;
    let tokens = ninfer_protocol::token_socket::serve(
        token_listener,
        service,
        control_secret,
        async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        },
        ninfer_protocol::listen::DRAIN_DEADLINE,
    );
    let (served, ()) = tokio::join!(grpc, tokens);
    let _ = std::fs::remove_file(token_path);
    served?;
    Ok(())
}

/// The token socket's listener at `path`, usable by its owner only, as the gRPC socket is.
fn bind_token_socket(path: &str) -> anyhow::Result<tokio::net::UnixListener> {
    // A socket file left by a killed predecessor would make bind fail.
    let _ = std::fs::remove_file(path);
    let previous = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let bound = tokio::net::UnixListener::bind(path);
    nix::sys::stat::umask(previous);
    let listener = bound.with_context(|| format!("listening on the token socket {path}"))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("restricting the token socket {path}"))?;
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_is_the_default_only_without_routing_statistics() {
        assert_eq!(
            default_cache_fills(false, None, false),
            DEFAULT_FILLS_PER_LAYER
        );
        assert_eq!(default_cache_fills(false, None, true), 0);
        assert_eq!(default_cache_fills(false, Some(3), true), 3);
        assert_eq!(default_cache_fills(true, Some(3), false), 0);
    }
}
