//! `ninfer perplexity MODEL TEXT_FILE`: mean negative log-likelihood of a text under a model,
//! computed by the serving pipeline: the expert workers and the engine started exactly as
//! `ninfer serve` / `ninfer bench MODEL` start them (`serve::start_pipeline`), with the engine's
//! placement (GPU expert slots, expert cache) and the offloaded experts computed by the workers
//! over the shared-memory channel. The engine scores each window with its `ScoreTokens` RPC.
//!
//! Tokenizes with the artifact's embedded `tokenizer.json` (no special tokens added), then scores
//! the tokens in **non-overlapping windows** of `--max-context` tokens: each window starts from an
//! empty state and every token but its first is scored.
//!
//! `--in-process` instead computes in this process with the f32 reference experts
//! (`ninfer_engine::token_nlls`): the reference the serving path is tested against, and the one
//! compared with transformers.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ninfer_engine::{Backend, Model, PerplexityOptions, TokenNll};
use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::{ModelInfoRequest, ProfileRequest, ScoreRequest};
use tonic::transport::Channel;

use crate::in_process::{self, with_model, CpuExperts};
use crate::serve::{artifact_of, connect_when_ready, plan_for, start_pipeline, EngineFlags};
use crate::supervisor::{install_stop_handler, stop_requested, Supervisor};

/// Window length when `--max-context` is not given (shorter when the model's context is).
const DEFAULT_WINDOW_TOKENS: usize = 2048;

#[derive(Debug, clap::Args)]
pub struct PerplexityArgs {
    /// The `.ninfer` artifact, a directory holding exactly one, a checkpoint directory, or
    /// `ORG/NAME` in the models directory.
    pub model: PathBuf,
    /// UTF-8 text file to score.
    pub text_file: PathBuf,
    /// Tokens per window (windows do not overlap; the first token of each is not scored).
    /// Default: 2048, or the model's context when that is shorter. It is also the engine's
    /// `--max-context`, checked against the model's.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Tokens per forward pass inside a window (bounds the memory held for logits).
    #[arg(long, default_value_t = 256)]
    pub chunk_tokens: usize,
    /// One line per scored token, `position<TAB>token_id<TAB>nll`: into FILE, or (the flag
    /// alone, or `-`) on stdout before the summary (with `--json`: a `token_nll` array of
    /// `[position, token_id, nll]` in the object). Alone, give it after MODEL and TEXT.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-")]
    pub token_nll: Option<PathBuf>,
    /// Where the dense layers run: cpu, cuda, or auto (the GPU when one opens). Default: auto;
    /// with `--in-process`, cpu.
    #[arg(long, value_parser = ["cpu", "cuda", "auto"])]
    pub device: Option<String>,
    /// Routed experts per MoE layer in GPU slots: N, `half`, `all` or `auto` (as `ninfer
    /// serve`; default `auto` on a GPU, else 0); the rest are computed by the expert workers.
    /// With `--in-process`: `all` or N.
    #[arg(long, value_name = "N|half|all|auto")]
    pub moe_gpu_experts: Option<String>,
    /// Behave as if the GPU had this many GiB (stand in for a smaller card).
    #[arg(long, value_name = "GiB")]
    pub gpu_mem_budget: Option<f64>,
    /// Compute threads per expert worker (default: one per physical core of its node); with
    /// `--in-process`, of the CPU expert kernels beside a GPU.
    #[arg(long)]
    pub moe_threads: Option<usize>,
    /// Compute the routed experts inside the engine instead of in worker processes.
    #[arg(long)]
    pub no_workers: bool,
    /// Extra arguments for the engine (repeat the flag per argument).
    #[arg(long = "engine-arg", allow_hyphen_values = true, value_name = "ARG")]
    pub engine_args: Vec<String>,
    /// Seconds to wait for the engine (and workers) to load the model.
    #[arg(long, default_value_t = 900.0)]
    pub ready_timeout: f64,
    /// Compute in this process instead of the serving pipeline, with the f32 reference experts
    /// on the CPU device (the reference the serving path is checked against).
    #[arg(long)]
    pub in_process: bool,
    /// Print one JSON object instead of the summary line.
    #[arg(long)]
    pub json: bool,
}

