//! `ninfer-engine`: the engine process. Loads the model, computes routed experts in-process or
//! through CPU expert workers (`--experts`), and serves the gateway's gRPC API.
//!
//! Owns: command-line flags, process start-up and shutdown, the routing-statistics file.
//! Must not touch: model math (library), HTTP (gateway).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, ValueEnum};
use ninfer_engine::backend::cuda::CudaBackend;
use ninfer_engine::experts::ExpertExecutor;
use ninfer_engine::kernel_experts::KernelExpertExecutor;
use ninfer_engine::remote_experts::{RemoteExpertExecutor, RemoteExpertsOptions};
use ninfer_engine::service::routing_stats::{CountingExecutor, ExpertStatistics, RoutingCounters};
use ninfer_engine::service::scheduler::{
    self, SchedulerCommand, SchedulerCounters, SchedulerLimits,
};
use ninfer_engine::service::{AlwaysReady, EngineService, Readiness};
use ninfer_engine::{open_artifact, Backend, CpuBackend, Model};
use ninfer_expert_kernels::KernelIsa;
use ninfer_protocol::v1::engine_server::EngineServer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Device {
    Cpu,
    Cuda,
    Auto,
}

#[derive(Debug, Parser)]
#[command(name = "ninfer-engine", version, about = "The NInfer-Offload engine")]
struct Args {
    /// The `.ninfer` artifact.
    #[arg(long)]
    model: PathBuf,
    /// Where the dense layers run.
    #[arg(long, value_enum, default_value = "auto")]
    device: Device,
    /// Expert workers (`unix:PATH` or `HOST:PORT`, comma-separated; one per NUMA node). Without
    /// it the routed experts run in this process.
    #[arg(long, value_delimiter = ',')]
    experts: Vec<String>,
    /// gRPC address for the gateway: `unix:PATH` or `HOST:PORT`.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: String,
    /// Name the API reports (default: the artifact's file stem).
    #[arg(long)]
    model_name: Option<String>,
    /// Longest prompt + completion per sequence, in tokens (default: min(model limit, 8192)).
    #[arg(long)]
    max_context: Option<usize>,
    /// Sequences decoded together; more are refused with RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 32)]
    max_sequences: usize,
    /// Threads of the in-process expert kernels.
    #[arg(long, default_value_t = 0)]
    moe_threads: usize,
    /// Force a kernel path for in-process experts.
    #[arg(long)]
    kernel_isa: Option<String>,
    /// Fail requests held for a missing expert worker after this many seconds.
    #[arg(long, default_value_t = 120.0)]
    worker_timeout: f64,
    /// A worker without a heartbeat for this many milliseconds counts as hung.
    #[arg(long, default_value_t = 1000)]
    worker_hang_ms: u64,
    /// Tokens per activation-channel request (bigger batches go in chunks).
    #[arg(long, default_value_t = 256)]
    channel_max_tokens: usize,
    /// Write routing statistics (per layer, per expert) to this JSON file every 10 s and at exit.
    #[arg(long)]
    moe_record_stats: Option<PathBuf>,
    /// Routing statistics of earlier runs (`ninfer-expert-stats-v1`, written by
    /// `--moe-record-stats` or the gateway's state directory) for static expert placement.
    #[arg(long)]
    moe_expert_stats: Option<PathBuf>,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

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
    // The GPU is opened before anything else is loaded, so `--device cuda` fails fast.
    let device = select_device(args.device)?;
    let artifact =
        open_artifact(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
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
    if let Some(path) = &args.moe_expert_stats {
        let statistics = ExpertStatistics::load(path, common.num_hidden_layers, common.num_experts)
            .map_err(|problem| anyhow::anyhow!("--moe-expert-stats: {problem}"))?;
        // The placement the GPU expert slots start from: the hottest experts of each layer.
        let slots = (common.num_experts / 4).max(1);
        let placement = statistics.placement(slots);
        let moe_layers: Vec<&(Vec<u32>, f64)> = placement
            .iter()
            .enumerate()
            .filter(|(layer, _)| common.moe_layers[*layer])
            .map(|(_, entry)| entry)
            .collect();
        let mean_share =
            moe_layers.iter().map(|(_, share)| share).sum::<f64>() / moe_layers.len().max(1) as f64;
        tracing::info!(
            file = %path.display(),
            "expert placement from routing statistics: the {slots} hottest experts per layer serve {:.1}% of routed tokens on average",
            mean_share * 100.0
        );
    }
    let (experts, readiness): (Arc<dyn ExpertExecutor>, Arc<dyn Readiness>) =
        if args.experts.is_empty() {
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
            let remote = Arc::new(RemoteExpertExecutor::start(RemoteExpertsOptions {
                addresses: args.experts.clone(),
                model_id: artifact.model_id(),
                hidden_size: common.hidden_size,
                num_experts: common.num_experts,
                top_k: common.num_experts_per_tok,
                max_tokens_per_request: args.channel_max_tokens,
                hang_timeout: Duration::from_millis(args.worker_hang_ms),
                worker_timeout: Duration::from_secs_f64(args.worker_timeout.max(0.0)),
            })?);
            (
                Arc::clone(&remote) as Arc<dyn ExpertExecutor>,
                remote as Arc<dyn Readiness>,
            )
        };
    let counting = Arc::new(CountingExecutor {
        inner: experts,
        counters: Arc::clone(&routing),
    });
    let limits = SchedulerLimits {
        max_context,
        max_sequences: args.max_sequences.max(1),
    };
    let scheduler_counters = Arc::new(SchedulerCounters::default());
    let scheduler = match device {
        SelectedDevice::Cpu => start_scheduler(
            Arc::new(CpuBackend::new()),
            &artifact,
            counting,
            limits,
            &scheduler_counters,
        )?,
        SelectedDevice::Cuda(backend) => {
            start_scheduler(backend, &artifact, counting, limits, &scheduler_counters)?
        }
    };
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
        scheduler: Mutex::new(scheduler),
        scheduler_counters,
        routing: Arc::clone(&routing),
        readiness,
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
    runtime.block_on(serve(&args.listen, service))?;
    if let Some(path) = stats_file {
        routing
            .write_file(&path, &model_name)
            .with_context(|| format!("writing routing statistics to {}", path.display()))?;
    }
    Ok(())
}

/// Where the dense layers run, decided once at start-up.
enum SelectedDevice {
    Cpu,
    Cuda(Arc<CudaBackend>),
}

/// `cpu`: the CPU. `cuda`: GPU 0 or a clear error naming what was looked for (driver, NVRTC,
/// device). `auto`: GPU 0 when it opens, else the CPU with a warning saying why.
fn select_device(device: Device) -> anyhow::Result<SelectedDevice> {
    match device {
        Device::Cpu => Ok(SelectedDevice::Cpu),
        Device::Cuda => {
            let backend = CudaBackend::new(0).context(
                "--device cuda: cannot use the GPU (use --device cpu, or --device auto to fall back)",
            )?;
            log_gpu(&backend);
            Ok(SelectedDevice::Cuda(Arc::new(backend)))
        }
        Device::Auto => match CudaBackend::new(0) {
            Ok(backend) => {
                log_gpu(&backend);
                Ok(SelectedDevice::Cuda(Arc::new(backend)))
            }
            Err(error) => {
                tracing::warn!("--device auto: no usable GPU, running on the CPU: {error}");
                Ok(SelectedDevice::Cpu)
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
        "dense layers on the GPU"
    );
}

/// Loads the model on `backend` and starts the scheduler over it.
fn start_scheduler<B: Backend>(
    backend: Arc<B>,
    artifact: &Arc<ninfer_artifact::Artifact>,
    experts: Arc<dyn ExpertExecutor>,
    limits: SchedulerLimits,
    counters: &Arc<SchedulerCounters>,
) -> anyhow::Result<std::sync::mpsc::Sender<SchedulerCommand>> {
    let model = Arc::new(Model::load(backend, Arc::clone(artifact), experts)?);
    scheduler::start(model, limits, Arc::clone(counters)).context("starting the scheduler")
}

async fn serve(listen: &str, service: EngineService) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<EngineServer<EngineService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ninfer_protocol::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building gRPC reflection")?;
    let router = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(reflection)
        .add_service(
            EngineServer::new(service)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(256 << 20),
        );
    ninfer_protocol::listen::serve(router, listen, async {
        ninfer_protocol::listen::shutdown_signal().await;
        tracing::info!("shutting down");
    })
    .await?;
    Ok(())
}
