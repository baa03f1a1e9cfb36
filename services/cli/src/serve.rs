//! `ninfer serve MODEL`: one expert worker per NUMA node plus the engine, as supervised child
//! processes on a private runtime directory; the engine's gRPC API on `--listen`. Also the engine
//! flags `serve` and `run` share, and how they become the children's command lines.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::EngineStatusRequest;
use tonic::transport::Channel;

use crate::model_facts::{locate_model, locate_model_in, models_dir, ModelFacts, ModelLocation};
use crate::plan::{plan, Plan, Request};
use crate::plan_machine::Machine;
use crate::plan_print::print_plan;
use crate::supervisor::{
    install_stop_handler, sibling_binary, stop_requested, ChildSpec, Supervisor,
};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The `.ninfer` artifact, a directory holding exactly one, a checkpoint directory, or
    /// `ORG/NAME` in the models directory.
    pub model: PathBuf,
    /// Address of the engine's gRPC API: `unix:PATH` or `HOST:PORT`.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: String,
    #[command(flatten)]
    pub engine: EngineFlags,
}

/// The engine and worker flags `serve` and `run` take; each is checked by the plan before
/// anything starts.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct EngineFlags {
    /// Where models named `ORG/NAME` live (default: `$NINFER_MODELS_DIR`, else
    /// `~/ninfer-models`).
    #[arg(long, value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    /// Where a model named `ORG/NAME` that is not in the models directory comes from:
    /// `auto` (the default, also from `$NINFER_SOURCE`: Hugging Face, else ModelScope),
    /// `huggingface` or `modelscope`. `HF_ENDPOINT` names a mirror, `HF_TOKEN` opens gated
    /// models.
    #[arg(long, value_enum)]
    pub source: Option<crate::hub::SourceChoice>,
    /// Most disk space, in GB, the byte ranges fetched ahead of a streaming conversion may
    /// take (default 20).
    #[arg(long, value_name = "GB")]
    pub cache_gb: Option<f64>,
    /// Plan for the machine this JSON file describes instead of this one (`{"cpus": 16,
    /// "numa_nodes": 1, "ram_gib": 64, "gpu_vram_gib": 16}`; optional `ram_available_gib`,
    /// `gpu_free_gib`): what `--dry-run` would plan there.
    #[arg(long, value_name = "FILE")]
    pub machine_profile: Option<PathBuf>,
    /// Compute threads per expert worker (default: one per physical core of its node).
    #[arg(long)]
    pub moe_threads: Option<usize>,
    /// Longest prompt + completion per sequence, in tokens.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Run the routed experts inside the engine instead of in worker processes.
    #[arg(long)]
    pub no_workers: bool,
    /// Routed experts per MoE layer on the GPU: N, `half`, `all` or `auto` (as many as fit;
    /// the default when a GPU is found, else 0).
    #[arg(long, value_name = "N|half|all|auto")]
    pub moe_gpu_experts: Option<String>,
    /// Behave as if the GPU had this many GiB (stand in for a smaller card).
    #[arg(long, value_name = "GiB")]
    pub gpu_mem_budget: Option<f64>,
    /// The GPUs to use, by CUDA ordinal among the visible ones (`CUDA_VISIBLE_DEVICES`
    /// applies), comma separated. Default: the first visible GPU. Several named split the
    /// decoder layers over them as a pipeline (`--dry-run` shows each card's share).
    #[arg(long, value_name = "0,1")]
    pub gpus: Option<String>,
    /// Percent of the decoder layers per GPU of `--gpus`, in order, summing to 100 (default:
    /// in proportion to each card's usable memory).
    #[arg(long, value_name = "60,40")]
    pub gpu_split: Option<String>,
    /// Element type of the GPU's KV cache.
    #[arg(long, value_name = "bf16|f32", value_parser = ["bf16", "f32"])]
    pub kv_dtype: Option<String>,
    /// Keep this many MiB of the KV cache in page-locked host RAM (frees GPU memory for
    /// experts; recommended with offload on a small card).
    #[arg(long, value_name = "MiB")]
    pub host_kv_mib: Option<u64>,
    /// Keep what prompts computed within this many GiB, so a prompt that starts like an
    /// earlier one computes only the rest (0: off; default: the plan's, shown by `--dry-run`).
    #[arg(long, value_name = "GiB")]
    pub prefix_cache_gib: Option<f64>,
    /// Most sequences decoded at once.
    #[arg(long, value_name = "N")]
    pub max_sequences: Option<usize>,
    /// Routing statistics to place the GPU experts by (a file `--moe-record-stats` wrote).
    #[arg(long, value_name = "FILE")]
    pub moe_expert_stats: Option<PathBuf>,
    /// Record routing statistics into this file (every 10 s and at exit).
    #[arg(long, value_name = "FILE")]
    pub moe_record_stats: Option<PathBuf>,
    /// Routed experts live in host RAM and are computed by the expert workers, the GPU holding
    /// `--moe-gpu-experts` of them per layer. This is how ninfer always runs; the flag is
    /// accepted so command lines written for the seeds' tool keep working.
    #[arg(long)]
    pub moe_offload: bool,
    /// Where the dense layers run.
    #[arg(long, value_name = "cpu|cuda|auto", value_parser = ["cpu", "cuda", "auto"])]
    pub device: Option<String>,
    /// Speculative decoding: `mtp` drafts tokens with the model's MTP head and verifies them in
    /// one batched step (greedy output unchanged). `ninfer run` turns it on with one draft when
    /// the model has the head.
    #[arg(long, value_name = "mtp", value_parser = ["mtp"], conflicts_with = "no_mtp")]
    pub spec: Option<String>,
    /// Most MTP drafts per step (1..=8, default 1; implies `--spec mtp`). Sequences whose
    /// drafts are rejected draft fewer.
    #[arg(long, value_name = "N", conflicts_with = "no_mtp")]
    pub draft_tokens: Option<usize>,
    /// No MTP speculative decoding, also where `ninfer run` would turn it on.
    #[arg(long)]
    pub no_mtp: bool,
    /// The model's name in the API (`/v1/models`, the `model` field of requests). Default: the
    /// artifact's file name without `.ninfer` (and without the checksum a checkpoint converted
    /// on the fly carries in its cache file name).
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Extra arguments for the engine (repeat the flag per argument).
    #[arg(long = "engine-arg", allow_hyphen_values = true, value_name = "ARG")]
    pub engine_args: Vec<String>,
    /// Everything after `--` goes to the engine verbatim.
    #[arg(last = true, value_name = "ENGINE ARGS")]
    pub passthrough: Vec<String>,
}