/// What a run reports (`--json` prints it as is).
#[derive(Debug, serde::Serialize)]
struct Summary {
    model: String,
    text_file: String,
    /// Tokens of the text.
    tokens: usize,
    scored_tokens: usize,
    mean_nll: f64,
    perplexity: f64,
    window_tokens: usize,
    /// Tokens of the text per second of scoring.
    tokens_per_second: f64,
    /// `engine` (the serving pipeline) or `in-process`.
    path: String,
    /// Where the dense layers ran (`cpu`, `cuda`).
    device: String,
    /// Who computed the routed experts not in GPU slots (`remote-workers`,
    /// `cpu-kernels-in-process`, `cpu-in-process`: the f32 reference).
    expert_executor: String,
    /// Routed experts per MoE layer in GPU slots.
    gpu_experts_per_layer: u32,
    /// `[position, token_id, nll]` per scored token, with `--token-nll` on stdout.
    #[serde(skip_serializing_if = "Option::is_none")]
    token_nll: Option<Vec<(usize, u32, f64)>>,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    if let Some(context) = args.max_context {
        if context < 2 {
            bail!("--max-context must be at least 2 tokens, got {context}");
        }
    }
    if args.chunk_tokens == 0 {
        bail!("--chunk-tokens must be at least 1");
    }
    let text = std::fs::read_to_string(&args.text_file)
        .with_context(|| format!("reading the text file {}", args.text_file.display()))?;
    if text.is_empty() {
        bail!(
            "{} is empty: there is nothing to score",
            args.text_file.display()
        );
    }
    if args.in_process {
        run_in_process(&args, &text)
    } else {
        run_through_engine(&args, &text)
    }
}

/// The text's tokens under the artifact's own tokenizer, refused when fewer than 2.
fn tokenize(
    tokenizer: &tokenizers::Tokenizer,
    text: &str,
    text_file: &Path,
) -> anyhow::Result<Vec<u32>> {
    let encoding = tokenizer
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("tokenizing {}: {e}", text_file.display()))?;
    let tokens = encoding.get_ids().to_vec();
    if tokens.len() < 2 {
        bail!(
            "{} has {} token(s); perplexity needs at least 2",
            text_file.display(),
            tokens.len()
        );
    }
    Ok(tokens)
}

/// Progress on stderr: a line rewritten in place on a terminal, else a line every 5 s.
struct Progress {
    started: Instant,
    last_report: Instant,
    interactive: bool,
}

impl Progress {
    fn new() -> Self {
        Progress {
            started: Instant::now(),
            last_report: Instant::now(),
            interactive: std::io::stderr().is_terminal(),
        }
    }

    fn report(&mut self, done: usize, total: usize) {
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = done as f64 / elapsed;
        if self.interactive {
            eprint!("\r{done}/{total} tokens, {rate:.1} tokens/s   ");
            let _ = std::io::stderr().flush();
        } else if self.last_report.elapsed().as_secs_f64() >= 5.0 || done == total {
            eprintln!("{done}/{total} tokens, {rate:.1} tokens/s");
            self.last_report = Instant::now();
        }
    }

    /// Ends the progress line; the seconds since scoring started.
    fn finish(&self) -> f64 {
        if self.interactive {
            eprintln!();
        }
        self.started.elapsed().as_secs_f64()
    }
}

/// Writes `--token-nll` and prints the summary.
fn report(args: &PerplexityArgs, scored: &[TokenNll], mut summary: Summary) -> anyhow::Result<()> {
    match args.token_nll.as_deref() {
        Some(path) if path == Path::new("-") => {
            if args.json {
                summary.token_nll = Some(
                    scored
                        .iter()
                        .map(|s| (s.position, s.token, s.nll))
                        .collect(),
                );
            } else {
                write_token_nll(&mut std::io::stdout().lock(), scored)
                    .context("writing the per-token NLL to stdout")?;
            }
        }
        Some(path) => {
            let mut out = std::io::BufWriter::new(
                std::fs::File::create(path)
                    .with_context(|| format!("creating {}", path.display()))?,
            );
            write_token_nll(&mut out, scored)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        None => {}
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        println!(
            "mean NLL {:.6} nats over {} scored tokens (perplexity {:.4}); {:.1} tokens/s",
            summary.mean_nll, summary.scored_tokens, summary.perplexity, summary.tokens_per_second
        );
    }
    Ok(())
}

/// `position<TAB>token_id<TAB>nll` per scored token.
fn write_token_nll(out: &mut dyn Write, scored: &[TokenNll]) -> std::io::Result<()> {
    for s in scored {
        writeln!(out, "{}\t{}\t{:.6}", s.position, s.token, s.nll)?;
    }
    out.flush()
}

fn mean_nll(scored: &[TokenNll]) -> f64 {
    scored.iter().map(|s| s.nll).sum::<f64>() / scored.len().max(1) as f64
}

/// The serving pipeline: workers and engine as `ninfer serve` starts them, one `ScoreTokens`
/// request per window.
fn run_through_engine(args: &PerplexityArgs, text: &str) -> anyhow::Result<()> {
    if args.moe_threads == Some(0) {
        bail!("--moe-threads must be at least 1");
    }
    let flags = EngineFlags {
        moe_threads: args.moe_threads,
        max_context: args.max_context,
        no_workers: args.no_workers,
        moe_gpu_experts: args.moe_gpu_experts.clone(),
        gpu_mem_budget: args.gpu_mem_budget,
        device: Some(args.device.clone().unwrap_or_else(|| "auto".into())),
        // One sequence at a time: the KV cache of one window, the rest of the GPU for experts.
        max_sequences: Some(1),
        engine_args: args.engine_args.clone(),
        ..EngineFlags::default()
    };
    // Every value is checked against the model and the machine before anything starts.
    let (location, plan) = plan_for(&args.model, &flags, &flags.request(None), true)?;
    let model = artifact_of(&location)?;
    let artifact = ninfer_artifact::Artifact::open(&model)
        .with_context(|| format!("opening {}", model.display()))?;
    let tokenizer_json = artifact
        .file("tokenizer.json")
        .with_context(|| format!("{} has no embedded tokenizer.json", model.display()))?;
    let tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer_json)
        .map_err(|e| anyhow::anyhow!("{}: invalid tokenizer.json: {e}", model.display()))?;
    drop(artifact);
    let tokens = tokenize(&tokenizer, text, &args.text_file)?;

    let started = Instant::now();
    install_stop_handler();
    let mut supervisor = Supervisor::new()?;
    let listen = supervisor.socket("engine");
    let address = start_pipeline(&mut supervisor, &model, &listen, &flags, &plan)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(score_through_engine(
        args,
        &tokens,
        &address,
        &mut supervisor,
        started,
    ));
    supervisor.stop_all();
    let (scored, mut summary) = result.with_context(|| {
        format!(
            "scoring through the engine (logs in {})",
            supervisor.log_dir().display()
        )
    })?;
    summary.model = model.display().to_string();
    report(args, &scored, summary)
}

