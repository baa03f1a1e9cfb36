//! `ninfer serve MODEL`: one expert worker per NUMA node plus the engine, as supervised child
//! processes on a private runtime directory; the engine's gRPC API on `--listen`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::supervisor::{install_stop_handler, numa_nodes, sibling_binary, ChildSpec, Supervisor};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The `.ninfer` artifact, or a directory holding exactly one.
    pub model: PathBuf,
    /// Address of the engine's gRPC API: `unix:PATH` or `HOST:PORT`.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// Compute threads per expert worker (default: every core of its node).
    #[arg(long)]
    pub moe_threads: Option<usize>,
    /// Longest prompt + completion per sequence, in tokens.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Run the routed experts inside the engine instead of in worker processes.
    #[arg(long)]
    pub no_workers: bool,
    /// Routed experts per MoE layer on the GPU: N, `half`, `all` or `auto` (as many as fit).
    #[arg(long, value_name = "N|half|all|auto")]
    pub moe_gpu_experts: Option<String>,
    /// Behave as if the GPU had this many GiB (stand in for a smaller card).
    #[arg(long, value_name = "GiB")]
    pub gpu_mem_budget: Option<f64>,
    /// Extra arguments for the engine (repeat the flag per argument).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
}

/// MODEL may be the artifact, a directory holding exactly one `.ninfer`, or a Hugging Face
/// checkpoint directory — converted once (bf16) into the user's cache and reused after.
pub fn resolve_model(path: &std::path::Path) -> anyhow::Result<PathBuf> {
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let found: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("listing {}", path.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "ninfer"))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] if ninfer_convert::is_checkpoint_dir(path) => converted_checkpoint(path),
        [] => anyhow::bail!(
            "{}: no .ninfer artifact in this directory (make one with `ninfer convert`)",
            path.display()
        ),
        many => anyhow::bail!(
            "{}: {} .ninfer artifacts here; name one",
            path.display(),
            many.len()
        ),
    }
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

/// Starts workers and engine under `supervisor`; returns the engine's address.
pub fn start_pipeline(supervisor: &mut Supervisor, args: &ServeArgs) -> anyhow::Result<String> {
    let model = resolve_model(&args.model)?;
    // Fail here, with the file named, rather than in a child's log.
    ninfer_artifact::Artifact::open(&model)
        .with_context(|| format!("opening {}", model.display()))?;
    let nodes = numa_nodes();
    let mut worker_addresses = Vec::new();
    if !args.no_workers {
        for (index, node) in nodes.iter().enumerate() {
            let address = supervisor.socket(&format!("experts-{node}"));
            let mut worker_args = vec![
                "--model".to_string(),
                model.display().to_string(),
                "--numa-node".into(),
                node.to_string(),
                "--experts".into(),
                if nodes.len() == 1 {
                    "all".into()
                } else {
                    format!("shard={index}/{}", nodes.len())
                },
                "--listen".into(),
                address.clone(),
            ];
            if let Some(threads) = args.moe_threads {
                worker_args.extend(["--moe-threads".into(), threads.to_string()]);
            }
            supervisor.add(ChildSpec {
                label: format!("experts-{node}"),
                program: sibling_binary("ninfer-expert-worker"),
                args: worker_args,
            })?;
            worker_addresses.push(address);
        }
    }
    let mut engine_args = vec![
        "--model".to_string(),
        model.display().to_string(),
        "--listen".into(),
        args.listen.clone(),
    ];
    if !worker_addresses.is_empty() {
        engine_args.extend(["--experts".into(), worker_addresses.join(",")]);
    }
    if let Some(context) = args.max_context {
        engine_args.extend(["--max-context".into(), context.to_string()]);
    }
    if let Some(count) = &args.moe_gpu_experts {
        engine_args.extend(["--moe-gpu-experts".into(), count.clone()]);
    }
    if let Some(gib) = args.gpu_mem_budget {
        engine_args.extend(["--gpu-mem-budget".into(), gib.to_string()]);
    }
    engine_args.extend(args.engine_args.iter().cloned());
    supervisor.add(ChildSpec {
        label: "engine".into(),
        program: sibling_binary("ninfer-engine"),
        args: engine_args,
    })?;
    Ok(args.listen.clone())
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    install_stop_handler();
    let mut supervisor = Supervisor::new()?;
    let address = start_pipeline(&mut supervisor, &args)?;
    println!(
        "engine API on {address}; logs in {}; Ctrl-C stops everything",
        supervisor.runtime_dir().display()
    );
    supervisor.run_until_stopped();
    supervisor.stop_all(Duration::from_secs(10));
    Ok(())
}
