//! `ninfer bench serve`: speed where users see it. Starts `ninfer run MODEL --serve` (or targets
//! a running server by `--url`), sends streaming OpenAI chat requests at each concurrency with
//! prompts of a fixed token count made by the model's own tokenizer, and reports time to first
//! token, inter-token latency, per-stream and aggregate output tok/s, the gateway's CPU time per
//! generated token, how fast `/health` answered under the load, and the ratio to `ninfer bench`
//! of the same model (the engine alone, no HTTP). With `--agent-turns` it replays one agent's
//! growing conversation instead (`bench_serve_agent`): time to first token and cached prompt
//! tokens per turn.
//!
//! Owns: the flags, the server and baseline it starts, the load levels and their figures.
//! Must not touch: the HTTP requests themselves (`bench_serve_client`), the agent replay's
//! conversation (`bench_serve_agent`) or the engine-only measurement (`bench_model`, run as
//! `ninfer bench MODEL`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;

use crate::bench_serve_agent::{self, AgentConversation, AgentReport};
use crate::bench_serve_client::{
    descendant_named, process_cpu_time, ApiClient, HealthProbe, StreamTiming,
};
use crate::bench_tokens::StepLatency;

#[derive(Debug, clap::Args)]
pub struct ServeBenchArgs {
    /// The model to serve: anything `ninfer run` takes. Leave out with --url.
    #[arg(
        value_name = "MODEL",
        required_unless_present = "url",
        conflicts_with = "url"
    )]
    pub model: Option<PathBuf>,
    /// A running server to measure instead (e.g. http://127.0.0.1:8080).
    #[arg(long)]
    pub url: Option<String>,
    /// Concurrent streams of each level, comma-separated.
    #[arg(long, default_value = "1,4,16,64")]
    pub concurrency: String,
    /// Tokens of each chat prompt (template included), counted by the server's tokenizer.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens each answer generates (end-of-sequence is ignored, so all answers are this long).
    #[arg(long, default_value_t = 128)]
    pub output_tokens: u32,
    /// Requests each stream sends one after another at every level.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// API key the server wants.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Milliseconds between `/health` probes while a level runs.
    #[arg(long, default_value_t = 20)]
    pub health_interval_ms: u64,
    /// The gateway's process id, for its CPU time with --url (found by itself otherwise).
    #[arg(long)]
    pub gateway_pid: Option<u32>,
    /// Extra arguments for `ninfer run` (repeat per argument), e.g. `--run-arg=--no-mtp`.
    #[arg(long = "run-arg", allow_hyphen_values = true, value_name = "ARG")]
    pub run_args: Vec<String>,
    /// Extra arguments for the engine-only `ninfer bench MODEL` (repeat per argument).
    #[arg(long = "bench-arg", allow_hyphen_values = true, value_name = "ARG")]
    pub bench_args: Vec<String>,
    /// Skip the engine-only `ninfer bench MODEL` (no ratio is printed).
    #[arg(long)]
    pub no_engine_baseline: bool,
    /// Seconds to wait for the server to answer `/health`.
    #[arg(long, default_value_t = 900.0)]
    pub ready_timeout: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Replay one agent conversation of this many turns instead of the load levels: each turn
    /// sends the same system prompt and tools and the whole conversation so far, which grows by
    /// the last answer and a tool result (0: no replay).
    #[arg(long, default_value_t = 0)]
    pub agent_turns: usize,
    /// Tokens of the agent's system prompt (the tool definitions come on top).
    #[arg(long, default_value_t = 19_000)]
    pub agent_system_tokens: usize,
    /// Tokens of the tool result each later turn appends (the last answer comes on top).
    #[arg(long, default_value_t = 500)]
    pub agent_turn_tokens: usize,
}

