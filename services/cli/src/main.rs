//! `ninfer`: the command-line front end (`convert`, `inspect`, `perplexity`, `bench`, `serve`, `run`).
//!
//! Owns: argument parsing, progress display and human-readable reports.
//! Must not touch: model math or file formats directly; it calls the library crates.

mod bench;
mod bench_channel;
mod bench_model;
mod convert;
mod inspect;
mod model_facts;
mod perplexity;
mod plan;
mod run;
mod serve;
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
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Convert(args) => convert::run(args),
        Command::Inspect(args) => inspect::run(args),
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