async fn score_through_engine(
    args: &PerplexityArgs,
    tokens: &[u32],
    address: &str,
    supervisor: &mut Supervisor,
    started: Instant,
) -> anyhow::Result<(Vec<TokenNll>, Summary)> {
    let timeout = Duration::from_secs_f64(args.ready_timeout.max(1.0));
    let mut client = connect_when_ready(address, supervisor, timeout).await?;
    supervisor.mark_healthy();
    let info = client
        .get_model_info(ModelInfoRequest {})
        .await
        .context("asking the engine for its model")?
        .into_inner();
    let engine_context = info.max_context as usize;
    let window = match args.max_context {
        Some(context) => context,
        None => DEFAULT_WINDOW_TOKENS.min(engine_context),
    };
    if window < 2 || window > engine_context {
        bail!("windows of {window} tokens do not fit the engine's context of {engine_context}");
    }
    let profile = client
        .get_profile(ProfileRequest::default())
        .await
        .context("asking the engine for its placement")?
        .into_inner();
    eprintln!(
        "{}: {} tokens; model {} on {} ({} routed experts per layer in GPU slots, the rest by {}) ready in {:.1}s; windows of {window} tokens (non-overlapping)",
        args.text_file.display(),
        tokens.len(),
        info.architecture,
        profile.device,
        profile.gpu_experts_per_layer,
        profile.expert_executor,
        started.elapsed().as_secs_f64(),
    );

    let mut progress = Progress::new();
    let mut scored = Vec::with_capacity(tokens.len());
    for (window_index, window_tokens) in tokens.chunks(window).enumerate() {
        let window_start = window_index * window;
        if window_tokens.len() < 2 {
            // A last window of one token has nothing to score (as in the in-process rule).
            progress.report(tokens.len(), tokens.len());
            continue;
        }
        let nlls = score_window(
            &mut client,
            window_tokens,
            args.chunk_tokens,
            window_index,
            supervisor,
            &mut |done| progress.report(window_start + done, tokens.len()),
        )
        .await?;
        scored.extend(nlls.into_iter().enumerate().map(|(index, nll)| TokenNll {
            position: window_start + index + 1,
            token: window_tokens[index + 1],
            nll,
        }));
    }
    let elapsed = progress.finish();
    let mean = mean_nll(&scored);
    let summary = Summary {
        model: String::new(),
        text_file: args.text_file.display().to_string(),
        tokens: tokens.len(),
        scored_tokens: scored.len(),
        mean_nll: mean,
        perplexity: mean.exp(),
        window_tokens: window,
        tokens_per_second: tokens.len() as f64 / elapsed.max(1e-9),
        path: "engine".into(),
        device: profile.device,
        expert_executor: profile.expert_executor,
        gpu_experts_per_layer: profile.gpu_experts_per_layer,
        token_nll: None,
    };
    Ok((scored, summary))
}