/// The engine's `--max-sequences` when none is given.
const ENGINE_DEFAULT_MAX_SEQUENCES: usize = 32;

impl EngineFlags {
    /// Whether the user's own engine arguments say `--device cpu`.
    fn passes_device_cpu(&self) -> bool {
        let arguments = self.user_engine_args();
        arguments.iter().any(|a| a == "--device=cpu")
            || arguments
                .windows(2)
                .any(|pair| pair[0] == "--device" && pair[1] == "cpu")
    }

    /// Whether these flags ask for MTP speculative decoding (`--spec mtp` or `--draft-tokens`).
    pub fn speculates(&self) -> bool {
        !self.no_mtp && (self.spec.is_some() || self.draft_tokens.is_some())
    }

    /// The user's own engine arguments: `--engine-arg` values, then those after `--`.
    pub fn user_engine_args(&self) -> Vec<String> {
        self.engine_args
            .iter()
            .chain(&self.passthrough)
            .cloned()
            .collect()
    }

    /// The plan's view of these flags.
    pub fn request(&self, api: Option<String>) -> Request {
        Request {
            max_context: self.max_context,
            moe_threads: self.moe_threads,
            moe_gpu_experts: self.moe_gpu_experts.clone(),
            gpu_mem_budget: self.gpu_mem_budget,
            host_kv_mib: self.host_kv_mib,
            prefix_cache_gib: self.prefix_cache_gib,
            kv_element_bytes: if self.kv_dtype.as_deref() == Some("f32") {
                4
            } else {
                2
            },
            max_sequences: self.max_sequences.unwrap_or(ENGINE_DEFAULT_MAX_SEQUENCES),
            no_workers: self.no_workers,
            cpu_only: self.device.as_deref() == Some("cpu") || self.passes_device_cpu(),
            moe_expert_stats: self.moe_expert_stats.clone(),
            api,
            gpus: self.gpus.clone(),
            gpu_split: self.gpu_split.clone(),
        }
    }
}

