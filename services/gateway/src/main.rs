//! `ninfer-gateway` binary: parses flags, starts the engine pool, the statistics store and the
//! HTTP+gRPC server, and talks to systemd (READY/WATCHDOG/STOPPING).
//!
//! Owns: process concerns only (flags, logging, signals, sd_notify). Must not touch: request
//! handling, which lives in the library.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ninfer_gateway::chat::NonTextContent;
use ninfer_gateway::connections::{raise_open_file_limit, ConnectionLimits};
use ninfer_gateway::generation::ModelAliases;
use ninfer_gateway::image_urls::ImageUrlPolicy;
use ninfer_gateway::routing_stats::RoutingStatsHandle;
use ninfer_gateway::tokenizer::TypedControlTokens;
use ninfer_gateway::{sd_notify, EnginePool, EnginePoolOptions, GatewaySettings, GatewayState};

/// The NInfer-Offload gateway: OpenAI, Anthropic and gRPC APIs in front of one or more engines.
///
/// HTTP and gRPC share one port: requests with `content-type: application/grpc` go to the gRPC
/// services (ninfer.v1.Gateway, grpc.health.v1, reflection), everything else to HTTP.
#[derive(Parser, Debug)]
#[command(version)]
struct Flags {
    /// Engine gRPC addresses, comma separated (unix:PATH, host:port or http://host:port).
    #[arg(long, value_delimiter = ',', required = true, env = "NINFER_ENGINES")]
    engine: Vec<String>,
    /// Address to serve HTTP and gRPC on.
    #[arg(long, default_value = "127.0.0.1:8080", env = "NINFER_LISTEN")]
    listen: String,
    /// API key clients must send (`Authorization: Bearer KEY` or `x-api-key: KEY`). No key = open.
    #[arg(long, env = "NINFER_API_KEY")]
    api_key: Option<String>,
    /// Directory for persistent state (routing statistics in `expert-stats/`).
    #[arg(long, env = "NINFER_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Requests in flight (all engines) above which new ones get 429/529.
    #[arg(long, default_value_t = 512)]
    max_in_flight_requests: u32,
    /// How often engines are polled for readiness, in milliseconds, while anything about them
    /// changes; an engine that stays ready and the same is polled up to 8 times less often (one
    /// found gone by a request is polled again at once).
    #[arg(long, default_value_t = 500)]
    engine_poll_ms: u64,
    /// How often routing statistics are written to the state directory, in seconds.
    #[arg(long, default_value_t = 30)]
    stats_persist_seconds: u64,
    /// Another name for a served model, `NAME=MODEL` (repeat, or comma separate). A NAME ending
    /// in `*` matches every name with that prefix: `claude-*=MODEL` serves Claude Code whatever
    /// model it asks for.
    #[arg(
        long = "model-alias",
        value_delimiter = ',',
        env = "NINFER_MODEL_ALIASES"
    )]
    model_aliases: Vec<String>,
    /// Refuse (400) requests carrying images or documents instead of showing the model a
    /// placeholder note where each was.
    #[arg(long, env = "NINFER_REJECT_NON_TEXT")]
    reject_non_text_content: bool,
    /// Hosts whose `http(s)` image URLs are fetched (comma separated or repeated): names or
    /// addresses, exactly, or `*.example.com` for every name under a domain. Default: none, and
    /// image URLs are refused (400). Redirects are not followed, and a name must resolve to
    /// public addresses (a private or loopback one is fetched only when named itself).
    #[arg(
        long = "image-url-hosts",
        value_name = "HOST",
        value_delimiter = ',',
        env = "NINFER_IMAGE_URL_HOSTS"
    )]
    image_url_hosts: Vec<String>,
    /// Seconds one request's image URL fetches may take together, connecting included.
    #[arg(long, default_value_t = 10.0)]
    image_url_timeout_seconds: f64,
    /// Encode control tokens typed in chat messages (`<|im_end|>`...) as control tokens, which
    /// lets a client forge chat-role boundaries. Default: they are encoded as the text they spell.
    #[arg(long, env = "NINFER_ALLOW_CONTROL_TOKENS_IN_MESSAGES")]
    allow_control_tokens_in_messages: bool,
    /// Open client connections at most (lowered to what the open-file limit allows); one more
    /// gets a 503 and is closed.
    #[arg(long, default_value_t = 8192)]
    max_connections: usize,
    /// Seconds a client has to send a request's headers before its connection is closed.
    #[arg(long, default_value_t = 10.0)]
    header_timeout_seconds: f64,
    /// Seconds a request body may take in all (it may never pause for more than 10 s).
    #[arg(long, default_value_t = 60.0)]
    body_timeout_seconds: f64,
    /// Seconds a connection may stay silent before it is closed.
    #[arg(long, default_value_t = 60.0)]
    idle_timeout_seconds: f64,
    /// At shutdown, seconds requests in flight get to finish before their connections are cut.
    #[arg(long, default_value_t = 1.2)]
    drain_seconds: f64,
    /// Requests that may wait for a free engine sequence when every one is busy; more get 429.
    #[arg(long, default_value_t = 256)]
    max_queued_requests: u32,
    /// Longest wait for a free engine sequence, in milliseconds, before a 429.
    #[arg(long, default_value_t = 5000)]
    queue_timeout_ms: u64,
    /// How long an answer whose engine went away (killed, crashed, restarted) waits for a ready
    /// engine to continue on, in seconds; 0: it ends with an error at once.
    #[arg(long, default_value_t = 30.0)]
    resume_timeout_seconds: f64,
    /// File holding the engines' control secret, sent with every engine call (also
    /// `NINFER_CONTROL_SECRET_FILE` or `NINFER_CONTROL_SECRET`).
    #[arg(long, value_name = "FILE")]
    control_secret_file: Option<PathBuf>,
    /// Threads that serve requests and streams. 1 (the default) runs everything on one thread:
    /// each token then reaches the client without waking another thread, and the work a token
    /// costs (microseconds) leaves one core far from busy even at hundreds of streams; prompt
    /// rendering and tokenization run on a separate pool either way. More threads only pay off
    /// when the gateway's own work per request dominates (many short non-streaming requests).
    #[arg(long, default_value_t = 1, env = "NINFER_GATEWAY_THREADS")]
    threads: usize,
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

