//! `ninfer perplexity MODEL TEXT_FILE`: mean negative log-likelihood of a text under a model, on
//! the CPU (the f32 reference experts, exact) or the GPU (`--device cuda`: routed experts resident
//! up to `--moe-gpu-experts`, the rest on the CPU expert kernels).
//!
//! Tokenizes with the artifact's embedded `tokenizer.json` (no special tokens added), then scores
//! the tokens in **non-overlapping windows** of `--max-context` tokens: each window starts from an
//! empty state and every token but its first is scored (see `ninfer_engine::perplexity`).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use ninfer_engine::{Backend, Model, PerplexityOptions};

use crate::in_process::{self, with_model, CpuExperts};

#[derive(Debug, clap::Args)]
pub struct PerplexityArgs {
    /// The `.ninfer` artifact.
    pub model: PathBuf,
    /// UTF-8 text file to score.
    pub text_file: PathBuf,
    /// Tokens per window (windows do not overlap; the first token of each is not scored).
    #[arg(long, default_value_t = 2048)]
    pub max_context: usize,
    /// Tokens per forward pass inside a window (bounds the memory held for logits).
    #[arg(long, default_value_t = 256)]
    pub chunk_tokens: usize,
    /// Write one line per scored token to this file: `position<TAB>token_id<TAB>nll`.
    #[arg(long)]
    pub token_nll: Option<PathBuf>,
    /// cpu, cuda, or auto (the GPU when one opens).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "auto"])]
    pub device: String,
    /// On the GPU: routed experts per layer kept there (`all`, or a number); the rest are
    /// computed by the CPU expert kernels.
    #[arg(long, default_value = "all")]
    pub moe_gpu_experts: String,
    /// Threads of the CPU expert kernels on the GPU path (0: every core).
    #[arg(long, default_value_t = 0)]
    pub moe_threads: usize,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    if args.max_context < 2 {
        bail!(
            "--max-context must be at least 2 tokens, got {}",
            args.max_context
        );
    }
    let text = std::fs::read_to_string(&args.text_file)
        .with_context(|| format!("reading {}", args.text_file.display()))?;
    let started = Instant::now();
    let gpu_experts = in_process::parse_gpu_experts(&args.moe_gpu_experts)?;
    // The CPU keeps the exact f32 reference experts; beside a GPU the kernels are the fast path.
    let cpu_experts = match args.device.as_str() {
        "cpu" => CpuExperts::Reference,
        _ => CpuExperts::Kernels {
            threads: args.moe_threads,
        },
    };
    let model = in_process::open(&args.model, &args.device, cpu_experts, gpu_experts)?;
    with_model!(&model, |model| score(model, &args, &text, started))
}

fn score<B: Backend>(
    model: &Model<B>,
    args: &PerplexityArgs,
    text: &str,
    started: Instant,
) -> anyhow::Result<()> {
    let tokenizer = in_process::tokenizer(model, &args.model)?;
    let encoding = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizing {}: {e}", args.text_file.display()))?;
    let tokens = encoding.get_ids().to_vec();
    eprintln!(
        "{}: {} tokens; model {} on {} loaded in {:.1}s; windows of {} tokens (non-overlapping)",
        args.text_file.display(),
        tokens.len(),
        model.spec().architecture,
        model.backend().name(),
        started.elapsed().as_secs_f64(),
        args.max_context
    );
    if tokens.len() < 2 {
        bail!(
            "{} has {} token(s); perplexity needs at least 2",
            args.text_file.display(),
            tokens.len()
        );
    }

    let options = PerplexityOptions {
        max_context: args.max_context,
        chunk_tokens: args.chunk_tokens,
    };
    let interactive = std::io::stderr().is_terminal();
    let scoring_started = Instant::now();
    let mut last_report = Instant::now();
    let mut progress = |done: usize, total: usize| {
        let elapsed = scoring_started.elapsed().as_secs_f64().max(1e-9);
        let rate = done as f64 / elapsed;
        if interactive {
            eprint!("\r{done}/{total} tokens, {rate:.1} tokens/s   ");
            let _ = std::io::stderr().flush();
        } else if last_report.elapsed().as_secs_f64() >= 5.0 || done == total {
            eprintln!("{done}/{total} tokens, {rate:.1} tokens/s");
            last_report = Instant::now();
        }
    };
    let scored = ninfer_engine::token_nlls(model, &tokens, options, &mut progress)?;
    if interactive {
        eprintln!();
    }
    let elapsed = scoring_started.elapsed().as_secs_f64();

    if let Some(path) = &args.token_nll {
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        );
        for s in &scored {
            writeln!(out, "{}\t{}\t{:.6}", s.position, s.token, s.nll)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        out.flush()
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let mean = scored.iter().map(|s| s.nll).sum::<f64>() / scored.len() as f64;
    println!(
        "mean NLL {mean:.6} nats over {} scored tokens (perplexity {:.4}); {:.1} tokens/s",
        scored.len(),
        mean.exp(),
        tokens.len() as f64 / elapsed.max(1e-9)
    );
    Ok(())
}