/// Locates MODEL (downloading a model named `ORG/NAME` into the models directory first when
/// `may_download` and it is not there), reads its facts (headers only) and plans on this
/// machine, or the one `--machine-profile` describes: every value is checked here, before
/// anything converts or starts.
pub fn plan_for(
    model: &Path,
    flags: &EngineFlags,
    request: &Request,
    may_download: bool,
) -> anyhow::Result<(ModelLocation, Plan)> {
    let models_dir = models_dir(flags.models_dir.as_deref());
    let cache_bound = crate::stream::cache_bytes(flags.cache_gb)?;
    let remote = crate::download::repository_to_download(model, &models_dir);
    let (facts, disk) = match remote {
        Some((repository, local)) if may_download => {
            obtain_named(&repository, &local, flags.source, cache_bound)?;
            (
                ModelFacts::read(&locate_model_in(model, &models_dir)?)?,
                None,
            )
        }
        // A plan by name, from the hub's config and headers: nothing is downloaded.
        Some((repository, local)) => {
            let (facts, disk) =
                crate::stream::facts_by_name(&repository, flags.source, &local, cache_bound)?;
            (facts, Some(disk))
        }
        None => (
            ModelFacts::read(&locate_model_in(model, &models_dir)?)?,
            None,
        ),
    };
    let location = facts.location.clone();
    let machine = match &flags.machine_profile {
        Some(file) => Machine::from_profile_file(file)?,
        None => Machine::probe(),
    };
    let mut plan = plan(&facts, &machine, request)?;
    plan.disk = disk;
    Ok((location, plan))
}

/// Makes the model `repository` runnable from `local`, its place in the models directory:
/// a published conversion downloaded, else the checkpoint converted while it streams.
pub fn obtain_named(
    repository: &str,
    local: &Path,
    source: Option<crate::hub::SourceChoice>,
    cache_bound: u64,
) -> anyhow::Result<()> {
    crate::stream::obtain(repository, local, source, cache_bound).with_context(|| {
        format!(
            "{repository} is not in the models directory ({}); fetching it failed",
            local.display()
        )
    })
}

/// The artifact to run: the one located, or the checkpoint converted once (bf16) into the
/// user's cache and reused after.
pub fn artifact_of(location: &ModelLocation) -> anyhow::Result<PathBuf> {
    match location {
        ModelLocation::Artifact(path) => Ok(path.clone()),
        ModelLocation::Checkpoint(directory) => converted_checkpoint(directory),
    }
}

/// MODEL may be the artifact, a directory holding exactly one `.ninfer`, or a Hugging Face
/// checkpoint directory — converted once (bf16) into the user's cache and reused after.
pub fn resolve_model(path: &Path) -> anyhow::Result<PathBuf> {
    artifact_of(&locate_model(path)?)
}

/// The cached conversion of a checkpoint directory, keyed by its files' names, sizes and times.
fn converted_checkpoint(directory: &std::path::Path) -> anyhow::Result<PathBuf> {
    let mut key = directory
        .canonicalize()
        .unwrap_or_else(|_| directory.to_path_buf())
        .display()
        .to_string();
    let mut entries: Vec<_> = std::fs::read_dir(directory)?
        .filter_map(|e| e.ok())
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        if let Ok(metadata) = entry.metadata() {
            let modified = metadata
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            key.push_str(&format!(
                "|{}:{}:{:?}",
                entry.file_name().to_string_lossy(),
                metadata.len(),
                modified
            ));
        }
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ninfer/converted");
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let name = directory
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let output = cache.join(format!(
        "{name}-{}.ninfer",
        ninfer_artifact::Checksum::of(key.as_bytes())
    ));
    if !output.exists() {
        eprintln!(
            "converting {} into {} (once; later runs reuse it)",
            directory.display(),
            output.display()
        );
        let options = ninfer_convert::ConvertOptions::new(directory, &output);
        ninfer_convert::convert_checkpoint(&options, &ninfer_convert::NoProgress)
            .with_context(|| format!("converting {}", directory.display()))?;
    }
    Ok(output)
}