/// A duration flag in seconds, refusing what `Duration` cannot hold.
fn seconds_flag(name: &str, seconds: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|duration| !duration.is_zero())
        .with_context(|| format!("--{name} {seconds}: give a positive number of seconds"))
}

/// Makes the allocator give large buffers back to the system when they are freed: glibc's
/// adaptive threshold otherwise serves the next multi-megabyte request bodies from its heap and
/// keeps that memory for good (a few large prompts left the gateway at a gigabyte).
fn return_large_allocations_to_the_system() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before other threads start.
    unsafe {
        nix::libc::mallopt(nix::libc::M_MMAP_THRESHOLD, 256 * 1024);
        nix::libc::mallopt(nix::libc::M_TRIM_THRESHOLD, 1024 * 1024);
    }
}

fn main() -> anyhow::Result<()> {
    return_large_allocations_to_the_system();
    let flags = Flags::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    if flags.log_json {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .json()
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    let runtime = build_runtime(flags.threads)?;
    let result = runtime.block_on(run(flags));
    // Blocking tasks (a tokenization) must not hold the exit past the drain.
    runtime.shutdown_timeout(Duration::from_millis(100));
    result
}

/// The runtime: one thread (`threads` ≤ 1) or that many workers. Under the one-thread scheduler a
/// task woken by a socket runs on the thread that read it, where the work-stealing scheduler
/// wakes an idle worker (a futex round trip, a context switch) for nearly every token.
fn build_runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(threads);
        builder
    };
    builder
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

