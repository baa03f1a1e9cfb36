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
use ninfer_gateway::generation::ModelAliases;
use ninfer_gateway::routing_stats::RoutingStatsHandle;
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
    /// How often engines are polled for readiness, in milliseconds.
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
    /// Log as JSON lines.
    #[arg(long)]
    log_json: bool,
}

fn main() -> anyhow::Result<()> {
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
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(run(flags))
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
        ..Default::default()
    };
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
    ninfer_gateway::serve(listener, router, shutdown_signal())
        .await
        .context("serving")?;
    let _ = sd_notify::notify("STOPPING=1");
    routing_stats
        .flush()
        .await
        .context("writing routing statistics at shutdown")?;
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
