//! `ninfer bench`: memory read bandwidth (the reference), routed-expert kernel throughput,
//! the channel round trip, MTP drafting (`bench_mtp.rs`), `ninfer bench MODEL` (the whole
//! pipeline, `bench_model.rs`) and `ninfer bench serve` (through the HTTP API, `bench_serve.rs`).
//!
//! Owns: the `bench` arguments, model-shape presets and the printed tables / JSON.
//! Must not touch: the measurements themselves (`ninfer_cpu_experts::bench`).

use anyhow::{bail, Context};
use ninfer_cpu_experts::bench::{
    bench_experts, measure_read_bandwidth, BandwidthResult, ExpertBenchConfig, ExpertBenchResult,
};
use ninfer_cpu_experts::{
    DownSplit, ExpertLayout, KernelIsa, KernelTuning, Prefetch, ThreadPool, WeightDType,
};

use crate::bench_model_report::print_bandwidth;

/// `ninfer bench MODEL [flags]` benchmarks a model end to end; `ninfer bench memory|experts|
/// channel` the parts. A MODEL file named like a subcommand needs a path (`./memory`).
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: Option<BenchCommand>,
    #[command(flatten)]
    model: crate::bench_model_args::ModelBenchArgs,
}

#[derive(Debug, clap::Subcommand)]
enum BenchCommand {
    /// Multi-threaded read bandwidth of this machine (the reference for `bench experts`).
    Memory(MemoryArgs),
    /// Routed-expert SwiGLU throughput per kernel path, against the read bandwidth.
    Experts(ExpertsArgs),
    /// Round-trip latency of the engine ↔ worker shared-memory channel (two processes).
    Channel(crate::bench_channel::ChannelBenchArgs),
    /// Greedy decode speed with the MTP head drafting 0, 1, 2, 3… tokens per step (in-process).
    Mtp(crate::bench_mtp::MtpBenchArgs),
    /// Host time to sample one token from a whole row of logits, per sampling setting.
    Sampling(crate::bench_sampling::SamplingBenchArgs),
    /// The path users take: streaming chat requests through the HTTP API at several
    /// concurrencies (TTFT, inter-token latency, tok/s, gateway CPU per token, /health under
    /// load), against the engine alone.
    Serve(crate::bench_serve::ServeBenchArgs),
    /// The Qwen3.5 vision tower's time for one square image at the released vision widths
    /// (synthetic weights).
    Vision(crate::bench_vision::VisionBenchArgs),
    /// The worker half of `bench channel` (started by it).
    #[command(hide = true)]
    ChannelEcho(crate::bench_channel::ChannelEchoArgs),
}

#[derive(Debug, clap::Args)]
struct PoolArgs {
    /// Threads (default: one per physical core of the NUMA node).
    #[arg(long)]
    threads: Option<usize>,
    /// NUMA node whose cores the threads are pinned to (all cores when the machine has none).
    #[arg(long, default_value_t = 0)]
    numa_node: usize,
}