/// One window through `ScoreTokens`: the NLL of each of its tokens but the first, in order.
async fn score_window(
    client: &mut EngineClient<Channel>,
    window: &[u32],
    chunk_tokens: usize,
    window_index: usize,
    supervisor: &mut Supervisor,
    progress: &mut dyn FnMut(usize),
) -> anyhow::Result<Vec<f64>> {
    let request = ScoreRequest {
        request_id: format!("perplexity-{}-window-{window_index}", std::process::id()),
        token_ids: window.to_vec(),
        chunk_tokens: u32::try_from(chunk_tokens).unwrap_or(u32::MAX),
        model_name: String::new(),
    };
    let mut stream = client
        .score_tokens(request)
        .await
        .map_err(|status| {
            anyhow::anyhow!(
                "the engine refused window {window_index}: {}",
                status.message()
            )
        })?
        .into_inner();
    let mut nlls = Vec::with_capacity(window.len());
    while let Some(scores) = stream.message().await.map_err(|status| {
        anyhow::anyhow!(
            "the engine failed window {window_index}: {}",
            status.message()
        )
    })? {
        if stop_requested() {
            bail!("interrupted");
        }
        // A worker that died is restarted; the engine holds the request meanwhile.
        supervisor.poll()?;
        if scores.first_position as usize != nlls.len() + 1 {
            bail!(
                "the engine sent the scores of window {window_index} out of order (from position {}, expected {})",
                scores.first_position,
                nlls.len() + 1
            );
        }
        nlls.extend(scores.nll);
        progress(scores.tokens_done as usize);
    }
    if nlls.len() + 1 != window.len() {
        bail!(
            "the engine scored {} of the {} tokens of window {window_index}",
            nlls.len(),
            window.len() - 1
        );
    }
    Ok(nlls)
}

/// The in-process reference: the model opened here, f32 reference experts on the CPU device
/// (beside a GPU, the CPU expert kernels).
fn run_in_process(args: &PerplexityArgs, text: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    let gpu_experts =
        in_process::parse_gpu_experts(args.moe_gpu_experts.as_deref().unwrap_or("all"))?;
    let device = args.device.as_deref().unwrap_or("cpu");
    let cpu_experts = match device {
        "cpu" => CpuExperts::Reference,
        _ => CpuExperts::Kernels {
            threads: args.moe_threads.unwrap_or(0),
        },
    };
    let model = in_process::open(&args.model, device, cpu_experts, gpu_experts)?;
    let executor = match cpu_experts {
        // The names the engine's executors give themselves (`ExpertExecutor::name`).
        CpuExperts::Reference => "cpu-in-process",
        CpuExperts::Kernels { .. } => "cpu-kernels-in-process",
    };
    with_model!(&model, |model| {
        // `open` makes the first N (or all) experts of every MoE layer resident on the GPU.
        let experts = model.spec().common.num_experts;
        let resident = match model.backend().name().as_str() {
            "cpu" => 0,
            _ => gpu_experts.unwrap_or(experts).min(experts),
        };
        let placement = InProcessPlacement {
            started,
            executor,
            gpu_experts_per_layer: resident as u32,
        };
        score_in_process(model, args, text, &placement)
    })
}

/// How the in-process model was opened, for its summary.
struct InProcessPlacement {
    started: Instant,
    executor: &'static str,
    gpu_experts_per_layer: u32,
}

fn score_in_process<B: Backend>(
    model: &Model<B>,
    args: &PerplexityArgs,
    text: &str,
    placement: &InProcessPlacement,
) -> anyhow::Result<()> {
    let started = placement.started;
    let tokenizer = in_process::tokenizer(model, &args.model)?;
    let tokens = tokenize(&tokenizer, text, &args.text_file)?;
    let window = args.max_context.unwrap_or(DEFAULT_WINDOW_TOKENS);
    eprintln!(
        "{}: {} tokens; model {} on {} loaded in {:.1}s; windows of {window} tokens (non-overlapping)",
        args.text_file.display(),
        tokens.len(),
        model.spec().architecture,
        model.backend().name(),
        started.elapsed().as_secs_f64(),
    );
    let options = PerplexityOptions {
        max_context: window,
        chunk_tokens: args.chunk_tokens,
    };
    let mut progress = Progress::new();
    let scored = ninfer_engine::token_nlls(model, &tokens, options, &mut |done, total| {
        progress.report(done, total)
    })?;
    let elapsed = progress.finish();
    let mean = mean_nll(&scored);
    let summary = Summary {
        model: args.model.display().to_string(),
        text_file: args.text_file.display().to_string(),
        tokens: tokens.len(),
        scored_tokens: scored.len(),
        mean_nll: mean,
        perplexity: mean.exp(),
        window_tokens: window,
        tokens_per_second: tokens.len() as f64 / elapsed.max(1e-9),
        path: "in-process".into(),
        device: model.backend().name().to_string(),
        expert_executor: placement.executor.into(),
        gpu_experts_per_layer: placement.gpu_experts_per_layer,
        token_nll: None,
    };
    report(args, &scored, summary)
}
