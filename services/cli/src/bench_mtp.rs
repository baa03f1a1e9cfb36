//! `ninfer bench mtp MODEL`: decode speed with the model's MTP head drafting 0 (off), 1, 2, 3…
//! tokens per step, greedy, in this process, on the CPU or the GPU, with the serving engine's
//! expert placement options (`--moe-gpu-experts`, `--gpu-mem-budget`, the dynamic expert cache
//! or `--moe-static-experts`).
//!
//! Per run it reports tok/s, tokens per main-model step, acceptance per draft depth, and the
//! union of routed experts one MoE layer reads per verification (the N + 1 rows route to up to
//! (N + 1) · top-k experts; where experts are read from RAM, that union decides whether drafts
//! pay). `--force-acceptance` (benchmarks only) sets the acceptance a random-weight head cannot
//! reach; its rows are marked.
//!
//! Owns: the arguments and the printed table (the model is opened and its experts placed by
//! `crate::in_process`). Must not touch: the drafting, verification and forced decisions
//! (`ninfer_engine::model::greedy_with_mtp_options`).

use std::path::PathBuf;

use anyhow::{bail, Context};
use ninfer_engine::model::{
    greedy_with_mtp_options, ForcedAcceptance, SpeculationOptions, SpeculativeOutcome,
};
use ninfer_engine::moe::placement::GpuExpertCount;
use ninfer_engine::{Backend, Model};

use crate::in_process::{self, with_model, CpuExperts, Placement, PlacementRequest};

#[derive(Debug, clap::Args)]
pub struct MtpBenchArgs {
    /// The `.ninfer` artifact (it must carry an MTP head).
    pub model: PathBuf,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// Draft tokens per step to measure, comma-separated (0 = MTP off).
    #[arg(long, default_value = "0,1,2,3")]
    pub draft_tokens: String,
    /// Size each step's drafts from the acceptance seen so far, as the server does (the
    /// counts of --draft-tokens are then maxima).
    #[arg(long)]
    pub adaptive_drafts: bool,
    /// TEST ONLY (benchmarks of random-weight models, whose MTP head is almost never right):
    /// accept drafts at these rates instead of the verifier's decision, comma-separated per
    /// depth as this table reports them (share of chains accepted through depth 1, 2, 3…; the
    /// trained fixture measures 0.80,0.56,0.41). Drafts are still computed and verified and
    /// rejections rolled back; the tokens are no longer the model's greedy output. Rows are
    /// marked `forced`. `ninfer run`, `serve` and the engine have no such option.
    #[arg(long, value_name = "RATE,RATE,…")]
    pub force_acceptance: Option<String>,
    /// Seed of --force-acceptance's coin flips (each run starts from it).
    #[arg(long, default_value_t = 1)]
    pub force_acceptance_seed: u64,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 128)]
    pub tokens: usize,
    /// The prompt (tokenized with the artifact's tokenizer).
    #[arg(long, default_value = "def read_lines(path):\n    with open(path")]
    pub prompt: String,
    /// Timed runs per draft count (after one warm-up); the median is printed.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Threads of the CPU expert kernels (0: every core).
    #[arg(long, default_value_t = 0)]
    pub moe_threads: usize,
    /// Routed experts per MoE layer in GPU slots: N, `half`, `all` or `auto` (as many as fit);
    /// the rest are computed by the CPU kernels. Default: all on cuda, 0 on cpu (where slots
    /// are host copies, for tests).
    #[arg(long, value_name = "N|half|all|auto")]
    pub moe_gpu_experts: Option<GpuExpertCount>,
    /// Behave as if the GPU had this many GiB (stand in for a smaller card).
    #[arg(long, value_name = "GiB")]
    pub gpu_mem_budget: Option<f64>,
    /// Keep the start-up placement of the GPU experts. Without it the slots follow the routing
    /// (the dynamic expert cache) when some of a layer's experts are in slots and some are not.
    #[arg(long)]
    pub moe_static_experts: bool,
}

/// Longest prompt in tokens: the expert slots' budget counts the KV cache before the prompt is
/// tokenized.
const PROMPT_LIMIT: usize = 4096;

/// The parsed run settings.
struct Settings {
    draft_counts: Vec<usize>,
    forced_rates: Option<Vec<f64>>,
}