#[derive(Debug, clap::Args)]
struct MemoryArgs {
    #[command(flatten)]
    pool: PoolArgs,
    /// Buffer size in GiB (far above the caches; the device's Xeon has 300 MiB of L3).
    #[arg(long, default_value_t = 8.0)]
    buffer_gib: f64,
    /// Timed passes over the buffer.
    #[arg(long, default_value_t = 10)]
    passes: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct ExpertsArgs {
    #[command(flatten)]
    pool: PoolArgs,
    /// Model shape: qwen3.5-35b-a3b, qwen3-30b-a3b, qwen3-next-80b-a3b, qwen3-235b-a22b.
    #[arg(long, default_value = "qwen3.5-35b-a3b")]
    preset: String,
    /// Weight dtypes, comma-separated: f32, bf16, int8, int4.
    #[arg(long, default_value = "int4")]
    dtype: String,
    /// Tokens per expert, comma-separated (1 = decode).
    #[arg(long, default_value = "1")]
    tokens: String,
    /// Kernel paths, comma-separated (scalar, avx2, avx512, avx512-vnni, amx), or `all`
    /// (every path this CPU supports).
    #[arg(long, default_value = "all")]
    kernel_isa: String,
    /// Experts computed per layer (default: the preset's top-k).
    #[arg(long)]
    experts_per_layer: Option<usize>,
    /// Expert weights allocated, GiB; layers rotate so the working set exceeds the caches.
    #[arg(long, default_value_t = 8.0)]
    working_set_gib: f64,
    /// Timed seconds per measurement.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Software prefetch distances in bytes for the streaming kernels, comma-separated, each
    /// optionally suffixed `:l2` to prefetch into L2 instead of L1; each is measured
    /// (0: hardware prefetchers only).
    #[arg(long, default_value = "4096:l2")]
    prefetch_bytes: String,
    /// How the down projection is split among threads: `auto` (per expert and row block for
    /// small batches, then a reduction) or `rows` (output rows only).
    #[arg(long, default_value = "auto")]
    down_split: String,
    /// Reference read bandwidth in GB/s (default: measured first, as `bench memory`).
    #[arg(long)]
    bandwidth_gbs: Option<f64>,
    /// Rounds: each measures the reference bandwidth again right before its kernel runs and
    /// states the kernels against it (on a shared machine the bandwidth moves between
    /// seconds; a ratio against a reference taken minutes apart mixes two machines).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// A model's routed-expert shape.
struct Preset {
    name: &'static str,
    hidden: usize,
    intermediate: usize,
    experts: usize,
    top_k: usize,
}

const PRESETS: [Preset; 4] = [
    Preset {
        name: "qwen3.5-35b-a3b",
        hidden: 2048,
        intermediate: 512,
        experts: 256,
        top_k: 8,
    },
    Preset {
        name: "qwen3-30b-a3b",
        hidden: 2048,
        intermediate: 768,
        experts: 128,
        top_k: 8,
    },
    Preset {
        name: "qwen3-next-80b-a3b",
        hidden: 2048,
        intermediate: 512,
        experts: 512,
        top_k: 10,
    },
    Preset {
        name: "qwen3-235b-a22b",
        hidden: 4096,
        intermediate: 1536,
        experts: 128,
        top_k: 8,
    },
];

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        Some(BenchCommand::Memory(args)) => run_memory(args),
        Some(BenchCommand::Experts(args)) => run_experts(args),
        Some(BenchCommand::Channel(args)) => crate::bench_channel::run(args),
        Some(BenchCommand::Mtp(args)) => crate::bench_mtp::run(args),
        Some(BenchCommand::Sampling(args)) => crate::bench_sampling::run(args),
        Some(BenchCommand::Serve(args)) => crate::bench_serve::run(args),
        Some(BenchCommand::Vision(args)) => crate::bench_vision::run(args),
        Some(BenchCommand::ChannelEcho(args)) => crate::bench_channel::run_echo(args),
        None => crate::bench_model::run(args.model),
    }
}

fn make_pool(args: &PoolArgs) -> anyhow::Result<ThreadPool> {
    if args.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    ThreadPool::for_numa_node(args.numa_node, args.threads).context("starting the thread pool")
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib_to_bytes(gib: f64, flag: &str) -> anyhow::Result<usize> {
    if !(gib.is_finite() && gib > 0.0 && gib < 4096.0) {
        bail!("{flag} must be a positive number of GiB, got {gib}");
    }
    Ok((gib * GIB) as usize)
}

fn run_memory(args: MemoryArgs) -> anyhow::Result<()> {
    let pool = make_pool(&args.pool)?;
    let bytes = gib_to_bytes(args.buffer_gib, "--buffer-gib")?;
    let result = measure_read_bandwidth(&pool, bytes, args.passes.max(1))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        print_bandwidth(&result, &pool);
    }
    Ok(())
}

fn parse_list<T>(
    text: &str,
    flag: &str,
    parse: impl Fn(&str) -> anyhow::Result<T>,
) -> anyhow::Result<Vec<T>> {
    let items: Vec<T> = text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| parse(item).with_context(|| format!("in {flag}")))
        .collect::<Result<_, _>>()?;
    if items.is_empty() {
        bail!("{flag} names nothing");
    }
    Ok(items)
}

/// Environment variable naming the expert kernels' scheduling choices for `bench experts`: a
/// comma-separated subset of `steal` and `shared` (see `KernelTuning`), or `none`. Unset: the
/// defaults (both on), as every other program runs.
const TUNING_ENV: &str = "NINFER_EXPERT_TUNING";

