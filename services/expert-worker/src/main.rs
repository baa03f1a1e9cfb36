//! `ninfer-expert-worker`: a CPU expert worker process, one per NUMA node.
//!
//! Owns: its share of the routed-expert banks (mapped from the artifact, locked in RAM), a thread
//! pool pinned to its node, the worker end of the shared-memory activation channel, and the
//! `ExpertWorker` gRPC control service (info, attach, statistics, drain) with `grpc.health.v1`,
//! open only to callers with the control secret when one is set (needed on TCP).
//! Must not touch: the GPU, attention, routing decisions, anything outside the experts it owns.

mod serving;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Parser;
use ninfer_artifact::Artifact;
use ninfer_cpu_experts::KernelIsa;
use ninfer_protocol::v1::expert_worker_server::{ExpertWorker, ExpertWorkerServer};
use ninfer_protocol::v1::{
    AttachChannelRequest, AttachChannelResponse, DrainRequest, DrainResponse, WorkerInfo,
    WorkerInfoRequest, WorkerStatistics, WorkerStatisticsRequest,
};
use tonic::{Request, Response, Status};

use serving::{ServingHandle, WorkerModel};

#[derive(Debug, Parser)]
#[command(
    name = "ninfer-expert-worker",
    version,
    about = "CPU expert worker of NInfer-Offload"
)]
struct Args {
    /// The `.ninfer` artifact (the same file the engine serves).
    #[arg(long)]
    model: PathBuf,
    /// NUMA node whose cores this worker pins to (node 0 on a one-node machine).
    #[arg(long, default_value_t = 0)]
    numa_node: usize,
    /// Compute threads (default: one per physical core of the node, each pinned to its own core;
    /// the cores' other hardware threads stay free for the engine and the system).
    #[arg(long)]
    moe_threads: Option<usize>,
    /// Which experts this worker owns: `all`, or `shard=I/N` (the I-th of N contiguous ranges).
    #[arg(long, default_value = "all")]
    experts: String,
    /// gRPC control address: `unix:/path/to.sock` or `HOST:PORT`.
    #[arg(long)]
    listen: String,
    /// Force a kernel path (scalar, avx2, avx512, avx512-vnni, amx); default: the best one.
    #[arg(long)]
    kernel_isa: Option<String>,
    /// Largest token count of one channel request (the engine chunks bigger batches).
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// File holding the shared secret every caller (the engine) must send (`authorization:
    /// Bearer SECRET`); also `NINFER_CONTROL_SECRET_FILE` or `NINFER_CONTROL_SECRET`. Needed
    /// when `--listen` is TCP: a caller could attach the worker to any channel segment;
    /// a `unix:PATH` socket is owner-only without it.
    #[arg(long, value_name = "FILE")]
    control_secret_file: Option<PathBuf>,
    /// Serve on a non-loopback TCP `--listen` without a control secret (refused otherwise:
    /// anyone reaching the port could drive the worker).
    #[arg(long)]
    insecure_listen: bool,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
    /// Test hook: sleep this long before answering each request, so tests can act mid-generation
    /// (also from the environment, for workers a supervisor starts).
    #[arg(
        long,
        hide = true,
        default_value_t = 0,
        env = "NINFER_WORKER_TEST_DELAY_MS"
    )]
    test_delay_ms: u64,
}

/// `all` → every expert; `shard=I/N` → the I-th of N contiguous, near-equal ranges.
fn owned_range(spec: &str, num_experts: usize) -> anyhow::Result<std::ops::Range<usize>> {
    if spec == "all" {
        return Ok(0..num_experts);
    }
    let Some(shard) = spec.strip_prefix("shard=") else {
        bail!("--experts `{spec}`: expected `all` or `shard=I/N`");
    };
    let parsed = shard
        .split_once('/')
        .and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?)));
    match parsed {
        Some((index, count)) if count > 0 && index < count && count <= num_experts => {
            Ok(index * num_experts / count..(index + 1) * num_experts / count)
        }
        _ => bail!("--experts `{spec}`: need shard=I/N with 0 <= I < N <= {num_experts}"),
    }
}

struct WorkerService {
    info: WorkerInfo,
    serving: ServingHandle,
}

#[tonic::async_trait]
impl ExpertWorker for WorkerService {
    async fn get_worker_info(
        &self,
        _: Request<WorkerInfoRequest>,
    ) -> Result<Response<WorkerInfo>, Status> {
        let mut info = self.info.clone();
        info.banks_locked = self.serving.banks_locked();
        Ok(Response::new(info))
    }

