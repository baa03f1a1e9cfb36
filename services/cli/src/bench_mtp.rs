//! `ninfer bench mtp MODEL`: decode speed with the model's MTP head drafting 0 (off), 1, 2, 3…
//! tokens per step, greedy, in this process, on the CPU or the GPU.
//!
//! Owns: the arguments and the printed table (the model is opened by `crate::in_process`: every
//! routed expert resident on the GPU, or the SIMD expert kernels on the CPU). Must not touch: the drafting
//! and verification (`ninfer_engine::model::greedy_with_mtp`).

use std::path::PathBuf;

use anyhow::{bail, Context};
use ninfer_engine::model::{greedy_with_mtp, SpeculativeOutcome};
use ninfer_engine::{Backend, Model};

use crate::in_process::{self, with_model, CpuExperts};

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
    let cpu_experts = CpuExperts::Kernels {
        threads: args.moe_threads,
    };
    let model = in_process::open(&args.model, &args.device, cpu_experts, None)?;
    with_model!(&model, |model| measure(model, &args, &draft_counts))
}

fn measure<B: Backend>(
    model: &Model<B>,
    args: &MtpBenchArgs,
    draft_counts: &[usize],
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
    println!(
        "{} on {}: {} prompt tokens, {} generated, median of {} runs",
        args.model.display(),
        model.backend().name(),
        prompt.len(),
        args.tokens,
        args.repeats
    );
    println!(" drafts   tok/s   vs off   tokens/step   acceptance by depth   same tokens as off");
    let mut off: Option<(f64, Vec<u32>)> = None;
    for &drafts in draft_counts {
        greedy_with_mtp(model, &prompt, args.tokens, drafts)?;
        let mut runs: Vec<SpeculativeOutcome> = (0..args.repeats)
            .map(|_| greedy_with_mtp(model, &prompt, args.tokens, drafts))
            .collect::<Result<_, _>>()?;
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
                if *off_tokens == median.tokens {
                    "yes"
                } else {
                    "NO"
                },
            ),
            None => ("—".to_string(), "—"),
        };
        println!(
            " {drafts:>6}  {speed:>6.1}  {ratio:>7}   {:>11.2}   {:<19}   {same}",
            median.tokens_per_step(),
            if acceptance.is_empty() {
                "—".to_string()
            } else {
                acceptance.join(" / ")
            },
        );
        if drafts == 0 && off.is_none() {
            off = Some((speed, median.tokens.clone()));
        }
    }
    Ok(())
}
