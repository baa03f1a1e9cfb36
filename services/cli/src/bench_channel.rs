//! `ninfer bench channel`: round-trip latency of the shared-memory activation channel between
//! two processes (this one as the engine, a child `ninfer bench channel-echo` as the worker),
//! for an empty request and a 2048-float request; median and p99.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ninfer_channel::{ChannelGeometry, EngineChannel, Request, WaitOutcome, WorkerChannel};

#[derive(Debug, clap::Args)]
pub struct ChannelBenchArgs {
    /// Round trips per request size.
    #[arg(long, default_value_t = 20000)]
    pub iterations: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ChannelEchoArgs {
    /// Shared-memory name to attach to.
    #[arg(long)]
    pub name: String,
    /// Hidden size of the channel.
    #[arg(long)]
    pub hidden: u32,
}

/// The worker side: copies hidden states to the output until the parent goes away.
pub fn run_echo(args: ChannelEchoArgs) -> anyhow::Result<()> {
    let channel = WorkerChannel::attach(&args.name, args.hidden)
        .with_context(|| format!("attaching to {}", args.name))?;
    let parent = nix::unistd::getppid();
    loop {
        match channel.next_request(Duration::from_millis(200)) {
            Some((slot, request)) => {
                let count = request.hidden.len();
                let hidden = request.hidden.as_ptr();
                // SAFETY: between next_request and complete for this slot; input and output
                // areas of a slot are disjoint.
                let output = unsafe { channel.output_mut(slot) };
                unsafe { std::ptr::copy_nonoverlapping(hidden, output.as_mut_ptr(), count) };
                channel.complete(slot, Ok(()));
            }
            None => {
                if nix::unistd::getppid() != parent {
                    return Ok(());
                }
            }
        }
    }
}

fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * fraction).round() as usize]
}

pub fn run(args: ChannelBenchArgs) -> anyhow::Result<()> {
    if args.iterations == 0 {
        bail!("--iterations must be at least 1");
    }
    let hidden_size = 2048u32;
    let name = format!("ninfer-bench-{}", std::process::id());
    let channel = EngineChannel::create(
        &name,
        ChannelGeometry {
            slot_count: 1,
            max_tokens: 1,
            hidden_size,
            max_top_k: 8,
        },
    )?;
    let exe = std::env::current_exe().context("locating the ninfer binary")?;
    let mut echo = Command::new(exe)
        .args([
            "bench",
            "channel-echo",
            "--name",
            channel.name(),
            "--hidden",
            &hidden_size.to_string(),
        ])
        .stdin(Stdio::null())
        .spawn()
        .context("starting the echo process")?;
    let hidden: Vec<f32> = (0..hidden_size).map(|i| i as f32).collect();
    let ids = [0u32; 8];
    let weights = [0.125f32; 8];
    let mut rows = Vec::new();
    for (label, tokens) in [("empty request", 0u32), ("2048-float request", 1)] {
        let vectors = tokens as usize * hidden_size as usize;
        let entries = tokens as usize * 8;
        let request = Request {
            layer: 0,
            token_count: tokens,
            top_k: 8,
            expert_ids: &ids[..entries],
            routing_weights: &weights[..entries],
            hidden: &hidden[..vectors],
        };
        let mut samples = Vec::with_capacity(args.iterations);
        for iteration in 0..args.iterations + 1000 {
            let started = Instant::now();
            let sequence = channel.post(0, &request)?;
            match channel.wait(0, sequence, Duration::from_secs(10)) {
                WaitOutcome::Done => {}
                other => {
                    let _ = echo.kill();
                    bail!("the echo process did not answer: {other:?}");
                }
            }
            let elapsed = started.elapsed().as_secs_f64() * 1e6;
            // The first thousand warm caches and page tables.
            if iteration >= 1000 {
                samples.push(elapsed);
            }
        }
        if tokens == 1 && channel.output(0) != &hidden[..] {
            bail!("the echo process returned wrong data");
        }
        samples.sort_by(f64::total_cmp);
        rows.push((
            label,
            percentile(&samples, 0.5),
            percentile(&samples, 0.99),
            samples[0],
        ));
    }
    let _ = echo.kill();
    let _ = echo.wait();
    if args.json {
        let entries: Vec<serde_json::Value> = rows
            .iter()
            .map(|(label, median, p99, min)| serde_json::json!({"request": label, "median_us": median, "p99_us": p99, "min_us": min}))
            .collect();
        println!(
            "{}",
            serde_json::json!({"iterations": args.iterations, "results": entries})
        );
    } else {
        println!(
            "activation channel round trip, two processes, {} iterations each",
            args.iterations
        );
        println!(
            "{:<20} {:>12} {:>12} {:>12}",
            "request", "median µs", "p99 µs", "min µs"
        );
        for (label, median, p99, min) in rows {
            println!("{label:<20} {median:>12.2} {p99:>12.2} {min:>12.2}");
        }
    }
    Ok(())
}