/// One concurrency level's figures.
#[derive(Debug, Serialize)]
pub struct LevelFigures {
    pub concurrency: usize,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Time to first token, ms.
    pub ttft_ms: StepLatency,
    /// Time between text events of a stream, ms.
    pub inter_token_ms: StepLatency,
    /// Median over streams of each stream's decode rate (tokens after the first ÷ time after
    /// the first).
    pub stream_tok_s: f64,
    /// All generated tokens ÷ the level's wall time.
    pub aggregate_tok_s: f64,
    /// The gateway's CPU time (user + system) ÷ generated tokens, µs, less what the `/health`
    /// probes cost it (measured on the idle server first); null when its process is not known.
    pub gateway_cpu_us_per_token: Option<f64>,
    /// `/health` probes during the level and the slowest answer, ms.
    pub health_probes: usize,
    pub health_max_ms: f64,
    pub health_p99_ms: f64,
    /// Probes that failed or did not answer 200.
    pub health_failures: usize,
}

#[derive(Debug, Serialize)]
pub struct ServeBenchReport {
    pub model: String,
    pub url: String,
    pub levels: Vec<LevelFigures>,
    /// `ninfer bench MODEL`'s batch-1 decode tok/s at the same prompt length.
    pub engine_decode_tok_s: Option<f64>,
    /// The first level's stream tok/s ÷ `engine_decode_tok_s` (1 = the API costs nothing).
    pub stream_over_engine: Option<f64>,
    /// What one more token costs the gateway at one stream, µs, with no `/health` probes: its
    /// CPU time for an answer of `--output-tokens` less that for a shorter one of the same
    /// prompt, per extra token (request set-up cancels out; the levels' figure leans on the
    /// probes' cost measured idle, which a busy machine skews). Null when its process is not
    /// known.
    pub gateway_cpu_us_per_token_unprobed: Option<f64>,
}

/// `ninfer run MODEL --serve` started for the benchmark; stopped (and waited for) on drop.
struct StartedServer {
    child: Child,
    log: PathBuf,
}

impl StartedServer {
    fn start(
        args: &ServeBenchArgs,
        model: &std::path::Path,
        most_streams: usize,
    ) -> anyhow::Result<(Self, String)> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .context("finding a free port")?
            .port();
        let listen = format!("127.0.0.1:{port}");
        let log =
            std::env::temp_dir().join(format!("ninfer-bench-serve-{}.log", std::process::id()));
        let log_file = std::fs::File::create(&log)
            .with_context(|| format!("creating the server log {}", log.display()))?;
        let exe = std::env::current_exe().context("locating the ninfer binary")?;
        let child = Command::new(exe)
            .arg("run")
            .arg(model)
            .args(["--serve", "--listen", &listen])
            .args(sequences_for(&args.run_args, most_streams))
            .args(&args.run_args)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().context("server log")?)
            .stderr(log_file)
            .spawn()
            .context("starting `ninfer run --serve`")?;
        Ok((StartedServer { child, log }, format!("http://{listen}")))
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for StartedServer {
    fn drop(&mut self) {
        // SIGTERM lets `ninfer run` stop its gateway, engine and workers in order.
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.exited() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    let levels = match args.agent_turns {
        0 => parse_levels(&args.concurrency)?,
        // One conversation: one sequence at a time.
        _ => vec![1],
    };
    if args.prompt_tokens == 0 || args.output_tokens < 2 {
        bail!("--prompt-tokens must be at least 1 and --output-tokens at least 2");
    }
    let mut server = None;
    let url = match (&args.url, &args.model) {
        (Some(url), _) => url.clone(),
        (None, Some(model)) => {
            let most_streams = levels.iter().copied().max().unwrap_or(1);
            let (started, url) = StartedServer::start(&args, model, most_streams)?;
            server = Some(started);
            url
        }
        (None, None) => bail!("give a MODEL to serve or --url of a running server"),
    };
    let client = ApiClient::new(&url, args.api_key.clone());
    wait_for_health(&client, &mut server, args.ready_timeout)?;
    let gateway_pid = args.gateway_pid.or_else(|| {
        server
            .as_ref()
            .and_then(|server| descendant_named(server.child.id(), "ninfer-gateway"))
    });
    let model = client.first_model()?;
    if !args.json {
        eprintln!("measuring {model} at {url}");
    }
    if args.agent_turns > 0 {
        return agent_replay(&args, &client, model, url);
    }
    let gateway = match gateway_pid {
        Some(pid) => Some((
            pid,
            health_probe_cpu_cost(&client, pid, health_interval(&args))?,
        )),
        None => None,
    };
    let mut figures = Vec::new();
    for (level_index, &concurrency) in levels.iter().enumerate() {
        let seed = args
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(level_index as u64 * 10_007);
        figures.push(
            run_level(&args, &client, &model, concurrency, seed, gateway)
                .with_context(|| format!("concurrency {concurrency}"))?,
        );
    }
    let gateway_cpu_us_per_token_unprobed = match gateway_pid {
        Some(pid) => Some(
            unprobed_cpu_per_token(&args, &client, &model, pid)
                .context("the gateway's CPU per token without probes")?,
        ),
        None => None,
    };
    // The server goes before the engine-only run: both would share the cores and the GPU.
    drop(server);
    let engine_decode_tok_s = match (&args.model, args.no_engine_baseline) {
        (Some(model), false) => Some(engine_only_decode(&args, model)?),
        _ => None,
    };
    let stream_over_engine = engine_decode_tok_s
        .zip(figures.first())
        .map(|(engine, first)| first.stream_tok_s / engine);
    let report = ServeBenchReport {
        model,
        url,
        levels: figures,
        engine_decode_tok_s,
        stream_over_engine,
        gateway_cpu_us_per_token_unprobed,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report, &args);
    }
    Ok(())
}