/// Starts workers and engine under `supervisor` for the artifact `model`; returns the engine's
/// address.
pub fn start_pipeline(
    supervisor: &mut Supervisor,
    model: &Path,
    listen: &str,
    flags: &EngineFlags,
    plan: &Plan,
) -> anyhow::Result<String> {
    // Fail here, with the file named, rather than in a child's log.
    let artifact = ninfer_artifact::Artifact::open(model)
        .with_context(|| format!("opening {}", model.display()))?;
    if flags.speculates() && !has_mtp_head(&artifact) {
        bail!(
            "--spec mtp: {} has no MTP head (no `mtp.*` tensors); drop --spec/--draft-tokens, or convert a checkpoint that has one",
            model.display()
        );
    }
    if let Some(n) = flags.draft_tokens {
        if !(1..=8).contains(&n) {
            bail!("--draft-tokens {n}: give 1..=8");
        }
    }
    let mut worker_addresses = Vec::new();
    for worker in &plan.expert_workers {
        let node = worker.numa_node;
        let address = supervisor.socket(&format!("experts-{node}"));
        let mut worker_args = vec![
            "--model".to_string(),
            model.display().to_string(),
            "--numa-node".into(),
            node.to_string(),
            "--experts".into(),
            worker.experts.clone(),
            "--listen".into(),
            address.clone(),
        ];
        if let Some(threads) = flags.moe_threads {
            worker_args.extend(["--moe-threads".into(), threads.to_string()]);
        }
        supervisor.add(ChildSpec {
            label: format!("experts-{node}"),
            program: sibling_binary("ninfer-expert-worker"),
            args: worker_args,
        })?;
        worker_addresses.push(address);
    }
    supervisor.add(ChildSpec {
        label: "engine".into(),
        program: sibling_binary("ninfer-engine"),
        args: engine_command_line(model, listen, &worker_addresses, flags, plan),
    })?;
    Ok(listen.to_string())
}

/// The last lines of a child's log, for a failure message.
pub fn log_tail(supervisor: &Supervisor, label: &str) -> String {
    crate::supervisor::file_tail(&supervisor.log_path(label), 15)
}