async fn run(flags: Flags) -> anyhow::Result<()> {
    let routing_stats = RoutingStatsHandle::start(
        flags.state_dir.clone(),
        Duration::from_secs(flags.stats_persist_seconds.max(1)),
    )
    .context("loading routing statistics from the state directory")?;
    let pool_options = EnginePoolOptions {
        poll_interval: Duration::from_millis(flags.engine_poll_ms.max(50)),
        max_in_flight_requests: flags.max_in_flight_requests,
        max_queued_requests: flags.max_queued_requests,
        queue_timeout: Duration::from_millis(flags.queue_timeout_ms),
        typed_control_tokens: if flags.allow_control_tokens_in_messages {
            TypedControlTokens::AsControlTokens
        } else {
            TypedControlTokens::AsText
        },
        control_secret: ninfer_protocol::control_secret::load(flags.control_secret_file.as_deref())
            .context("--control-secret-file")?,
        resume_timeout: seconds_flag("resume-timeout-seconds", flags.resume_timeout_seconds)?,
        ..Default::default()
    };
    let limits = ConnectionLimits {
        max_connections: flags.max_connections.max(1),
        header_read_timeout: seconds_flag("header-timeout-seconds", flags.header_timeout_seconds)?,
        body_read_timeout: seconds_flag("body-timeout-seconds", flags.body_timeout_seconds)?,
        idle_timeout: seconds_flag("idle-timeout-seconds", flags.idle_timeout_seconds)?,
        drain_deadline: seconds_flag("drain-seconds", flags.drain_seconds)?,
        ..Default::default()
    };
    raise_open_file_limit();
    let limits = limits.within_open_file_limit();
    let pool = EnginePool::start(&flags.engine, pool_options, Some(routing_stats.clone()))
        .context("starting the engine pool")?;
    let settings = GatewaySettings {
        api_key: flags.api_key.clone().filter(|k| !k.is_empty()),
        max_body_bytes: flags.max_body_bytes,
        model_aliases: ModelAliases::parse(&flags.model_aliases)
            .context("reading --model-alias")?,
        non_text_content: if flags.reject_non_text_content {
            NonTextContent::Reject
        } else {
            NonTextContent::Placeholder
        },
        // One request's fetched images together are held to what its inline images could be.
        image_urls: ImageUrlPolicy::from_hosts(
            &flags.image_url_hosts,
            seconds_flag("image-url-timeout-seconds", flags.image_url_timeout_seconds)?,
            flags
                .max_body_bytes
                .min(ninfer_vision_input::DecodeLimits::default().max_encoded_bytes),
        )
        .map_err(|problem| anyhow::anyhow!("--image-url-hosts: {problem}"))?,
    };
    let state = GatewayState::new(Arc::new(pool), Some(routing_stats.clone()), settings);
    let router = ninfer_gateway::build_router(state);
    let listener = tokio::net::TcpListener::bind(&flags.listen)
        .await
        .with_context(|| format!("binding {}", flags.listen))?;
    let local_address = listener.local_addr().context("reading the bound address")?;
    tracing::info!(listen = %local_address, engines = ?flags.engine, "ninfer-gateway serving HTTP and gRPC");
    // Ready means "accepting connections"; /health tells whether an engine is up.
    if let Err(error) = sd_notify::notify(&format!("READY=1\nSTATUS=serving on {local_address}")) {
        tracing::warn!(%error, "could not notify systemd");
    }
    if let Some(interval) = sd_notify::watchdog_interval() {
        // The tick runs on the same runtime as the server: if the runtime wedges, systemd restarts us.
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let _ = sd_notify::notify("WATCHDOG=1");
            }
        });
    }
    ninfer_gateway::connections::serve_connections(listener, router, shutdown_signal(), limits)
        .await
        .context("serving")?;
    let _ = sd_notify::notify("STOPPING=1");
    // Bounded, so a slow disk cannot hold the exit past the stop deadline.
    match tokio::time::timeout(Duration::from_millis(300), routing_stats.flush()).await {
        Ok(flushed) => flushed.context("writing routing statistics at shutdown")?,
        Err(_) => {
            tracing::warn!("routing statistics not written: the disk is too slow at shutdown")
        }
    }
    Ok(())
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(_) => {
                let _ = interrupt.await;
                return;
            }
        };
    tokio::select! {
        _ = interrupt => {}
        _ = terminate.recv() => {}
    }
    tracing::info!("shutting down");
}