/// The scheduling choices of [`TUNING_ENV`], or the defaults when it is unset.
fn scheduling_from_env() -> anyhow::Result<KernelTuning> {
    match std::env::var(TUNING_ENV) {
        Ok(text) => KernelTuning::from_scheduling_words(&text).context(TUNING_ENV),
        Err(_) => Ok(KernelTuning::default()),
    }
}

fn run_experts(args: ExpertsArgs) -> anyhow::Result<()> {
    let Some(preset) = PRESETS
        .iter()
        .find(|p| p.name.eq_ignore_ascii_case(&args.preset))
    else {
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        bail!(
            "unknown preset `{}` (known: {})",
            args.preset,
            names.join(", ")
        );
    };
    let dtypes = parse_list(&args.dtype, "--dtype", |s| Ok(s.parse::<WeightDType>()?))?;
    let token_counts = parse_list(&args.tokens, "--tokens", |s| {
        let n: usize = s
            .parse()
            .with_context(|| format!("`{s}` is not a token count"))?;
        if n == 0 || n > 65536 {
            bail!("token count {n} out of range 1..=65536");
        }
        Ok(n)
    })?;
    let isas = if args.kernel_isa.trim().eq_ignore_ascii_case("all") {
        KernelIsa::supported()
    } else {
        parse_list(&args.kernel_isa, "--kernel-isa", |s| {
            Ok(s.parse::<KernelIsa>()?.require_supported()?)
        })?
    };
    let experts_per_layer = args.experts_per_layer.unwrap_or(preset.top_k);
    if experts_per_layer == 0 || experts_per_layer > preset.experts {
        bail!("--experts-per-layer must be in 1..={}", preset.experts);
    }
    if !(args.seconds.is_finite() && args.seconds > 0.0) {
        bail!("--seconds must be positive");
    }
    let working_set = gib_to_bytes(args.working_set_gib, "--working-set-gib")?;
    let down_split = match args.down_split.trim() {
        "auto" => DownSplit::Auto,
        "rows" => DownSplit::Rows,
        other => bail!("--down-split must be auto or rows, got `{other}`"),
    };
    let tuning = KernelTuning {
        down_split,
        ..scheduling_from_env()?
    };
    let pool = make_pool(&args.pool)?;
    let prefetches = parse_list(&args.prefetch_bytes, "--prefetch-bytes", |s| {
        let (bytes, into_l2) = match s.strip_suffix(":l2") {
            Some(bytes) => (bytes, true),
            None => (s, false),
        };
        let bytes = bytes
            .parse::<usize>()
            .with_context(|| format!("`{s}` is not a byte count"))?;
        Ok((bytes, into_l2))
    })?;

    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let measure_bandwidth = || -> anyhow::Result<BandwidthResult> {
        Ok(match args.bandwidth_gbs {
            Some(gbs) => BandwidthResult {
                threads: pool.threads(),
                buffer_bytes: 0,
                passes: 0,
                best_gbps: gbs,
                median_gbps: gbs,
                huge_page_bytes: None,
            },
            None => measure_read_bandwidth(&pool, 8 << 30, 10)?,
        })
    };
    let mut all: Vec<(usize, BandwidthResult, String, ExpertBenchResult)> = Vec::new();
    for round in 1..=args.rounds {
        let bandwidth = measure_bandwidth()?;
        if !args.json {
            if args.rounds > 1 {
                println!("round {round} of {}", args.rounds);
            }
            print_bandwidth(&bandwidth, &pool);
            if round == 1 {
                println!(
                    "preset {}: H={} Im={} E={} top-{}; {} experts per layer; cpu features: {}",
                    preset.name,
                    preset.hidden,
                    preset.intermediate,
                    preset.experts,
                    preset.top_k,
                    experts_per_layer,
                    KernelIsa::supported()
                        .iter()
                        .map(|i| i.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            println!(
                "{:<5} {:>6} {:<12} {:>8} {:>7} {:>10} {:>9} {:>8} {:>9} {:>21}",
                "dtype",
                "tokens",
                "isa",
                "prefetch",
                "layers",
                "layer µs",
                "GB/s",
                "% of bw",
                "GFLOP/s",
                "prep/gate_up/down µs"
            );
        }
        for &dtype in &dtypes {
            let layout = ExpertLayout::new(dtype, preset.hidden, preset.intermediate)?;
            for &tokens in &token_counts {
                for &(prefetch_bytes, into_l2) in &prefetches {
                    let prefetch = format!("{prefetch_bytes}{}", if into_l2 { ":l2" } else { "" });
                    let config = ExpertBenchConfig {
                        layout,
                        experts_per_layer,
                        tokens,
                        working_set_bytes: working_set,
                        min_seconds: args.seconds,
                        tuning: KernelTuning {
                            prefetch: Prefetch {
                                distance_bytes: prefetch_bytes,
                                into_l2,
                            },
                            ..tuning
                        },
                    };
                    let results = bench_experts(&pool, &config, &isas)?;
                    if let (false, Some(bytes)) =
                        (args.json, results.first().and_then(|r| r.huge_page_bytes))
                    {
                        println!(
                            "  ({:.1} GiB of the process on 2 MiB pages while the working set was streamed)",
                            bytes as f64 / GIB
                        );
                    }
                    for result in &results {
                        if !args.json {
                            println!(
                                "{:<5} {:>6} {:<12} {:>8} {:>7} {:>10.1} {:>9.1} {:>7.0}% {:>9.1} {:>21}",
                                result.dtype.name(),
                                result.tokens,
                                result.isa.name(),
                                prefetch,
                                result.layers,
                                result.layer_us,
                                result.weight_gbps,
                                100.0 * result.weight_gbps / bandwidth.best_gbps,
                                result.gflops,
                                format!(
                                    "{:.1}/{:.1}/{:.1}",
                                    result.phase_us[0], result.phase_us[1], result.phase_us[2]
                                )
                            );
                        }
                    }
                    if let (false, Some(first)) = (args.json, results.first()) {
                        println!(
                            "  (plain read of this working set right after: {:.1} GB/s; the kernels \
                             streamed {} of it)",
                            first.working_set_read_gbps,
                            results
                                .iter()
                                .map(|r| format!(
                                    "{:.0}%",
                                    100.0 * r.weight_gbps / first.working_set_read_gbps.max(1e-9)
                                ))
                                .collect::<Vec<_>>()
                                .join(", ")
                        );
                    }
                    all.extend(
                        results
                            .into_iter()
                            .map(|r| (round, bandwidth.clone(), prefetch.clone(), r)),
                    );
                }
            }
        }
    }
    if !args.json && args.rounds > 1 {
        // Each path's ratio per round, against that round's reference, in first-seen order.
        let mut paths: Vec<(String, Vec<f64>)> = Vec::new();
        for (_, bandwidth, prefetch, r) in &all {
            let path = format!(
                "{:<5} {:>6} {:<12} {:>8}",
                r.dtype.name(),
                r.tokens,
                r.isa.name(),
                prefetch
            );
            let ratio = 100.0 * r.weight_gbps / bandwidth.best_gbps;
            match paths.iter_mut().find(|(known, _)| *known == path) {
                Some((_, ratios)) => ratios.push(ratio),
                None => paths.push((path, vec![ratio])),
            }
        }
        // The median is the figure to quote on a machine whose bandwidth moves between rounds.
        println!("% of the same round's reference bandwidth, per round, and their median:");
        for (path, ratios) in &paths {
            let mut sorted = ratios.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            let middle = sorted.len() / 2;
            let median = if sorted.len() % 2 == 1 {
                sorted[middle]
            } else {
                (sorted[middle - 1] + sorted[middle]) / 2.0
            };
            let listed: Vec<String> = ratios.iter().map(|r| format!("{r:.0}%")).collect();
            println!("{path}: {}; median {median:.0}%", listed.join(" "));
        }
    }
    if args.json {
        let report = serde_json::json!({
            "preset": preset.name,
            "bandwidth": all.first().map(|(_, bandwidth, _, _)| bandwidth.clone()),
            "results": all.iter().map(|(round, bandwidth, prefetch, r)| {
                let mut value = serde_json::to_value(r).unwrap_or_default();
                if let Some(object) = value.as_object_mut() {
                    object.insert("bandwidth_ratio".into(), (r.weight_gbps / bandwidth.best_gbps).into());
                    object.insert("prefetch".into(), prefetch.clone().into());
                    object.insert("round".into(), (*round).into());
                    object.insert("round_bandwidth".into(), serde_json::to_value(bandwidth).unwrap_or_default());
                }
                value
            }).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}
