//! `ninfer bench MODEL`: end-to-end prefill and decode speed of the real pipeline (expert
//! workers + engine, as `ninfer serve` starts them, no gateway), with the decode time per token
//! split into its parts and the roofline ratio against this machine's measured bandwidths.
//!
//! Owns: the benchmark's flags, the random prompts, the timing at the client, the arithmetic
//! from the engine's profile counters (`GetProfile`) to the reported figures, the table / JSON.
//! Must not touch: the counters themselves (`ninfer_engine::profile`), the RAM bandwidth
//! measurement (`ninfer_cpu_experts::bench::measure_read_bandwidth`, as `bench memory`) or
//! the device one (`CudaBackend::measure_copy_bandwidth`, run by the engine).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ninfer_cpu_experts::bench::{measure_read_bandwidth, BandwidthResult};
use ninfer_cpu_experts::ThreadPool;
use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::{
    EngineProfile, EngineStatus, EngineStatusRequest, FinishReason, GenerateRequest,
    ModelInfoRequest, PhaseProfile, ProfileRequest, SamplingParameters,
};
use serde::Serialize;
use tonic::transport::Channel;

use crate::bench_during_prefill::{self, DecodeDuringPrefill};
use crate::serve::{connect_when_ready, plan_for, resolve_model, start_pipeline, EngineFlags};
use crate::supervisor::{install_stop_handler, stop_requested, Supervisor};

#[derive(Debug, clap::Args)]
pub struct ModelBenchArgs {
    /// The `.ninfer` artifact to benchmark (`ninfer bench MODEL`; a file named like a bench
    /// subcommand needs a path: `./memory`).
    #[arg(value_name = "MODEL")]
    pub model: Option<PathBuf>,
    /// Where the dense layers run: cpu, cuda or auto (the GPU when one opens).
    #[arg(long, default_value = "auto", value_parser = ["cpu", "cuda", "auto"])]
    pub device: String,
    /// Routed experts per MoE layer on the GPU: N, `half`, `all` or `auto` (as many as fit).
    #[arg(long, value_name = "N|half|all|auto")]
    pub moe_gpu_experts: Option<String>,
    /// Behave as if the GPU had this many GiB (stand in for a smaller card).
    #[arg(long, value_name = "GiB")]
    pub gpu_mem_budget: Option<f64>,
    /// Compute threads of the CPU experts (per worker, or in-process) and of the RAM
    /// bandwidth reference (default: every core of the NUMA node).
    #[arg(long)]
    pub moe_threads: Option<usize>,
    /// Compute the routed experts inside the engine instead of in worker processes.
    #[arg(long)]
    pub no_workers: bool,
    /// Prompt lengths in tokens, comma-separated; each is one row.
    #[arg(long, default_value = "512,4096")]
    pub prompt_lengths: String,
    /// Tokens decoded (batch 1) after each prompt.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Runs per prompt length (a fresh sequence each time); rows report their totals, and each
    /// run's tok/s is listed so reproducibility shows.
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Seed of the random prompts and of the sampling (temperature 1, top-k 20 as in Qwen's
    /// generation configs, so routing keeps changing as it does in real text; greedy decoding
    /// of a random model loops).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Buffer of the RAM bandwidth reference, GiB (as `bench memory --buffer-gib`).
    #[arg(long, default_value_t = 8.0)]
    pub ram_buffer_gib: f64,
    /// Timed passes of the RAM bandwidth reference.
    #[arg(long, default_value_t = 10)]
    pub ram_passes: usize,
    /// NUMA node of the RAM bandwidth reference's threads.
    #[arg(long, default_value_t = 0)]
    pub numa_node: usize,
    /// Seconds to wait for the engine (and workers) to load the model.
    #[arg(long, default_value_t = 900.0)]
    pub ready_timeout: f64,
    /// Also decode this many sequences at once (after the batch-1 runs): the aggregate decode
    /// rate while all of them decode, from the first prompt length. 1: batch 1 only.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Batch sizes of the batch-decode table, comma-separated (for example `1,8`): for each,
    /// that many sequences decode at once from the first prompt length, and the table gives
    /// their aggregate and per-sequence tok/s and the aggregate over batch 1's (when 1 is
    /// listed). Empty: no table.
    #[arg(long, value_name = "B,B,...", default_value = "")]
    pub decode_batch: String,
    /// Also measure one stream's decode alone, then while a second request's prompt of N
    /// tokens is prefilled beside it (until that prompt's first token): both tok/s, their
    /// ratio, the stream's step percentiles and longest gap, the long prompt's prefill tok/s
    /// and time to first token. The stream's prompt is the first of `--prompt-lengths`; the
    /// scheduler's prefill share and chunk are the engine's (`--engine-arg`).
    #[arg(long, value_name = "N")]
    pub decode_during_prefill: Option<usize>,
    /// Extra arguments for the engine (repeat the flag per argument).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The compute peak, TFLOP/s, that each prefill's share of the compute limit is taken
    /// against (e.g. a GPU's dense bf16 peak); default: the GPU expert rate the engine
    /// measured at start for layerwise prefill.
    #[arg(long, value_name = "TFLOPS")]
    pub peak_tflops: Option<f64>,
}

/// How much arithmetic one prompt token costs, from the model's config and tensor sizes.
#[derive(Debug, Clone, Copy, Serialize)]
struct PrefillArithmetic {
    /// `2 ·` the dense matrix parameters (attention, routers, shared experts, dense MLPs;
    /// not the embedding table, not the output head, which a prefill runs for its last token
    /// only).
    dense_flops_per_token: f64,
    /// `6 · hidden · moe_intermediate · top-k ·` MoE layers.
    expert_flops_per_token: f64,
    /// Causal attention: `4 · heads · head_dim` FLOPs per (query, key) pair (scores and the
    /// weighted sum) per full-attention layer, `L (L + 1) / 2` pairs for a prompt of `L`.
    attention_flops_per_pair: f64,
}

impl PrefillArithmetic {
    fn of(artifact: &ninfer_artifact::Artifact) -> Self {
        let config = artifact.config();
        let common = config.common();
        let dense_parameters: u64 = artifact
            .header()
            .tensors
            .iter()
            .filter(|tensor| {
                matches!(
                    tensor.class,
                    ninfer_artifact::TensorClass::Dense | ninfer_artifact::TensorClass::DenseMlp
                ) && !tensor.name.starts_with("lm_head")
            })
            .map(|tensor| tensor.element_count())
            .sum();
        let moe_layers = common.moe_layers.iter().filter(|&&moe| moe).count();
        let attention_layers = config.hybrid().map_or(common.num_hidden_layers, |hybrid| {
            hybrid
                .layer_types
                .iter()
                .filter(|&&kind| kind == ninfer_artifact::LayerType::FullAttention)
                .count()
        });
        PrefillArithmetic {
            dense_flops_per_token: 2.0 * dense_parameters as f64,
            expert_flops_per_token: 6.0
                * (common.hidden_size * common.moe_intermediate_size) as f64
                * (common.num_experts_per_tok * moe_layers) as f64,
            attention_flops_per_pair: 4.0
                * (common.num_attention_heads * common.head_dim * attention_layers) as f64,
        }
    }

