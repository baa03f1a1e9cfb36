//! `ninfer`: the command-line front end (`convert`, `reshard`, `inspect`, `perplexity`, `bench`,
//! `serve`, `run`), which also fetches models named `ORG/NAME` from a hub (`hub`, `download`,
//! `stream`: a published conversion downloaded, else the checkpoint converted while it streams).
//!
//! Owns: argument parsing, progress display and human-readable reports.
//! Must not touch: model math or file formats directly; it calls the library crates.

mod bench;
mod bench_channel;
mod bench_during_prefill;
mod bench_model;
mod bench_model_args;
mod bench_model_measure;
mod bench_model_report;
mod bench_mtp;
mod bench_sampling;
mod bench_serve;
mod bench_serve_agent;
mod bench_serve_client;
mod bench_tokens;
mod bench_vision;
mod convert;
mod download;
mod hub;
mod in_process;
mod inspect;
mod interrupt;
mod model_facts;
mod perplexity;
mod plan;
mod plan_gpus;
mod plan_machine;
mod plan_print;
mod reshard;
mod run;
mod serve;
mod stream;
mod supervisor;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "ninfer",
    version,
    about = "Run giant Mixture-of-Experts models on one workstation"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Convert a Hugging Face checkpoint directory into a `.ninfer` artifact.
    Convert(convert::ConvertArgs),
    /// Re-split an artifact into files of another size (no checkpoint needed).
    Reshard(reshard::ReshardArgs),
    /// Print an artifact's architecture, parameter counts and bytes per tensor class.
    Inspect(inspect::InspectArgs),
    /// Mean negative log-likelihood of a text file under a model.
    Perplexity(perplexity::PerplexityArgs),
    /// Benchmarks: a model end to end (`bench MODEL`), memory bandwidth, expert kernels, channel.
    Bench(bench::BenchArgs),
    /// Start the expert workers and the engine as supervised processes (the engine's gRPC API).
    Serve(serve::ServeArgs),
    /// Start workers, engine and gateway, then chat in the terminal (or `--serve` the API).
    Run(run::RunArgs),
}

/// Program names of the seeds' tool and the subcommand each stands for: a link to `ninfer`
/// under one of these names behaves as `ninfer SUBCOMMAND`.
const SEEDS_NAMES: [(&str, &str); 3] = [
    ("ninfer-run", "run"),
    ("ninfer-serve", "serve"),
    ("ninfer-perplexity", "perplexity"),
];

/// The command line, with the subcommand put in when invoked under one of [`SEEDS_NAMES`].
fn arguments_with_seeds_names(
    arguments: impl Iterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let mut arguments: Vec<std::ffi::OsString> = arguments.collect();
    let invoked_as = arguments
        .first()
        .and_then(|program| std::path::Path::new(program).file_name())
        .and_then(|name| name.to_str())
        .map(str::to_string);
    if let Some(invoked_as) = invoked_as {
        if let Some((_, subcommand)) = SEEDS_NAMES.iter().find(|(name, _)| *name == invoked_as) {
            arguments.insert(1, (*subcommand).into());
        }
    }
    arguments
}

fn main() -> std::process::ExitCode {
    supervisor::remember_startup_affinity();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let cli = Cli::parse_from(arguments_with_seeds_names(std::env::args_os()));
    let result = match cli.command {
        Command::Convert(args) => convert::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Reshard(args) => reshard::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Run(args) => run::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