pub fn run(args: MtpBenchArgs) -> anyhow::Result<()> {
    let draft_counts: Vec<usize> = args
        .draft_tokens
        .split(',')
        .map(|n| n.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| {
            format!(
                "--draft-tokens {:?}: not a list of counts",
                args.draft_tokens
            )
        })?;
    if args.tokens < 2 || args.repeats == 0 {
        bail!("--tokens must be at least 2 and --repeats at least 1");
    }
    let forced_rates = match &args.force_acceptance {
        Some(text) => {
            let rates: Vec<f64> = text
                .split(',')
                .map(|rate| rate.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .with_context(|| format!("--force-acceptance {text:?}: not a list of rates"))?;
            // Checked once here, so a bad list fails before the model loads.
            ForcedAcceptance::new(&rates, args.force_acceptance_seed)
                .with_context(|| format!("--force-acceptance {text:?}"))?;
            Some(rates)
        }
        None => None,
    };
    if let Some(gib) = args.gpu_mem_budget {
        if !(gib.is_finite() && gib > 0.0) {
            bail!("--gpu-mem-budget must be a positive number of GiB, got {gib}");
        }
    }
    let max_drafts = draft_counts.iter().copied().max().unwrap_or(0);
    let request = PlacementRequest {
        count: args.moe_gpu_experts.unwrap_or(if args.device == "cuda" {
            GpuExpertCount::All
        } else {
            GpuExpertCount::Count(0)
        }),
        budget_gib: args.gpu_mem_budget,
        static_experts: args.moe_static_experts,
        // The prompt is at most a few hundred tokens; its length is known only after the
        // tokenizer is loaded with the model.
        max_context: args.tokens + max_drafts + 1 + PROMPT_LIMIT,
    };
    let cpu_experts = CpuExperts::Kernels {
        threads: args.moe_threads,
    };
    let (model, placement) =
        in_process::open_placed(&args.model, &args.device, cpu_experts, &request)?;
    let settings = Settings {
        draft_counts,
        forced_rates,
    };
    with_model!(&model, |model| measure(model, &args, &settings, &placement))
}

fn measure<B: Backend>(
    model: &Model<B>,
    args: &MtpBenchArgs,
    settings: &Settings,
    placement: &Placement,
) -> anyhow::Result<()> {
    if !model.has_mtp() {
        bail!(
            "{} has no MTP head (no `mtp.*` tensors)",
            args.model.display()
        );
    }
    let tokenizer = in_process::tokenizer(model, &args.model)?;
    let prompt = tokenizer
        .encode(args.prompt.as_str(), false)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
        .get_ids()
        .to_vec();
    if prompt.is_empty() {
        bail!("--prompt is empty after tokenization");
    }
    if prompt.len() > PROMPT_LIMIT {
        bail!(
            "--prompt is {} tokens; at most {PROMPT_LIMIT}",
            prompt.len()
        );
    }
    let top_k = model.spec().common.num_experts_per_tok.max(1);
    let placed =
        match &placement.expert_cache {
            None => "every routed expert on the CPU kernels".to_string(),
            Some(_) if placement.gpu_experts_per_layer >= model.spec().common.num_experts => {
                "every routed expert in expert slots".to_string()
            }
            Some(cache) => format!(
            "{} experts per layer in expert slots{}, the rest on the CPU kernels, expert cache {}",
            placement.gpu_experts_per_layer,
            args.gpu_mem_budget
                .map(|gib| format!(" (budget {gib} GiB)"))
                .unwrap_or_default(),
            if cache.fills_per_layer == 0 {
                "static".to_string()
            } else {
                format!("dynamic ({} fills per layer and step)", cache.fills_per_layer)
            }
        ),
        };
    let num_experts = model.spec().common.num_experts;
    // The MTP layer is placed like one more MoE layer: say where its experts ended up.
    let mtp_placed = match model.mtp_resident_experts() {
        None => "the MTP layer has no routed experts".to_string(),
        Some(0) => "the MTP layer's routed experts on the CPU kernels".to_string(),
        Some(resident) if resident >= num_experts => {
            format!("the MTP layer's routed experts: all {resident} in expert slots")
        }
        Some(resident) => format!(
            "the MTP layer's routed experts: {resident} of {num_experts} in expert slots, the \
             rest on the CPU kernels"
        ),
    };
    println!(
        "{} on {}: {} prompt tokens, {} generated, median of {} runs; {placed}; {mtp_placed}",
        args.model.display(),
        model.backend().name(),
        prompt.len(),
        args.tokens,
        args.repeats
    );
    if let Some(rates) = &settings.forced_rates {
        println!(
            "TEST ONLY: acceptance forced to {} by depth (seed {}): rows marked `forced` measure \
             the cost of drafting at that rate, not this model's acceptance",
            rates
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(" / "),
            args.force_acceptance_seed
        );
    }
    println!(
        "experts/verify: distinct routed experts one MoE layer reads per verification (the \
         union over its rows; top-{top_k} without drafts)"
    );
    println!(
        " drafts  adaptive  decision     tok/s   vs off   tokens/step   rows/verify   by depth              experts/verify   ÷ top-k   cache hits   MTP hits   same tokens as off"
    );
    let mut off: Option<(f64, Vec<u32>)> = None;
    for &drafts in &settings.draft_counts {
        let forced = settings.forced_rates.as_ref().filter(|_| drafts > 0);
        let options = || -> anyhow::Result<SpeculationOptions> {
            Ok(SpeculationOptions {
                draft_tokens: drafts,
                adaptive: args.adaptive_drafts && drafts > 0,
                forced_acceptance: forced
                    .map(|rates| ForcedAcceptance::new(rates, args.force_acceptance_seed))
                    .transpose()?,
            })
        };
        greedy_with_mtp_options(model, &prompt, args.tokens, options()?)?;
        let cache_before = placement.expert_cache.as_ref().map(|c| c.total());
        let mtp_layer = model.mtp_layer_index();
        let mtp_cache_before = placement
            .expert_cache
            .as_ref()
            .and_then(|c| c.per_layer().get(mtp_layer).copied());
        let mut runs: Vec<SpeculativeOutcome> = Vec::with_capacity(args.repeats);
        for _ in 0..args.repeats {
            runs.push(greedy_with_mtp_options(
                model,
                &prompt,
                args.tokens,
                options()?,
            )?);
        }
        let cache_hits = match (&placement.expert_cache, cache_before) {
            (Some(cache), Some(before)) => {
                let after = cache.total();
                let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
                format!(
                    "{:.1}%",
                    100.0 * hits as f64 / (hits + misses).max(1) as f64
                )
            }
            _ => "—".to_string(),
        };
        // The MTP layer's share of routed choices that found their expert in a slot.
        let mtp_cache_hits = match (&placement.expert_cache, mtp_cache_before) {
            (Some(cache), Some(before)) => match cache.per_layer().get(mtp_layer) {
                Some(after) => {
                    let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
                    // Without drafts the MTP layer routes nothing.
                    if hits + misses == 0 {
                        "—".to_string()
                    } else {
                        format!("{:.1}%", 100.0 * hits as f64 / (hits + misses) as f64)
                    }
                }
                None => "—".to_string(),
            },
            _ => "—".to_string(),
        };
        runs.sort_by_key(|run| run.decode_time);
        let median = &runs[runs.len() / 2];
        let speed = (median.tokens.len() - 1) as f64 / median.decode_time.as_secs_f64().max(1e-9);
        let acceptance: Vec<String> = median
            .accepted
            .iter()
            .zip(&median.drafted)
            .map(|(a, d)| format!("{:.2}", *a as f64 / (*d).max(1) as f64))
            .collect();
        let (ratio, same) = match &off {
            Some((off_speed, off_tokens)) => (
                format!("{:.2}×", speed / off_speed),
                if forced.is_some() {
                    "forced"
                } else if *off_tokens == median.tokens {
                    "yes"
                } else {
                    "NO"
                },
            ),
            None => (
                "—".to_string(),
                if forced.is_some() { "forced" } else { "—" },
            ),
        };
        let union = median.experts_per_verify_layer();
        println!(
            " {drafts:>6}  {:<8}  {:<10}  {speed:>6.1}  {ratio:>7}   {:>11.2}   {:>11.2}   {:<19}   {union:>14.2}   {:>7.2}   {cache_hits:>10}   {mtp_cache_hits:>8}   {same}",
            if args.adaptive_drafts && drafts > 0 { "on" } else { "off" },
            if forced.is_some() { "forced" } else { "model" },
            median.tokens_per_step(),
            median.rows_per_verification(),
            if acceptance.is_empty() {
                "—".to_string()
            } else {
                acceptance.join(" / ")
            },
            union / top_k as f64,
        );
        if drafts == 0 && off.is_none() {
            off = Some((speed, median.tokens.clone()));
        }
    }
    Ok(())
}