/// The `--agent-turns` replay against the server at `url` and its report.
fn agent_replay(
    args: &ServeBenchArgs,
    client: &ApiClient,
    model: String,
    url: String,
) -> anyhow::Result<()> {
    let conversation = AgentConversation {
        turns: args.agent_turns,
        system_tokens: args.agent_system_tokens,
        turn_tokens: args.agent_turn_tokens,
        output_tokens: args.output_tokens,
        seed: args.seed,
    };
    let turns = bench_serve_agent::replay(client, &model, conversation)?;
    let (prefix_cache_bytes, prefix_cache_budget_bytes) =
        bench_serve_agent::prefix_cache_memory(client);
    let report = AgentReport {
        model,
        url,
        turns,
        prefix_cache_bytes,
        prefix_cache_budget_bytes,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        bench_serve_agent::print_table(&report, &conversation);
    }
    Ok(())
}

/// `--max-sequences N` for the started server, so the largest level runs at once rather than
/// queueing into 429s; nothing when the user's `--run-arg`s set it.
fn sequences_for(run_args: &[String], most_streams: usize) -> Vec<String> {
    let given = run_args
        .iter()
        .any(|arg| arg == "--max-sequences" || arg.starts_with("--max-sequences="));
    if given {
        Vec::new()
    } else {
        vec!["--max-sequences".to_string(), most_streams.to_string()]
    }
}

fn parse_levels(text: &str) -> anyhow::Result<Vec<usize>> {
    let levels: Vec<usize> = text
        .split(',')
        .filter(|part| !part.trim().is_empty())
        .map(|part| {
            part.trim()
                .parse::<usize>()
                .ok()
                .filter(|level| (1..=1024).contains(level))
                .with_context(|| format!("--concurrency: `{part}` is not a number in 1..=1024"))
        })
        .collect::<anyhow::Result<_>>()?;
    if levels.is_empty() {
        bail!("--concurrency lists no level");
    }
    Ok(levels)
}