    /// FLOPs of one prompt of `length` tokens.
    fn prompt_flops(&self, length: usize) -> f64 {
        let pairs = length as f64 * (length as f64 + 1.0) / 2.0;
        length as f64 * (self.dense_flops_per_token + self.expert_flops_per_token)
            + pairs * self.attention_flops_per_pair
    }
}

/// How close a prefill came to the two limits of layerwise prefill (per prompt length, all
/// repeats).
#[derive(Debug, Clone, Serialize)]
struct PrefillLimits {
    /// Expert bytes streamed into the staging slots (all repeats).
    streamed_expert_bytes: u64,
    /// `streamed_expert_bytes` / the engine's measured pinned host-to-device rate (ms).
    pcie_limit_ms: Option<f64>,
    /// `pcie_limit_ms` / the prefill's wall time: 1 = the prefill ran at the speed of its copies.
    pcie_share: Option<f64>,
    /// The prompts' FLOPs ([`PrefillArithmetic`]).
    flops: f64,
    /// `flops` / the compute peak (ms).
    compute_limit_ms: Option<f64>,
    /// `compute_limit_ms` / the prefill's wall time.
    compute_share: Option<f64>,
}

/// Decode time per token, split (milliseconds). The parts add up to `engine_forward` and
/// `engine_forward + other` = the measured time per token.
#[derive(Debug, Clone, Copy, Default, Serialize)]
struct Split {
    /// Forward time outside the MoE layers' expert wait and copies: attention, dense layers,
    /// routers, shared experts, GPU-resident experts not hidden behind the CPU, the head.
    gpu_dense: f64,
    /// CPU expert computation (as the workers report it; in-process: all of the expert wait).
    cpu_experts: f64,
    /// Expert wait minus expert computation: the channel round trip and the slowest-worker wait.
    channel_wait: f64,
    /// Host ↔ device copies of the MoE input and the CPU experts' sum (on a GPU, including the
    /// wait for the work queued before the download).
    transfers: f64,
    /// Outside the engine's forwards: sampling, scheduling, gRPC to the client.
    other: f64,
}

/// Figures of one phase over all repeats of one prompt length.
#[derive(Debug, Clone, Serialize)]
struct PhaseFigures {
    tokens: u64,
    forwards: u64,
    /// Client-side wall time of the phase, all repeats (ms).
    wall_ms: f64,
    tok_per_s: f64,
    /// Each repeat's tok/s.
    tok_per_s_per_repeat: Vec<f64>,
    /// Engine forward time per token (ms).
    engine_forward_ms_per_token: f64,
    /// Wall time per token at the client (ms).
    ms_per_token: f64,
    split_ms_per_token: Split,
    /// Distinct experts per token computed on the CPU side, summed over MoE layers.
    cpu_experts_per_token: f64,
    /// … and from GPU-resident slots.
    gpu_experts_per_token: f64,
    /// `cpu_experts_per_token` × expert stride: expert weight bytes read from RAM.
    cpu_expert_bytes_per_token: f64,
    /// Resident expert bytes read from device memory per token.
    gpu_expert_bytes_per_token: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Row {
    prompt_tokens: usize,
    decode_tokens: usize,
    repeats: usize,
    prefill: PhaseFigures,
    prefill_limits: PrefillLimits,
    decode: PhaseFigures,
    /// Each repeat's decode split (ms per token), in run order.
    decode_split_per_repeat: Vec<Split>,
    /// Time between consecutive decoded tokens at the client, all repeats pooled.
    decode_step_ms: StepLatency,
    /// … per repeat, in run order.
    decode_step_ms_per_repeat: Vec<StepLatency>,
    /// Prefill tok/s at the client (prompt tokens ÷ time to the first token).
    prefill_tok_s: f64,
    /// Decode tok/s at the client (batch 1).
    decode_tok_s: f64,
    /// Bytes a decoded token must move from RAM and from device memory, and the time that
    /// takes at the measured bandwidths (ms).
    ram_bytes_per_token: f64,
    device_bytes_per_token: f64,
    ideal_ms_per_token: Option<f64>,
    /// ideal ÷ measured time per decoded token (1 = at the bandwidth limit).
    roofline_ratio: Option<f64>,
}

/// Time between consecutive tokens of a sequence at the client (ms): how even the decode
/// steps are, which a mean rate hides (a slow step every so often, a stall behind a prompt).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct StepLatency {
    /// Gaps measured.
    pub steps: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl StepLatency {
    /// Nearest-rank percentiles of `gaps`; all zero when there are none.
    pub(crate) fn of(gaps: &[Duration]) -> Self {
        let mut ms: Vec<f64> = gaps.iter().map(|gap| gap.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let rank = |p: f64| {
            if ms.is_empty() {
                return 0.0;
            }
            let index = ((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1;
            ms[index]
        };
        StepLatency {
            steps: ms.len(),
            p50_ms: rank(0.50),
            p99_ms: rank(0.99),
            max_ms: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// The gaps between consecutive arrivals.
pub(crate) fn gaps(arrivals: &[Instant]) -> Vec<Duration> {
    arrivals
        .windows(2)
        .map(|pair| pair[1].saturating_duration_since(pair[0]))
        .collect()
}

#[derive(Debug, Serialize)]
struct Report {
    /// `--concurrency` above 1: the aggregate decode of that many sequences at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    concurrent_decode: Option<ConcurrentDecode>,
    /// `--decode-batch`: the aggregate decode of each batch size.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    decode_batches: Vec<BatchDecodeRow>,
    /// `--decode-during-prefill`: one stream's decode alone and beside a long prompt's prefill.
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_during_prefill: Option<DecodeDuringPrefill>,
    model: String,
    architecture: String,
    device: String,
    expert_executor: String,
    moe_gpu_experts: String,
    gpu_mem_budget_gib: Option<f64>,
    /// Routed experts per MoE layer the engine placed in GPU slots (`moe_gpu_experts` resolved).
    gpu_experts_per_layer: u32,
    expert_stride_bytes: u64,
    dense_weight_bytes_per_forward: u64,
    expert_compute_reported_by_workers: bool,
    ram_bandwidth: BandwidthResult,
    /// `2 · size / time` of a device-to-device copy on the GPU (null on the CPU device).
    device_bandwidth_gbps: Option<f64>,
    device_bandwidth_error: Option<String>,
    roofline: RooflineBasis,
    /// The rates layerwise prefill measured at start (null when it is off) and the limits
    /// each prefill is compared with.
    prefill_basis: PrefillBasis,
    results: Vec<Row>,
    /// The dynamic expert cache over the measured runs (null without GPU expert slots).
    expert_cache: Option<ExpertCacheFigures>,
}

/// The engine's expert cache counters (`GetStatus`) over the measured runs.
#[derive(Debug, Serialize)]
struct ExpertCacheFigures {
    gpu_expert_slots: u32,
    /// Routed choices whose expert was in a GPU slot / was not.
    hits: u64,
    misses: u64,
    hit_rate: f64,
    /// The same from each run's first token to its end (decode only).
    decode_hits: u64,
    decode_misses: u64,
    decode_hit_rate: f64,
    fills: u64,
    /// Bytes the fills copied per second of measured time (the PCIe load the cache adds).
    fill_gb_per_s: f64,
}

impl ExpertCacheFigures {
    fn between(
        before: &EngineStatus,
        after: &EngineStatus,
        decode: CacheCounts,
        stride: u64,
        elapsed: Duration,
    ) -> Option<Self> {
        if after.gpu_expert_slots == 0 {
            return None;
        }
        let CacheCounts { hits, misses } = CacheCounts::between(before, after);
        let fills = after
            .expert_slot_refills_total
            .saturating_sub(before.expert_slot_refills_total);
        Some(ExpertCacheFigures {
            gpu_expert_slots: after.gpu_expert_slots,
            hits,
            misses,
            hit_rate: hits as f64 / (hits + misses).max(1) as f64,
            decode_hits: decode.hits,
            decode_misses: decode.misses,
            decode_hit_rate: decode.hits as f64 / (decode.hits + decode.misses).max(1) as f64,
            fills,
            fill_gb_per_s: (fills * stride) as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9,
        })
    }
}

async fn engine_status(client: &mut EngineClient<Channel>) -> anyhow::Result<EngineStatus> {
    Ok(client
        .get_status(EngineStatusRequest {})
        .await
        .context("reading the engine's status (GetStatus)")?
        .into_inner())
}

#[derive(Debug, Serialize)]
struct PrefillBasis {
    /// The engine's pinned host-to-device copy rate into the staging slots, GB/s.
    pcie_gbps: Option<f64>,
    /// The GPU's and the expert executor's routed-expert rates, TFLOP/s, as measured.
    gpu_expert_tflops: Option<f64>,
    cpu_expert_tflops: Option<f64>,
    /// The peak the compute limit is taken against, TFLOP/s, and where it comes from.
    compute_peak_tflops: Option<f64>,
    compute_peak: String,
    arithmetic: PrefillArithmetic,
    pcie_limit: &'static str,
    compute_limit: &'static str,
}

#[derive(Debug, Serialize)]
struct RooflineBasis {
    ratio: &'static str,
    denominator: &'static str,
    ideal: String,
}

fn parse_lengths(text: &str) -> anyhow::Result<Vec<usize>> {
    let lengths: Vec<usize> = text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.parse::<usize>()
                .ok()
                // One token would make the prompt's forward look like a decode step.
                .filter(|&n| n >= 2)
                .with_context(|| {
                    format!("--prompt-lengths: `{item}` is not a length of at least 2 tokens")
                })
        })
        .collect::<Result<_, _>>()?;
    if lengths.is_empty() {
        bail!("--prompt-lengths names nothing");
    }
    Ok(lengths)
}

/// `--decode-batch`: batch sizes of at least 1, in the order given, without repeats.
fn parse_decode_batches(text: &str) -> anyhow::Result<Vec<usize>> {
    let mut batches: Vec<usize> = Vec::new();
    for item in text
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
    {
        let batch = item
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .with_context(|| {
                format!("--decode-batch: `{item}` is not a batch size of at least 1")
            })?;
        if !batches.contains(&batch) {
            batches.push(batch);
        }
    }
    Ok(batches)
}

/// One row of the batch-decode table.
#[derive(Debug, Serialize)]
struct BatchDecodeRow {
    #[serde(flatten)]
    decode: ConcurrentDecode,
    /// Aggregate tok/s over batch 1's (null when batch 1 was not measured).
    aggregate_over_batch_1: Option<f64>,
}

/// Seeded pseudo-random token ids below `vocab` (splitmix64).
pub(crate) fn random_tokens(count: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut state = seed;
    (0..count)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % u64::from(vocab.max(1))) as u32
        })
        .collect()
}

pub fn run(args: ModelBenchArgs) -> anyhow::Result<()> {
    let Some(model_arg) = args.model.clone() else {
        bail!("name a MODEL (`ninfer bench MODEL`) or a subcommand (memory, experts, channel)");
    };
    let lengths = parse_lengths(&args.prompt_lengths)?;
    let decode_batches = parse_decode_batches(&args.decode_batch)?;
    if args.decode_tokens == 0 {
        bail!("--decode-tokens must be at least 1");
    }
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if args.moe_threads == Some(0) {
        bail!("--moe-threads must be at least 1");
    }
    if !(args.ram_buffer_gib.is_finite() && args.ram_buffer_gib > 0.0) {
        bail!("--ram-buffer-gib must be a positive number of GiB");
    }
    if !(model_arg.exists()) {
        bail!(
            "{}: no such model file (make one with `ninfer convert`)",
            model_arg.display()
        );
    }
    let model = resolve_model(&model_arg)?;
    let artifact = ninfer_artifact::Artifact::open(&model)
        .with_context(|| format!("opening {}", model.display()))?;
    let architecture = artifact.config().architecture().to_string();
    let arithmetic = PrefillArithmetic::of(&artifact);
    let model_context = artifact.config().common().max_position_embeddings;
    drop(artifact);
    if args
        .peak_tflops
        .is_some_and(|peak| !(peak.is_finite() && peak > 0.0))
    {
        bail!("--peak-tflops must be a positive number");
    }
    let longest = lengths.iter().copied().max().unwrap_or(1);
    let mut max_context = longest + args.decode_tokens + 1;
    // The stream of `--decode-during-prefill` asks for every position the context leaves it,
    // up to the model's limit, so it outlasts the long prompt's prefill by a wide margin.
    let mut stream_max_new_tokens = 0;
    if let Some(prompt) = args.decode_during_prefill {
        if prompt < 2 {
            bail!("--decode-during-prefill must be a prompt of at least 2 tokens");
        }
        if prompt >= model_context {
            bail!(
                "--decode-during-prefill {prompt}: the prompt and its first token need {} \
                 positions; the model holds {model_context}",
                prompt + 1
            );
        }
        let wanted = lengths[0].saturating_add(bench_during_prefill::stream_tokens_wanted(
            args.decode_tokens,
            prompt,
        ));
        max_context = max_context.max(prompt + 1).max(wanted.min(model_context));
        stream_max_new_tokens = max_context.saturating_sub(lengths[0]);
        if stream_max_new_tokens
            < args.decode_tokens + 2 + bench_during_prefill::TOKENS_AFTER_PREFILL
        {
            bail!(
                "--decode-during-prefill: the stream's prompt (the first --prompt-lengths entry, \
                 {} tokens) leaves it only {stream_max_new_tokens} of the model's \
                 {model_context} positions",
                lengths[0]
            );
        }
    }

    // The reference first, while nothing else runs; its pool is gone before the workers pin
    // their threads.
    let ram_bandwidth = {
        let pool = ThreadPool::for_numa_node(args.numa_node, args.moe_threads)
            .context("starting the RAM bandwidth threads")?;
        let bytes = (args.ram_buffer_gib * (1u64 << 30) as f64) as usize;
        let result = measure_read_bandwidth(&pool, bytes, args.ram_passes.max(1))
            .context("measuring RAM read bandwidth")?;
        if !args.json {
            crate::bench::print_bandwidth(&result, &pool);
        }
        result
    };

    install_stop_handler();
    let mut supervisor = Supervisor::new()?;
    let mut engine_args = vec![
        "--device".to_string(),
        args.device.clone(),
        // One sequence's KV cache per sequence decoded at once, so `--gpu-mem-budget` leaves
        // the rest to experts.
        "--max-sequences".into(),
        decode_batches
            .iter()
            .copied()
            .chain([args.concurrency])
            // The stream and the long prompt.
            .chain(args.decode_during_prefill.map(|_| 2))
            .max()
            .unwrap_or(1)
            .max(1)
            .to_string(),
    ];
    engine_args.extend(args.engine_args.iter().cloned());
    let flags = EngineFlags {
        moe_threads: args.moe_threads,
        max_context: Some(max_context),
        no_workers: args.no_workers,
        // Exactly what was asked (0 when not given): the benchmark's figures name it.
        moe_gpu_experts: Some(args.moe_gpu_experts.clone().unwrap_or_else(|| "0".into())),
        gpu_mem_budget: args.gpu_mem_budget,
        engine_args,
        ..EngineFlags::default()
    };
    let (_, plan) = plan_for(&model, &flags, &flags.request(None), false)?;
    let listen = supervisor.socket("engine");
    let address = start_pipeline(&mut supervisor, &model, &listen, &flags, &plan)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(measure(
        &args,
        &lengths,
        &decode_batches,
        stream_max_new_tokens,
        &address,
        &mut supervisor,
        ram_bandwidth,
        model.display().to_string(),
        architecture,
        arithmetic,
    ));
    supervisor.stop_all();
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

/// Decode of several sequences at once, from the client's token arrival times.
#[derive(Debug, Serialize)]
struct ConcurrentDecode {
    sequences: usize,
    prompt_tokens: usize,
    /// Tokens of every sequence over the window in which all of them were decoding (from the
    /// last first token to the first last token), per second.
    aggregate_tok_s: f64,
    /// Per sequence in that window.
    per_sequence_tok_s: f64,
    /// Time between consecutive tokens of a sequence, every sequence's steps that ended in
    /// that window.
    step_ms: StepLatency,
}

/// Client-side times of one generation.
struct Timing {
    prefill: Duration,
    decode: Duration,
    decoded: usize,
    /// The gaps between consecutive tokens (the decode steps as the client sees them).
    steps: Vec<Duration>,
    /// The expert cache's hits and misses from the first token to the end: the decode's
    /// routing without the prompt's (whose thousands of tokens dominate the whole-run counts).
    /// The status is read beside the stream when the first token arrives, so a decode step or
    /// two may fall before it.
    decode_cache: CacheCounts,
}

/// Routed choices served from a GPU slot and not.
#[derive(Debug, Default, Clone, Copy)]
struct CacheCounts {
    hits: u64,
    misses: u64,
}

impl CacheCounts {
    fn between(before: &EngineStatus, after: &EngineStatus) -> Self {
        CacheCounts {
            hits: after
                .expert_cache_hits_total
                .saturating_sub(before.expert_cache_hits_total),
            misses: after
                .expert_cache_misses_total
                .saturating_sub(before.expert_cache_misses_total),
        }
    }

    fn add(&mut self, other: CacheCounts) {
        self.hits += other.hits;
        self.misses += other.misses;
    }
}

async fn generate(
    client: &mut EngineClient<Channel>,
    prompt: Vec<u32>,
    new_tokens: usize,
    seed: u64,
) -> anyhow::Result<Timing> {
    let request = bench_request(
        format!("bench-{seed}-{}", prompt.len()),
        prompt,
        new_tokens,
        seed,
    );
    let started = Instant::now();
    let mut stream = client
        .generate(request)
        .await
        .context("starting a generation")?
        .into_inner();
    let mut arrivals = Vec::with_capacity(new_tokens);
    let mut status_at_first_token = None;
    while let Some(message) = stream.message().await.context("generating")? {
        if !message.no_token {
            arrivals.push(Instant::now());
            if arrivals.len() == 1 {
                // Beside the stream, so reading it does not delay the next tokens' arrival.
                let mut status_client = client.clone();
                status_at_first_token = Some(tokio::spawn(async move {
                    engine_status(&mut status_client).await
                }));
            }
        }
        let reason =
            FinishReason::try_from(message.finish_reason).unwrap_or(FinishReason::Unspecified);
        if reason != FinishReason::Unspecified && reason != FinishReason::Length {
            bail!(
                "the generation ended early ({reason:?}) after {} tokens",
                arrivals.len()
            );
        }
    }
    let (Some(&first), Some(&last)) = (arrivals.first(), arrivals.last()) else {
        bail!("the engine produced no token");
    };
    if arrivals.len() != new_tokens {
        bail!(
            "asked for {new_tokens} tokens, the engine produced {}",
            arrivals.len()
        );
    }
    let decode_cache = match status_at_first_token {
        Some(task) => {
            let at_first_token = task
                .await
                .context("reading the engine's status at the first token")??;
            CacheCounts::between(&at_first_token, &engine_status(client).await?)
        }
        None => CacheCounts::default(),
    };
    Ok(Timing {
        prefill: first - started,
        decode: last - first,
        decoded: arrivals.len() - 1,
        steps: gaps(&arrivals),
        decode_cache,
    })
}

/// A bench generation: `new_tokens` sampled at temperature 1 (top-20) with `seed` (greedy
/// decoding of random weights loops over a few tokens, and so over a few experts).
pub(crate) fn bench_request(
    request_id: String,
    prompt: Vec<u32>,
    new_tokens: usize,
    seed: u64,
) -> GenerateRequest {
    GenerateRequest {
        request_id,
        prompt_token_ids: prompt,
        max_new_tokens: new_tokens as u32,
        sampling: Some(SamplingParameters {
            temperature: 1.0,
            top_k: 20,
            seed: Some(seed),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The arrival time of every token of one generation.
async fn token_arrivals(
    mut client: EngineClient<Channel>,
    prompt: Vec<u32>,
    new_tokens: usize,
    seed: u64,
) -> anyhow::Result<Vec<Instant>> {
    let request = bench_request(format!("bench-concurrent-{seed}"), prompt, new_tokens, seed);
    let mut stream = client
        .generate(request)
        .await
        .context("starting a generation")?
        .into_inner();
    let mut arrivals = Vec::with_capacity(new_tokens);
    while let Some(message) = stream.message().await.context("generating")? {
        if !message.no_token {
            arrivals.push(Instant::now());
        }
    }
    if arrivals.len() != new_tokens {
        bail!(
            "asked for {new_tokens} tokens, the engine produced {}",
            arrivals.len()
        );
    }
    Ok(arrivals)
}

/// `sequences` generations at once: the decode rate over the window in which every one of
/// them was decoding.
async fn measure_concurrent_decode(
    client: &EngineClient<Channel>,
    sequences: usize,
    prompt_tokens: usize,
    decode_tokens: usize,
    vocab: u32,
    seed: u64,
) -> anyhow::Result<ConcurrentDecode> {
    let runs: Vec<_> = (0..sequences)
        .map(|index| {
            let seed = seed.wrapping_mul(7_919).wrapping_add(index as u64);
            tokio::spawn(token_arrivals(
                client.clone(),
                random_tokens(prompt_tokens, vocab, seed),
                decode_tokens + 1,
                seed,
            ))
        })
        .collect();
    let mut arrivals = Vec::with_capacity(sequences);
    for run in runs {
        arrivals.push(run.await.context("a concurrent generation's task")??);
    }
    let (start, end) = common_decode_window(&arrivals, decode_tokens)?;
    let tokens: usize = arrivals
        .iter()
        .map(|a| a.iter().filter(|&&t| t > start && t <= end).count())
        .sum();
    let steps: Vec<Duration> = arrivals
        .iter()
        .flat_map(|a| {
            a.windows(2)
                .filter(|pair| pair[1] > start && pair[1] <= end)
                .map(|pair| pair[1] - pair[0])
        })
        .collect();
    let seconds = (end - start).as_secs_f64();
    Ok(ConcurrentDecode {
        sequences,
        prompt_tokens,
        aggregate_tok_s: tokens as f64 / seconds,
        per_sequence_tok_s: tokens as f64 / seconds / sequences as f64,
        step_ms: StepLatency::of(&steps),
    })
}

/// The window in which every concurrent generation was decoding: from the last one's first
/// token to the first one's last. Where there is none (the prompts prefilled one after the
/// other, and an early sequence finished its `decode_tokens` before a late one began), the error
/// says how many decode tokens would have made them overlap, at the early sequence's own pace.
fn common_decode_window(
    arrivals: &[Vec<Instant>],
    decode_tokens: usize,
) -> anyhow::Result<(Instant, Instant)> {
    if arrivals.is_empty() || arrivals.iter().any(Vec::is_empty) {
        bail!("a concurrent generation produced no token");
    }
    let start = arrivals.iter().filter_map(|a| a.first()).max().copied();
    let end = arrivals.iter().filter_map(|a| a.last()).min().copied();
    let (Some(start), Some(end)) = (start, end) else {
        bail!("a concurrent generation produced no token");
    };
    if end > start {
        return Ok((start, end));
    }
    let gap = start - end;
    // The sequence that finished first, and its time per token.
    let per_token = arrivals
        .iter()
        .filter(|a| a.last() == Some(&end) && a.len() > 1)
        .find_map(|a| {
            let (first, last) = (a.first()?, a.last()?);
            Some((*last - *first).as_secs_f64() / (a.len() - 1) as f64)
        })
        .filter(|&seconds| seconds > 0.0);
    let advice = match per_token {
        Some(seconds) => {
            // A quarter more than the bare overlap, so the window holds a few steps of all.
            let needed = decode_tokens as f64 + 1.25 * gap.as_secs_f64() / seconds;
            format!(
                "; ask for at least {} decode tokens (--decode-tokens) so that all overlap",
                needed.ceil() as u64
            )
        }
        None => String::new(),
    };
    bail!(
        "the {} concurrent generations never decoded at the same time: the last one's first token came {:.2} s after the first one's last{advice}",
        arrivals.len(),
        gap.as_secs_f64()
    )
}

async fn profile(
    client: &mut EngineClient<Channel>,
    reset: bool,
    measure_device_bandwidth: bool,
) -> anyhow::Result<EngineProfile> {
    Ok(client
        .get_profile(ProfileRequest {
            reset,
            measure_device_bandwidth,
        })
        .await
        .context("reading the engine's profile (GetProfile)")?
        .into_inner())
}

fn add_phase(total: &mut PhaseProfile, part: &PhaseProfile) {
    total.forwards += part.forwards;
    total.tokens += part.tokens;
    total.forward_nanos += part.forward_nanos;
    total.expert_wait_nanos += part.expert_wait_nanos;
    total.expert_compute_nanos += part.expert_compute_nanos;
    total.transfer_nanos += part.transfer_nanos;
    total.moe_layer_calls += part.moe_layer_calls;
    total.cpu_experts += part.cpu_experts;
    total.resident_experts += part.resident_experts;
    total.cpu_expert_bytes += part.cpu_expert_bytes;
    total.resident_expert_bytes += part.resident_expert_bytes;
    total.streamed_experts += part.streamed_experts;
    total.streamed_expert_bytes += part.streamed_expert_bytes;
}

/// The figures of a phase: `counters` from the engine, `wall` at the client for `tokens`.
fn phase_figures(
    counters: &PhaseProfile,
    tokens: u64,
    wall: Duration,
    per_repeat: Vec<f64>,
) -> PhaseFigures {
    let per_token = |nanos: u64| nanos as f64 / 1e6 / tokens.max(1) as f64;
    let forward = per_token(counters.forward_nanos);
    // The client's window cannot be shorter than the engine's computing; when it is, the
    // stream delivered several tokens together (sub-millisecond tokens on a busy machine) and
    // the engine's forward time is the better measure.
    let wall = wall.max(Duration::from_nanos(counters.forward_nanos));
    let ms_per_token = wall.as_secs_f64() * 1e3 / tokens.max(1) as f64;
    let wait = per_token(counters.expert_wait_nanos);
    let compute = per_token(
        counters
            .expert_compute_nanos
            .min(counters.expert_wait_nanos),
    );
    let transfers = per_token(counters.transfer_nanos);
    let count = |value: u64| value as f64 / tokens.max(1) as f64;
    PhaseFigures {
        tokens,
        forwards: counters.forwards,
        wall_ms: wall.as_secs_f64() * 1e3,
        tok_per_s: tokens as f64 / wall.as_secs_f64().max(1e-12),
        tok_per_s_per_repeat: per_repeat,
        engine_forward_ms_per_token: forward,
        ms_per_token,
        split_ms_per_token: Split {
            gpu_dense: (forward - wait - transfers).max(0.0),
            cpu_experts: compute,
            channel_wait: wait - compute,
            transfers,
            other: (ms_per_token - forward).max(0.0),
        },
        cpu_experts_per_token: count(counters.cpu_experts),
        gpu_experts_per_token: count(counters.resident_experts),
        cpu_expert_bytes_per_token: count(counters.cpu_expert_bytes),
        gpu_expert_bytes_per_token: count(counters.resident_expert_bytes),
    }
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    args: &ModelBenchArgs,
    lengths: &[usize],
    decode_batches: &[usize],
    stream_max_new_tokens: usize,
    address: &str,
    supervisor: &mut Supervisor,
    ram_bandwidth: BandwidthResult,
    model: String,
    architecture: String,
    arithmetic: PrefillArithmetic,
) -> anyhow::Result<Report> {
    let mut client = connect_when_ready(
        address,
        supervisor,
        Duration::from_secs_f64(args.ready_timeout.clamp(1.0, 86_400.0)),
    )
    .await?;
    let vocab = client
        .get_model_info(ModelInfoRequest {})
        .await
        .context("reading the model's info")?
        .into_inner()
        .vocab_size;
    let first = profile(&mut client, false, false).await?;
    let on_gpu = first.device == "cuda";
    let (device_bandwidth_gbps, device_bandwidth_error) = if on_gpu {
        let measured = profile(&mut client, false, true).await?;
        if measured.device_copy_bytes_per_second > 0.0 {
            (Some(measured.device_copy_bytes_per_second / 1e9), None)
        } else {
            (None, Some(measured.device_bandwidth_error))
        }
    } else {
        (None, None)
    };
    if !args.json {
        match (device_bandwidth_gbps, &device_bandwidth_error) {
            (Some(gbps), _) => println!("device copy bandwidth: {gbps:.1} GB/s (2 · size / time)"),
            (None, Some(problem)) => println!("device copy bandwidth: not measured: {problem}"),
            (None, None) => {}
        }
    }
    // Warm-up, not measured: one whole run of the first measured shape (prompt and every
    // decoded token). First touches of weights and kernels, and the growth of the engine's
    // buffer pools and KV cache up to that shape, are not the steady state: with a 16-token
    // warm-up the first of two measured runs decoded 6–9% slower than the second in every
    // pair (docs/BENCHMARKS.md).
    generate(
        &mut client,
        random_tokens(lengths[0], vocab, args.seed ^ 0xa5a5),
        args.decode_tokens + 1,
        args.seed,
    )
    .await
    .context("warm-up generation")?;
    profile(&mut client, true, false).await?;

    let ram_bytes_per_second = ram_bandwidth.best_gbps * 1e9;
    let positive = |value: f64| (value > 0.0).then_some(value);
    let pcie_bytes_per_second = positive(first.prefill_copy_bytes_per_second);
    let gpu_expert_flops =
        positive(first.prefill_gpu_pairs_per_second * first.expert_flops_per_pair);
    let cpu_expert_flops =
        positive(first.prefill_executor_pairs_per_second * first.expert_flops_per_pair);
    let compute_peak = args
        .peak_tflops
        .map(|peak| peak * 1e12)
        .or(gpu_expert_flops);
    let status_before = engine_status(&mut client).await?;
    let measuring = Instant::now();
    let mut decode_cache = CacheCounts::default();
    let mut rows = Vec::new();
    let mut last = first;
    for &length in lengths {
        let (mut prefill, mut decode) = (PhaseProfile::default(), PhaseProfile::default());
        let (mut prefill_wall, mut decode_wall) = (Duration::ZERO, Duration::ZERO);
        let (mut prefill_rates, mut decode_rates) = (Vec::new(), Vec::new());
        let mut decoded = 0u64;
        let mut decode_split_per_repeat = Vec::new();
        let (mut decode_steps, mut decode_step_ms_per_repeat) = (Vec::new(), Vec::new());
        for repeat in 0..args.repeats {
            if stop_requested() {
                bail!("interrupted");
            }
            let seed = args
                .seed
                .wrapping_mul(1_000_003)
                .wrapping_add((length as u64) << 8 | repeat as u64);
            let prompt = random_tokens(length, vocab, seed);
            // One token more than decoded: the first comes from the prefill forward.
            let timing = generate(&mut client, prompt, args.decode_tokens + 1, seed)
                .await
                .with_context(|| format!("prompt of {length} tokens, run {}", repeat + 1))?;
            let counters = profile(&mut client, true, false).await?;
            add_phase(&mut prefill, &counters.prefill.unwrap_or_default());
            add_phase(&mut decode, &counters.decode.unwrap_or_default());
            decode_cache.add(timing.decode_cache);
            prefill_wall += timing.prefill;
            decode_wall += timing.decode;
            decoded += timing.decoded as u64;
            prefill_rates.push(length as f64 / timing.prefill.as_secs_f64().max(1e-12));
            decode_rates.push(timing.decoded as f64 / timing.decode.as_secs_f64().max(1e-12));
            decode_step_ms_per_repeat.push(StepLatency::of(&timing.steps));
            decode_steps.extend_from_slice(&timing.steps);
            // Each run's own split shows which part moves when two runs differ.
            let run_decode = counters.decode.unwrap_or_default();
            decode_split_per_repeat.push(
                phase_figures(
                    &run_decode,
                    timing.decoded as u64,
                    timing.decode,
                    Vec::new(),
                )
                .split_ms_per_token,
            );
            last = counters;
        }
        let prompt_tokens = (length * args.repeats) as u64;
        let streamed_expert_bytes = prefill.streamed_expert_bytes;
        let prefill = phase_figures(&prefill, prompt_tokens, prefill_wall, prefill_rates);
        let prefill_seconds = prefill.wall_ms / 1e3;
        let flops = arithmetic.prompt_flops(length) * args.repeats as f64;
        let pcie_limit = pcie_bytes_per_second
            .filter(|_| streamed_expert_bytes > 0)
            .map(|rate| streamed_expert_bytes as f64 / rate);
        let compute_limit = compute_peak.map(|peak| flops / peak);
        let prefill_limits = PrefillLimits {
            streamed_expert_bytes,
            pcie_limit_ms: pcie_limit.map(|s| s * 1e3),
            pcie_share: pcie_limit.map(|s| s / prefill_seconds.max(1e-12)),
            flops,
            compute_limit_ms: compute_limit.map(|s| s * 1e3),
            compute_share: compute_limit.map(|s| s / prefill_seconds.max(1e-12)),
        };
        let decode = phase_figures(&decode, decoded, decode_wall, decode_rates);
        let dense = last.dense_weight_bytes_per_forward as f64;
        // Where each byte of a decoded token is read from: CPU experts from RAM; dense
        // weights and resident experts from the device's memory (RAM on the CPU device).
        let (ram_bytes, device_bytes) = if on_gpu {
            (
                decode.cpu_expert_bytes_per_token,
                dense + decode.gpu_expert_bytes_per_token,
            )
        } else {
            (
                decode.cpu_expert_bytes_per_token + dense + decode.gpu_expert_bytes_per_token,
                0.0,
            )
        };
        let ideal_seconds = match device_bandwidth_gbps {
            _ if !on_gpu => Some(ram_bytes / ram_bytes_per_second),
            Some(gbps) => Some(ram_bytes / ram_bytes_per_second + device_bytes / (gbps * 1e9)),
            None => None,
        };
        let ideal_ms = ideal_seconds.map(|s| s * 1e3);
        rows.push(Row {
            prompt_tokens: length,
            decode_tokens: args.decode_tokens,
            repeats: args.repeats,
            prefill_tok_s: prefill.tok_per_s,
            decode_tok_s: decode.tok_per_s,
            ram_bytes_per_token: ram_bytes,
            device_bytes_per_token: device_bytes,
            roofline_ratio: ideal_ms.map(|ideal| ideal / decode.ms_per_token.max(1e-12)),
            ideal_ms_per_token: ideal_ms,
            prefill,
            prefill_limits,
            decode,
            decode_split_per_repeat,
            decode_step_ms: StepLatency::of(&decode_steps),
            decode_step_ms_per_repeat,
        });
    }
    let concurrent_decode = if args.concurrency > 1 {
        let figures = measure_concurrent_decode(
            &client,
            args.concurrency,
            lengths[0],
            args.decode_tokens,
            vocab,
            args.seed,
        )
        .await
        .with_context(|| format!("decoding {} sequences at once", args.concurrency))?;
        profile(&mut client, true, false).await?;
        Some(figures)
    } else {
        None
    };
    let mut decode_batch_rows: Vec<BatchDecodeRow> = Vec::with_capacity(decode_batches.len());
    for &batch in decode_batches {
        let decode = measure_concurrent_decode(
            &client,
            batch,
            lengths[0],
            args.decode_tokens,
            vocab,
            args.seed.wrapping_add(batch as u64),
        )
        .await
        .with_context(|| format!("decoding a batch of {batch} sequences"))?;
        profile(&mut client, true, false).await?;
        decode_batch_rows.push(BatchDecodeRow {
            decode,
            aggregate_over_batch_1: None,
        });
    }
    let batch_1 = decode_batch_rows
        .iter()
        .find(|row| row.decode.sequences == 1)
        .map(|row| row.decode.aggregate_tok_s);
    if let Some(batch_1) = batch_1.filter(|&rate| rate > 0.0) {
        for row in &mut decode_batch_rows {
            row.aggregate_over_batch_1 = Some(row.decode.aggregate_tok_s / batch_1);
        }
    }
    let decode_during_prefill = match args.decode_during_prefill {
        Some(prompt) => {
            let figures = bench_during_prefill::measure(
                &client,
                prompt,
                lengths[0],
                stream_max_new_tokens,
                args.decode_tokens,
                vocab,
                args.seed.wrapping_add(0xdec0de),
            )
            .await
            .with_context(|| format!("decoding during a prefill of {prompt} tokens"))?;
            profile(&mut client, true, false).await?;
            Some(figures)
        }
        None => None,
    };
    let expert_cache = ExpertCacheFigures::between(
        &status_before,
        &engine_status(&mut client).await?,
        decode_cache,
        last.expert_stride_bytes,
        measuring.elapsed(),
    );
    Ok(Report {
        concurrent_decode,
        decode_batches: decode_batch_rows,
        decode_during_prefill,
        expert_cache,
        model,
        architecture,
        device: last.device.clone(),
        expert_executor: last.expert_executor.clone(),
        moe_gpu_experts: args
            .moe_gpu_experts
            .clone()
            .unwrap_or_else(|| "0".into()),
        gpu_mem_budget_gib: args.gpu_mem_budget,
        gpu_experts_per_layer: last.gpu_experts_per_layer,
        expert_stride_bytes: last.expert_stride_bytes,
        dense_weight_bytes_per_forward: last.dense_weight_bytes_per_forward,
        expert_compute_reported_by_workers: last.expert_compute_reported,
        ram_bandwidth,
        device_bandwidth_gbps,
        device_bandwidth_error,
        roofline: RooflineBasis {
            ratio: "ideal time per decoded token / measured time per decoded token (1 = at the bandwidth limit)",
            denominator: "wall time per decoded token at the client (batch 1, gRPC stream, sampling included; never less than the engine's forward time, which it replaces when the stream delivered tokens together)",
            ideal: if on_gpu {
                "CPU expert bytes / RAM bandwidth (best of the reference) + (dense bytes + resident expert bytes) / device copy bandwidth".into()
            } else {
                "(CPU expert bytes + dense bytes) / RAM bandwidth (best of the reference); the CPU device reads every weight from RAM".into()
            },
        },
        prefill_basis: PrefillBasis {
            pcie_gbps: pcie_bytes_per_second.map(|rate| rate / 1e9),
            gpu_expert_tflops: gpu_expert_flops.map(|rate| rate / 1e12),
            cpu_expert_tflops: cpu_expert_flops.map(|rate| rate / 1e12),
            compute_peak_tflops: compute_peak.map(|rate| rate / 1e12),
            compute_peak: match (args.peak_tflops, gpu_expert_flops) {
                (Some(_), _) => "--peak-tflops".into(),
                (None, Some(_)) => "the GPU expert rate the engine measured at start (grouped expert kernels over 4096 rows of uniform routing)".into(),
                (None, None) => "none (layerwise prefill off and no --peak-tflops)".into(),
            },
            arithmetic,
            pcie_limit: "expert bytes streamed into the staging slots / the engine's measured pinned host-to-device rate; share = that time / the prefill's wall time",
            compute_limit: "prompt FLOPs (2 · dense matrix parameters + 6 · hidden · moe_intermediate · top-k · MoE layers per token, + 4 · heads · head_dim per causal (query, key) pair per full-attention layer) / the compute peak; share = that time / the prefill's wall time",
        },
        results: rows,
    })
}

fn print_report(report: &Report) {
    let mb = |bytes: f64| bytes / 1e6;
    println!(
        "model {} ({}), device {}, experts {}{}, GPU experts per layer: {}{}: {} placed",
        report.model,
        report.architecture,
        report.device,
        report.expert_executor,
        if report.expert_compute_reported_by_workers {
            " (compute time reported by the workers)"
        } else {
            ""
        },
        report.moe_gpu_experts,
        report
            .gpu_mem_budget_gib
            .map(|gib| format!(" (budget {gib} GiB)"))
            .unwrap_or_default(),
        report.gpu_experts_per_layer
    );
    println!(
        "dense weights {:.1} MB per forward; one expert {:.2} MB",
        mb(report.dense_weight_bytes_per_forward as f64),
        mb(report.expert_stride_bytes as f64)
    );
    let basis = &report.prefill_basis;
    let optional = |value: Option<f64>, digits: usize| {
        value
            .map(|v| format!("{v:.digits$}"))
            .unwrap_or_else(|| "-".into())
    };
    println!(
        "prefill limits: PCIe {} GB/s (pinned host-to-device, measured by the engine), GPU experts {} TFLOP/s, CPU experts {} TFLOP/s; compute peak {} TFLOP/s ({})",
        optional(basis.pcie_gbps, 1),
        optional(basis.gpu_expert_tflops, 1),
        optional(basis.cpu_expert_tflops, 2),
        optional(basis.compute_peak_tflops, 1),
        basis.compute_peak
    );
    for row in &report.results {
        let limits = &row.prefill_limits;
        let share = |value: Option<f64>| {
            value
                .map(|v| format!("{:.0}%", 100.0 * v))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "  prompt {:>6}: prefill {:>9.1} tok/s, streamed {:.2} GB, PCIe limit {} ms ({} reached), compute limit {} ms ({} reached)",
            row.prompt_tokens,
            row.prefill_tok_s,
            limits.streamed_expert_bytes as f64 / 1e9,
            optional(limits.pcie_limit_ms, 1),
            share(limits.pcie_share),
            optional(limits.compute_limit_ms, 1),
            share(limits.compute_share),
        );
    }
    println!("  PCIe limit = {}.", basis.pcie_limit);
    println!("  compute limit = {}.", basis.compute_limit);
    if let Some(batch) = &report.concurrent_decode {
        println!(
            "{} sequences at once (prompts of {} tokens): aggregate decode {:.1} tok/s, {:.1} tok/s per sequence, step p50 {:.2} ms, p99 {:.2} ms",
            batch.sequences,
            batch.prompt_tokens,
            batch.aggregate_tok_s,
            batch.per_sequence_tok_s,
            batch.step_ms.p50_ms,
            batch.step_ms.p99_ms
        );
    }
    if !report.decode_batches.is_empty() {
        println!(
            "batch decode (prompts of {} tokens; tok/s over the window in which every sequence decodes):",
            report.decode_batches[0].decode.prompt_tokens
        );
        println!(
            "{:>6} {:>14} {:>16} {:>16} {:>9} {:>9}",
            "batch", "aggregate tok/s", "per-seq tok/s", "× batch 1", "p50 ms", "p99 ms"
        );
        for row in &report.decode_batches {
            println!(
                "{:>6} {:>14.1} {:>16.1} {:>16} {:>9.2} {:>9.2}",
                row.decode.sequences,
                row.decode.aggregate_tok_s,
                row.decode.per_sequence_tok_s,
                row.aggregate_over_batch_1
                    .map(|ratio| format!("{ratio:.2}"))
                    .unwrap_or_else(|| "-".into()),
                row.decode.step_ms.p50_ms,
                row.decode.step_ms.p99_ms
            );
        }
    }
    if let Some(figures) = &report.decode_during_prefill {
        bench_during_prefill::print(figures);
    }
    if let Some(cache) = &report.expert_cache {
        println!(
            "expert cache ({} GPU slots): hit rate {:.1}% ({} hits, {} misses), decode only {:.1}% ({} hits, {} misses), {} fills, fill bandwidth {:.2} GB/s",
            cache.gpu_expert_slots,
            100.0 * cache.hit_rate,
            cache.hits,
            cache.misses,
            100.0 * cache.decode_hit_rate,
            cache.decode_hits,
            cache.decode_misses,
            cache.fills,
            cache.fill_gb_per_s
        );
    }
    println!(
        "{:>7} {:>9} {:>8} {:>8} {:>7} {:>7} | {:>9} {:>8} {:>8} {:>9} {:>7} | {:>9} {:>9} {:>8} {:>8}",
        "prompt",
        "prefill",
        "decode",
        "ms/tok",
        "p50 ms",
        "p99 ms",
        "gpu/dense",
        "cpu exp",
        "channel",
        "transfers",
        "other",
        "RAM MB/t",
        "GPU MB/t",
        "ideal ms",
        "roofline"
    );
    for row in &report.results {
        let split = &row.decode.split_ms_per_token;
        println!(
            "{:>7} {:>9.1} {:>8.2} {:>8.2} {:>7.2} {:>7.2} | {:>9.2} {:>8.2} {:>8.2} {:>9.2} {:>7.2} | {:>9.1} {:>9.1} {:>8} {:>8}",
            row.prompt_tokens,
            row.prefill_tok_s,
            row.decode_tok_s,
            row.decode.ms_per_token,
            row.decode_step_ms.p50_ms,
            row.decode_step_ms.p99_ms,
            split.gpu_dense,
            split.cpu_experts,
            split.channel_wait,
            split.transfers,
            split.other,
            mb(row.ram_bytes_per_token),
            mb(row.device_bytes_per_token),
            row.ideal_ms_per_token
                .map(|ms| format!("{ms:.2}"))
                .unwrap_or_else(|| "-".into()),
            row.roofline_ratio
                .map(|r| format!("{:.0}%", 100.0 * r))
                .unwrap_or_else(|| "-".into()),
        );
        if row.repeats > 1 {
            let list = |rates: &[f64]| {
                rates
                    .iter()
                    .map(|r| format!("{r:.1}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let splits = |part: fn(&Split) -> f64| {
                row.decode_split_per_repeat
                    .iter()
                    .map(|split| format!("{:.2}", part(split)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let steps = row
                .decode_step_ms_per_repeat
                .iter()
                .map(|step| format!("{:.2}/{:.2}", step.p50_ms, step.p99_ms))
                .collect::<Vec<_>>()
                .join(", ");
            println!(
                "        per run: prefill {} tok/s; decode {} tok/s; step p50/p99 ms {}; decode \
                 ms/tok: gpu/dense {}, cpu exp {}, channel {}",
                list(&row.prefill.tok_per_s_per_repeat),
                list(&row.decode.tok_per_s_per_repeat),
                steps,
                splits(|split| split.gpu_dense),
                splits(|split| split.cpu_experts),
                splits(|split| split.channel_wait),
            );
        }
    }
    println!(
        "prefill/decode: tok/s at the client (decode at batch 1, {} tokens after the prompt). \
         p50/p99 ms: time between consecutive decoded tokens at the client. Columns after \
         p99 ms: decode time per token in ms. roofline = {}; measured = {}; ideal = {}.",
        report.results.first().map(|r| r.decode_tokens).unwrap_or(0),
        report.roofline.ratio,
        report.roofline.denominator,
        report.roofline.ideal
    );
}

#[cfg(test)]
mod tests {
    use super::{common_decode_window, parse_decode_batches};
    use std::time::{Duration, Instant};

    /// Arrival times at `offsets` milliseconds after `zero`.
    fn at(zero: Instant, offsets: &[u64]) -> Vec<Instant> {
        offsets
            .iter()
            .map(|&ms| zero + Duration::from_millis(ms))
            .collect()
    }

    #[test]
    fn the_common_window_runs_from_the_last_first_token_to_the_first_last_one() {
        let zero = Instant::now();
        let arrivals = [at(zero, &[0, 10, 20, 30]), at(zero, &[5, 15, 25, 35, 45])];
        let (start, end) = common_decode_window(&arrivals, 4).unwrap();
        assert_eq!(start, zero + Duration::from_millis(5));
        assert_eq!(end, zero + Duration::from_millis(30));
    }

    #[test]
    fn generations_that_never_overlap_are_told_how_many_tokens_would() {
        let zero = Instant::now();
        // The first decodes 3 tokens 10 ms apart and is done at 30 ms; the second starts at
        // 130 ms: 100 ms = 10 of the first's tokens too few, 12.5 with the margin.
        let arrivals = [at(zero, &[0, 10, 20, 30]), at(zero, &[130, 140, 150, 160])];
        let error = common_decode_window(&arrivals, 3).unwrap_err().to_string();
        assert!(error.contains("came 0.10 s after"), "{error}");
        assert!(error.contains("at least 16 decode tokens"), "{error}");
        assert!(common_decode_window(&[Vec::new(), at(zero, &[1])], 1)
            .unwrap_err()
            .to_string()
            .contains("produced no token"));
    }

    #[test]
    fn decode_batches_parse_in_order_without_repeats_and_refuse_zero() {
        assert_eq!(parse_decode_batches("1,8").ok(), Some(vec![1, 8]));
        assert_eq!(parse_decode_batches(" 8, 1 ,8,").ok(), Some(vec![8, 1]));
        assert_eq!(parse_decode_batches("").ok(), Some(vec![]));
        assert!(parse_decode_batches("0").is_err());
        assert!(parse_decode_batches("1,x").is_err());
    }
}