    async fn attach_channel(
        &self,
        request: Request<AttachChannelRequest>,
    ) -> Result<Response<AttachChannelResponse>, Status> {
        let request = request.into_inner();
        if request.model_id != self.info.model_id {
            return Err(Status::failed_precondition(format!(
                "this worker serves model {} ({}), the engine serves model {}",
                self.info.model_id, self.info.model_path, request.model_id
            )));
        }
        self.serving
            .attach(request.shared_memory_path)
            .await
            .map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
        Ok(Response::new(AttachChannelResponse {}))
    }

    async fn get_statistics(
        &self,
        _: Request<WorkerStatisticsRequest>,
    ) -> Result<Response<WorkerStatistics>, Status> {
        Ok(Response::new(self.serving.statistics()))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        self.serving.drain().await;
        Ok(Response::new(DrainResponse {}))
    }
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
    let control_secret = ninfer_protocol::control_secret::load(args.control_secret_file.as_deref())
        .context("--control-secret-file")?;
    const WORKER_REACH: &str = "attach the worker to a channel and read its statistics";
    ninfer_protocol::control_secret::check_listen(
        &args.listen,
        control_secret.is_some(),
        args.insecure_listen,
        WORKER_REACH,
    )?;
    if control_secret.is_none() && !args.listen.starts_with("unix:") {
        tracing::warn!(listen = %args.listen, "the worker listens on TCP without a control secret: anyone who reaches the port can {WORKER_REACH} (prefer --listen unix:PATH, or set --control-secret-file)");
    }
    let artifact = Arc::new(
        Artifact::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?,
    );
    let common = artifact.config().common().clone();
    let served = serving::ServedBanks::of(&common);
    let owned = owned_range(&args.experts, served.num_experts)?;
    let node_cpus = ninfer_cpu_experts::cpus_of_numa_node(args.numa_node).unwrap_or_default();
    // One worker per physical core unless asked otherwise; more threads go to the cores'
    // other hardware threads.
    let (cpus, cores) = ninfer_cpu_experts::cpus_by_physical_core(&node_cpus);
    let threads = args.moe_threads.unwrap_or(cores).max(1);
    let isa = match &args.kernel_isa {
        Some(name) => name
            .parse::<KernelIsa>()
            .map_err(|e| anyhow::anyhow!("--kernel-isa: {e}"))?,
        None => KernelIsa::best(),
    };
    let model = WorkerModel::load(
        Arc::clone(&artifact),
        owned.clone(),
        threads,
        &cpus,
        isa,
        args.max_tokens,
    )?;
    tracing::info!(
        model = %args.model.display(),
        model_id = %artifact.model_id(),
        numa_node = args.numa_node,
        threads,
        cores,
        hardware_threads = cpus.len(),
        kernel = isa.name(),
        experts = %format!("{}..{} of {}", owned.start, owned.end, served.num_experts),
        "expert worker ready"
    );
    let info = WorkerInfo {
        model_path: args.model.display().to_string(),
        numa_node: args.numa_node as u32,
        threads: threads as u32,
        owned_experts: vec![format!(
            "all MoE layers:{}-{}",
            owned.start,
            owned.end.saturating_sub(1)
        )],
        banks_locked: false,
        model_id: artifact.model_id(),
        hidden_size: common.hidden_size as u32,
        num_experts: served.num_experts as u32,
        first_owned_expert: owned.start as u32,
        owned_expert_count: owned.len() as u32,
        kernel_isa: isa.name().to_string(),
        pid: std::process::id(),
    };
    let serving = serving::start(model, std::time::Duration::from_millis(args.test_delay_ms));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the control runtime")?;
    let served = runtime.block_on(serve(
        args.listen.clone(),
        WorkerService { info, serving },
        control_secret,
    ));
    // Connection tasks left after the drain must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    served
}

async fn serve(
    listen: String,
    service: WorkerService,
    control_secret: Option<String>,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<ExpertWorkerServer<WorkerService>>()
        .await;
    let router = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExpertWorkerServer::with_interceptor(
            service,
            ninfer_protocol::control_secret::RequireSecret::new(control_secret),
        ));
    ninfer_protocol::listen::serve(router, &listen, async {
        ninfer_protocol::listen::shutdown_signal().await;
        tracing::info!("shutting down");
    })
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::owned_range;

    #[test]
    fn shards_cover_every_expert_once() {
        for count in 1..=5 {
            let mut covered = Vec::new();
            for index in 0..count {
                covered.extend(owned_range(&format!("shard={index}/{count}"), 10).unwrap());
            }
            assert_eq!(covered, (0..10).collect::<Vec<_>>());
        }
        assert_eq!(owned_range("all", 8).unwrap(), 0..8);
        for bad in ["shard=2/2", "shard=0/0", "half", "shard=a/b", "shard=0/11"] {
            assert!(owned_range(bad, 10).is_err(), "{bad}");
        }
    }
}