fn wait_for_health(
    client: &ApiClient,
    server: &mut Option<StartedServer>,
    timeout_seconds: f64,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs_f64(timeout_seconds.max(1.0));
    loop {
        if let Ok((200, _)) = client.get_status("/health") {
            return Ok(());
        }
        if let Some(server) = server.as_mut() {
            if server.exited() {
                bail!(
                    "`ninfer run --serve` exited before answering; its log ({}):\n{}",
                    server.log.display(),
                    server.log_tail()
                );
            }
        }
        if Instant::now() > deadline {
            bail!("the server did not answer /health with 200 within {timeout_seconds} s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The pause between two `/health` probes.
fn health_interval(args: &ServeBenchArgs) -> Duration {
    Duration::from_millis(args.health_interval_ms.max(1))
}

fn run_level(
    args: &ServeBenchArgs,
    client: &ApiClient,
    model: &str,
    concurrency: usize,
    seed: u64,
    gateway: Option<(u32, Duration)>,
) -> anyhow::Result<LevelFigures> {
    let gateway_pid = gateway.map(|(pid, _)| pid);
    // Prompts first: their tokenizing is not part of what is measured.
    let requests = concurrency * args.rounds.max(1);
    let prompts: Vec<String> = (0..requests)
        .map(|index| client.prompt_of_length(model, args.prompt_tokens, seed + index as u64))
        .collect::<anyhow::Result<_>>()?;
    let probe = HealthProbe::start(client.clone(), health_interval(args));
    let cpu_before = gateway_pid.and_then(|pid| process_cpu_time(pid).ok());
    let started = Instant::now();
    let timings: Vec<anyhow::Result<StreamTiming>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..concurrency)
            .map(|stream| {
                let prompts = &prompts;
                scope.spawn(move || {
                    (0..args.rounds.max(1))
                        .map(|round| {
                            let prompt = &prompts[round * concurrency + stream];
                            client.stream_chat(model, prompt, args.output_tokens)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| vec![Err(anyhow::anyhow!("a client thread panicked"))])
            })
            .collect()
    });
    let wall = started.elapsed();
    let cpu_after = gateway_pid.and_then(|pid| process_cpu_time(pid).ok());
    let health = probe.finish();
    let timings: Vec<StreamTiming> = timings.into_iter().collect::<anyhow::Result<_>>()?;
    // What the probes cost the gateway is not generation work.
    let probes_cpu = gateway.map_or(Duration::ZERO, |(_, per_probe)| {
        per_probe.saturating_mul(u32::try_from(health.len()).unwrap_or(u32::MAX))
    });
    let gateway_cpu = cpu_before
        .zip(cpu_after)
        .map(|(before, after)| (before, after.saturating_sub(probes_cpu)));
    Ok(summarise(concurrency, &timings, wall, gateway_cpu, &health))
}

/// One stream, no probes: the gateway's CPU time of a full-length answer less that of a short
/// one with the same prompt, per extra token, µs (see
/// [`ServeBenchReport::gateway_cpu_us_per_token_unprobed`]).
fn unprobed_cpu_per_token(
    args: &ServeBenchArgs,
    client: &ApiClient,
    model: &str,
    gateway_pid: u32,
) -> anyhow::Result<f64> {
    let prompt = client.prompt_of_length(model, args.prompt_tokens, args.seed)?;
    let short = (args.output_tokens / 8).max(1);
    // The first answer of this prompt warms what a repeat finds (the engine's prefix cache).
    client.stream_chat(model, &prompt, short)?;
    let mut spent = Vec::new();
    for length in [short, args.output_tokens] {
        let before = process_cpu_time(gateway_pid)?;
        let timing = client.stream_chat(model, &prompt, length)?;
        let after = process_cpu_time(gateway_pid)?;
        spent.push((after.saturating_sub(before), timing.completion_tokens));
    }
    let [(short_cpu, short_tokens), (long_cpu, long_tokens)] = spent[..] else {
        bail!("two answers were measured, not {}", spent.len());
    };
    cpu_per_extra_token(short_cpu, short_tokens, long_cpu, long_tokens)
}

/// The CPU time per token that a longer answer took beyond a shorter one, µs.
fn cpu_per_extra_token(
    short_cpu: Duration,
    short_tokens: usize,
    long_cpu: Duration,
    long_tokens: usize,
) -> anyhow::Result<f64> {
    if long_tokens <= short_tokens {
        bail!("the long answer had {long_tokens} tokens, the short one {short_tokens}");
    }
    let extra = long_cpu.as_secs_f64() - short_cpu.as_secs_f64();
    Ok(extra.max(0.0) * 1e6 / (long_tokens - short_tokens) as f64)
}

/// How long the idle server is probed to measure what a probe costs it.
const CALIBRATION_TIME: Duration = Duration::from_secs(2);

/// The gateway's CPU time per `/health` answer, measured on the idle server with probes as far
/// apart as during a level: back-to-back probes find the gateway's code and data in the caches,
/// spaced ones (like tokens) do not, and cost it several times more.
fn health_probe_cpu_cost(
    client: &ApiClient,
    gateway_pid: u32,
    interval: Duration,
) -> anyhow::Result<Duration> {
    let before = process_cpu_time(gateway_pid)?;
    let probe = HealthProbe::start(client.clone(), interval);
    std::thread::sleep(CALIBRATION_TIME);
    let probes = probe.finish();
    let after = process_cpu_time(gateway_pid)?;
    if let Some(Err(failure)) = probes.iter().find(|probe| probe.is_err()) {
        anyhow::bail!("/health failed on the idle server: {failure}");
    }
    let count = u32::try_from(probes.len()).unwrap_or(u32::MAX).max(1);
    Ok(after.saturating_sub(before) / count)
}

/// The figures of one level from its streams, its wall time, the gateway's CPU time before
/// and after, and the health probes.
fn summarise(
    concurrency: usize,
    timings: &[StreamTiming],
    wall: Duration,
    gateway_cpu: Option<(Duration, Duration)>,
    health: &[Result<Duration, String>],
) -> LevelFigures {
    let completion_tokens: usize = timings.iter().map(|t| t.completion_tokens).sum();
    let ttft: Vec<Duration> = timings
        .iter()
        .filter_map(StreamTiming::time_to_first_token)
        .collect();
    let inter_token: Vec<Duration> = timings
        .iter()
        .flat_map(|t| crate::bench_tokens::gaps(&t.text_arrivals))
        .collect();
    let mut stream_rates: Vec<f64> = timings
        .iter()
        .filter_map(StreamTiming::decode_tokens_per_second)
        .collect();
    stream_rates.sort_by(f64::total_cmp);
    let stream_tok_s = stream_rates
        .get(stream_rates.len() / 2)
        .copied()
        .unwrap_or(0.0);
    let answered: Vec<Duration> = health
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .copied()
        .collect();
    let health_latency = StepLatency::of(&answered);
    LevelFigures {
        concurrency,
        requests: timings.len(),
        prompt_tokens: timings.first().map_or(0, |t| t.prompt_tokens),
        completion_tokens,
        ttft_ms: StepLatency::of(&ttft),
        inter_token_ms: StepLatency::of(&inter_token),
        stream_tok_s,
        aggregate_tok_s: completion_tokens as f64 / wall.as_secs_f64().max(1e-9),
        gateway_cpu_us_per_token: gateway_cpu.filter(|_| completion_tokens > 0).map(
            |(before, after)| {
                after.saturating_sub(before).as_secs_f64() * 1e6 / completion_tokens as f64
            },
        ),
        health_probes: health.len(),
        health_max_ms: health_latency.max_ms,
        health_p99_ms: health_latency.p99_ms,
        health_failures: health.len() - answered.len(),
    }
}

/// `ninfer bench MODEL`'s batch-1 decode rate at the same prompt and answer lengths.
fn engine_only_decode(args: &ServeBenchArgs, model: &std::path::Path) -> anyhow::Result<f64> {
    let exe = std::env::current_exe().context("locating the ninfer binary")?;
    let output = Command::new(exe)
        .arg("bench")
        .arg(model)
        .args([
            "--prompt-lengths",
            &args.prompt_tokens.to_string(),
            "--decode-tokens",
            &args.output_tokens.to_string(),
            "--json",
        ])
        .args(&args.bench_args)
        .stdin(Stdio::null())
        .output()
        .context("running `ninfer bench MODEL` for the engine-only figure")?;
    if !output.status.success() {
        bail!(
            "`ninfer bench {}` failed: {}",
            model.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)
        .context("`ninfer bench MODEL --json` printed no JSON")?;
    report["results"][0]["decode_tok_s"]
        .as_f64()
        .context("`ninfer bench MODEL --json` gave no results[0].decode_tok_s")
}

fn print_table(report: &ServeBenchReport, args: &ServeBenchArgs) {
    println!(
        "{} through {} (streaming /v1/chat/completions, {}-token prompts, {} tokens each)",
        report.model, report.url, args.prompt_tokens, args.output_tokens
    );
    println!(
        "| streams | requests | TTFT p50 / p99 ms | ITL p50 / p99 ms | stream tok/s | aggregate tok/s | gateway µs/token | /health max ms (fails) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for level in &report.levels {
        println!(
            "| {} | {} | {:.1} / {:.1} | {:.2} / {:.2} | {:.1} | {:.1} | {} | {:.1} ({}) |",
            level.concurrency,
            level.requests,
            level.ttft_ms.p50_ms,
            level.ttft_ms.p99_ms,
            level.inter_token_ms.p50_ms,
            level.inter_token_ms.p99_ms,
            level.stream_tok_s,
            level.aggregate_tok_s,
            level
                .gateway_cpu_us_per_token
                .map_or("-".to_string(), |us| format!("{us:.1}")),
            level.health_max_ms,
            level.health_failures,
        );
    }
    if let Some(us) = report.gateway_cpu_us_per_token_unprobed {
        println!(
            "gateway CPU per token at one stream without /health probes (a {}- and a {}-token answer differenced): {us:.1} µs",
            (args.output_tokens / 8).max(1),
            args.output_tokens
        );
    }
    if let (Some(engine), Some(ratio)) = (report.engine_decode_tok_s, report.stream_over_engine) {
        println!(
            "engine alone (`ninfer bench`, batch 1): {engine:.1} tok/s; one stream through the API: {:.1}% of it",
            ratio * 100.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_started_server_runs_the_largest_level_at_once_unless_told() {
        assert_eq!(sequences_for(&[], 64), vec!["--max-sequences", "64"]);
        let told = vec!["--max-sequences=8".to_string()];
        assert!(sequences_for(&told, 64).is_empty());
    }

    #[test]
    fn the_extra_tokens_carry_the_extra_cpu() {
        // 2 ms for 4 tokens, 10 ms for 20: 8 ms for 16 more tokens.
        let per_token =
            cpu_per_extra_token(Duration::from_millis(2), 4, Duration::from_millis(10), 20);
        assert_eq!(per_token.ok().map(f64::round), Some(500.0));
        assert!(cpu_per_extra_token(Duration::ZERO, 4, Duration::ZERO, 4).is_err());
    }

    #[test]
    fn levels_parse_and_bad_ones_are_named() {
        assert_eq!(parse_levels("1,4, 16").unwrap_or_default(), vec![1, 4, 16]);
        let error = parse_levels("1,x")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("`x`"), "{error}");
        assert!(parse_levels("0").is_err());
        assert!(parse_levels("").is_err());
    }

    #[test]
    fn a_level_is_summarised_from_its_streams() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let stream = |first: u64| StreamTiming {
            sent_at: start,
            text_arrivals: (0..5).map(|i| at(first + i * 10)).collect(),
            completion_tokens: 5,
            prompt_tokens: 100,
            cached_tokens: 0,
            answer: String::new(),
        };
        let timings = [stream(50), stream(70)];
        let health = [Ok(Duration::from_millis(2)), Err("status 503".to_string())];
        let figures = summarise(
            2,
            &timings,
            Duration::from_secs(1),
            Some((Duration::from_millis(100), Duration::from_millis(110))),
            &health,
        );
        assert_eq!(figures.completion_tokens, 10);
        assert_eq!(figures.ttft_ms.p50_ms, 50.0);
        assert_eq!(figures.ttft_ms.max_ms, 70.0);
        // 4 gaps of 10 ms: 100 tok/s per stream.
        assert!((figures.stream_tok_s - 100.0).abs() < 1e-6);
        assert!((figures.aggregate_tok_s - 10.0).abs() < 1e-6);
        // 10 ms of CPU over 10 tokens.
        assert_eq!(
            figures.gateway_cpu_us_per_token.map(f64::round),
            Some(1000.0)
        );
        assert_eq!((figures.health_probes, figures.health_failures), (2, 1));
        assert_eq!(figures.health_max_ms, 2.0);
    }
}