/// Waits until the engine at `address` answers and says it is ready (for the commands that
/// drive a pipeline they started: `bench MODEL`, `perplexity`); fails early when a child died.
pub async fn connect_when_ready(
    address: &str,
    supervisor: &mut Supervisor,
    timeout: Duration,
) -> anyhow::Result<EngineClient<Channel>> {
    let deadline = Instant::now() + timeout;
    loop {
        if stop_requested() {
            bail!("interrupted while the pipeline started");
        }
        supervisor.poll()?;
        if let Ok(channel) =
            ninfer_protocol::transport::connect(address, Duration::from_millis(500)).await
        {
            let mut client = EngineClient::new(channel)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20);
            if let Ok(status) = client.get_status(EngineStatusRequest {}).await {
                if status.get_ref().ready {
                    return Ok(client);
                }
            }
        }
        if Instant::now() >= deadline {
            bail!(
                "the engine was not ready within {:.0} s (--ready-timeout); the end of its log:\n{}",
                timeout.as_secs_f64(),
                log_tail(supervisor, "engine")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the artifact carries the MTP draft head.
pub fn has_mtp_head(artifact: &ninfer_artifact::Artifact) -> bool {
    artifact.get("mtp.fc").is_some()
}

/// Whether the engine arguments the user passed through name `flag` (as `--flag` or
/// `--flag=VALUE`): the user's value then wins over the plan's default.
fn passes(arguments: &[String], flag: &str) -> bool {
    arguments
        .iter()
        .any(|argument| argument == flag || argument.starts_with(&format!("{flag}=")))
}

/// The engine's arguments: model, address, workers, the flags given, the plan's defaults the
/// user did not override, then the user's own engine arguments verbatim.
pub fn engine_command_line(
    model: &Path,
    listen: &str,
    worker_addresses: &[String],
    flags: &EngineFlags,
    plan: &Plan,
) -> Vec<String> {
    let extra = &flags.user_engine_args();
    let mut arguments = vec![
        "--model".to_string(),
        model.display().to_string(),
        "--listen".into(),
        listen.to_string(),
    ];
    if !passes(extra, "--model-name") {
        let name = flags
            .served_model_name
            .clone()
            .unwrap_or_else(|| default_served_name(model));
        arguments.extend(["--model-name".into(), name]);
    }
    if !worker_addresses.is_empty() {
        arguments.extend(["--experts".into(), worker_addresses.join(",")]);
    }
    if let Some(context) = flags.max_context {
        arguments.extend(["--max-context".into(), context.to_string()]);
    }
    if flags.no_workers {
        if let Some(threads) = flags.moe_threads {
            arguments.extend(["--moe-threads".into(), threads.to_string()]);
        }
    }
    match &flags.moe_gpu_experts {
        Some(count) => arguments.extend(["--moe-gpu-experts".into(), count.clone()]),
        // `auto` by default where the plan saw a GPU.
        None if plan.gpu_experts != "0" && !passes(extra, "--moe-gpu-experts") => {
            arguments.extend(["--moe-gpu-experts".into(), plan.gpu_experts.clone()])
        }
        None => {}
    }
    if let Some(gib) = flags.gpu_mem_budget {
        arguments.extend(["--gpu-mem-budget".into(), gib.to_string()]);
    }
    if !passes(extra, "--prefix-cache-gib") {
        let gib = plan.prefix_cache_bytes as f64 / (1u64 << 30) as f64;
        arguments.extend(["--prefix-cache-gib".into(), format!("{gib:.3}")]);
    }
    let valued = [
        ("--kv-dtype", flags.kv_dtype.clone()),
        (
            "--host-kv-mib",
            flags.host_kv_mib.map(|mib| mib.to_string()),
        ),
        (
            "--max-sequences",
            flags.max_sequences.map(|n| n.to_string()),
        ),
        (
            "--moe-expert-stats",
            flags
                .moe_expert_stats
                .as_ref()
                .map(|p| p.display().to_string()),
        ),
        (
            "--moe-record-stats",
            flags
                .moe_record_stats
                .as_ref()
                .map(|p| p.display().to_string()),
        ),
        ("--device", flags.device.clone()),
        ("--gpus", flags.gpus.clone()),
        ("--gpu-split", flags.gpu_split.clone()),
        ("--spec", flags.speculates().then(|| "mtp".to_string())),
        ("--draft-tokens", flags.draft_tokens.map(|n| n.to_string())),
    ];
    for (flag, value) in valued {
        if let Some(value) = value {
            arguments.extend([flag.to_string(), value]);
        }
    }
    arguments.extend(extra.iter().cloned());
    arguments
}

/// The name a model is served under when none is given: the artifact's file stem, less the
/// `-<16 hex digits>` checksum of a checkpoint converted into the cache (`Qwen3-30B-A3B`, not
/// `Qwen3-30B-A3B-3f9c…`): clients name models as their makers do.
pub fn default_served_name(model: &Path) -> String {
    let stem = model
        .file_stem()
        .map(|stem| stem.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let in_conversion_cache = model
        .parent()
        .is_some_and(|directory| directory.ends_with("ninfer/converted"));
    match stem.rsplit_once('-') {
        Some((name, checksum))
            if in_conversion_cache
                && !name.is_empty()
                && checksum.len() == 16
                && checksum.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            name.to_string()
        }
        _ => stem,
    }
}

/// True when something accepts connections at `address` (`unix:PATH` or `HOST:PORT`): the
/// engine and the gateway listen only once they can serve.
pub fn listening(address: &str) -> bool {
    if let Some(path) = address.strip_prefix("unix:") {
        return std::os::unix::net::UnixStream::connect(path).is_ok();
    }
    use std::net::ToSocketAddrs;
    let Ok(mut resolved) = address.to_socket_addrs() else {
        return false;
    };
    resolved.any(|socket| {
        std::net::TcpStream::connect_timeout(&socket, Duration::from_millis(200)).is_ok()
    })
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let (location, plan) = plan_for(&args.model, &args.engine, &args.engine.request(None), true)?;
    let model = artifact_of(&location)?;
    install_stop_handler();
    let mut supervisor = Supervisor::new()?;
    let address = start_pipeline(&mut supervisor, &model, &args.listen, &args.engine, &plan)?;
    println!(
        "starting: engine API on {address}; logs in {}; Ctrl-C stops everything",
        supervisor.log_dir().display()
    );
    let result = wait_then_supervise(&mut supervisor, &address, &plan);
    supervisor.stop_all();
    result
}

/// Waits for the engine to listen (a child that dies meanwhile is reported, not restarted),
/// then supervises until a stop signal.
fn wait_then_supervise(
    supervisor: &mut Supervisor,
    address: &str,
    plan: &Plan,
) -> anyhow::Result<()> {
    let started = Instant::now();
    while !listening(address) {
        if stop_requested() {
            return Ok(());
        }
        supervisor.poll()?;
        std::thread::sleep(Duration::from_millis(50));
    }
    supervisor.mark_healthy();
    print_plan(plan);
    println!(
        "ready after {:.1}s: engine API on {address}",
        started.elapsed().as_secs_f64()
    );
    supervisor.run_until_stopped()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn served_names_drop_the_conversion_cache_checksum_only() {
        let cached =
            Path::new("/home/u/.cache/ninfer/converted/Qwen3-30B-A3B-0123456789abcdef.ninfer");
        assert_eq!(default_served_name(cached), "Qwen3-30B-A3B");
        // A user's own file keeps its whole name, whatever it ends with.
        let own = Path::new("/models/tiny-0123456789abcdef.ninfer");
        assert_eq!(default_served_name(own), "tiny-0123456789abcdef");
        let short = Path::new("/x/ninfer/converted/model-abc.ninfer");
        assert_eq!(default_served_name(short), "model-abc");
    }

    #[derive(Debug, Parser)]
    struct Command {
        model: PathBuf,
        #[command(flatten)]
        engine: EngineFlags,
    }

    fn engine_arguments(command_line: &[&str], gpu: bool) -> Vec<String> {
        let command = Command::try_parse_from(command_line).unwrap();
        let fixture =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe");
        let facts = ModelFacts::read(&locate_model(&fixture).unwrap()).unwrap();
        let mut machine = Machine::probe();
        machine.gpu = gpu.then_some(crate::plan::Gpu {
            free_bytes: 20 << 30,
            total_bytes: 24 << 30,
        });
        machine.gpus = Vec::new();
        let plan = plan(&facts, &machine, &command.engine.request(None)).unwrap();
        engine_command_line(
            Path::new("m.ninfer"),
            "127.0.0.1:1",
            &[],
            &command.engine,
            &plan,
        )
    }

    #[test]
    fn every_engine_flag_reaches_the_engine() {
        let arguments = engine_arguments(
            &[
                "ninfer",
                "model",
                "--kv-dtype",
                "f32",
                "--host-kv-mib",
                "64",
                "--prefix-cache-gib",
                "1.5",
                "--max-sequences",
                "2",
                "--moe-record-stats",
                "out.json",
                "--moe-offload",
                "--device",
                "cpu",
                "--engine-arg",
                "--worker-hang-ms",
                "--engine-arg",
                "700",
                "--",
                "--channel-max-tokens",
                "64",
            ],
            false,
        );
        let joined = arguments.join(" ");
        for expected in [
            "--kv-dtype f32",
            "--host-kv-mib 64",
            "--prefix-cache-gib 1.500",
            "--max-sequences 2",
            "--moe-record-stats out.json",
            "--device cpu",
            "--worker-hang-ms 700 --channel-max-tokens 64",
        ] {
            assert!(joined.contains(expected), "{expected:?} not in {joined}");
        }
        assert!(
            !joined.contains("--moe-offload"),
            "the engine has no such flag: {joined}"
        );
    }

    #[test]
    fn gpu_choice_flags_reach_the_engine() {
        let joined = engine_arguments(
            &["ninfer", "model", "--gpus", "0", "--gpu-split", "100"],
            true,
        )
        .join(" ");
        assert!(
            joined.contains("--gpus 0") && joined.contains("--gpu-split 100"),
            "{joined}"
        );
        let joined = engine_arguments(&["ninfer", "model"], true).join(" ");
        assert!(!joined.contains("--gpus"), "{joined}");
    }

    #[test]
    fn mtp_flags_reach_the_engine() {
        let joined = |line: &[&str]| engine_arguments(line, false).join(" ");
        assert!(
            joined(&["ninfer", "m", "--spec", "mtp", "--draft-tokens", "2"])
                .contains("--spec mtp --draft-tokens 2")
        );
        assert!(
            joined(&["ninfer", "m", "--draft-tokens", "3"]).contains("--spec mtp --draft-tokens 3")
        );
        assert!(!joined(&["ninfer", "m", "--no-mtp"]).contains("--spec"));
        assert!(!joined(&["ninfer", "m"]).contains("--spec"));
        assert!(Command::try_parse_from(["ninfer", "m", "--spec", "mtp", "--no-mtp"]).is_err());
    }

    #[test]
    fn gpu_experts_default_to_auto_on_a_gpu_unless_the_user_says() {
        assert!(engine_arguments(&["ninfer", "m"], true)
            .join(" ")
            .contains("--moe-gpu-experts auto"));
        assert!(!engine_arguments(&["ninfer", "m"], false)
            .join(" ")
            .contains("--moe-gpu-experts"));
        let passed = engine_arguments(&["ninfer", "m", "--", "--moe-gpu-experts", "3"], true);
        assert_eq!(
            passed.iter().filter(|a| *a == "--moe-gpu-experts").count(),
            1,
            "{passed:?}"
        );
        for cpu in [
            engine_arguments(&["ninfer", "m", "--device", "cpu"], true),
            engine_arguments(&["ninfer", "m", "--", "--device", "cpu"], true),
        ] {
            assert!(!cpu.join(" ").contains("--moe-gpu-experts"), "{cpu:?}");
        }
    }
}
