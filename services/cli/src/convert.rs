//! `ninfer convert HF_DIR OUT.ninfer`: progress display and Ctrl-C handling around
//! `ninfer_convert::convert_checkpoint`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use ninfer_artifact::DType;
use ninfer_convert::{ConvertOptions, ConvertProgress};

#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files).
    pub input_dir: PathBuf,
    /// Output artifact path, e.g. `model.ninfer`.
    pub output: PathBuf,
    /// Storage type of routed experts: f32, bf16, int8 or int4 (group size 32, f16 scales).
    #[arg(long, default_value = "bf16")]
    pub experts_dtype: DType,
    /// Storage type of embeddings and dense matrices: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dense_dtype: DType,
    /// Split the artifact into files of at most this many GB (10^9 bytes).
    #[arg(long)]
    pub max_file_gb: Option<f64>,
    /// Copy tensors already converted in this artifact; convert only what is new.
    #[arg(long)]
    pub reuse: Option<PathBuf>,
    /// Drop vision-tower tensors (logged) instead of keeping them as class `vision`.
    #[arg(long)]
    pub skip_vision: bool,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_signal: nix::libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C / SIGTERM set a flag the converter polls between tensors, so it can delete its
/// temporary files instead of dying with them on disk.
fn install_interrupt_handler() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_interrupt),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        let _ = unsafe { sigaction(signal, &action) };
    }
}

/// A bar on a terminal, plain log lines (every ~5%) otherwise.
struct CliProgress {
    bar: Option<ProgressBar>,
    total: Mutex<(u64, u64, u64)>,
}

impl ConvertProgress for CliProgress {
    fn start(&self, total_tensors: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total_tensors);
        }
        if let Ok(mut state) = self.total.lock() {
            state.0 = total_tensors;
        }
    }

    fn tensor_written(&self, name: &str, bytes: u64) {
        let tensors = if name.ends_with(".moe.experts") { 2 } else { 1 };
        if let Some(bar) = &self.bar {
            bar.inc(tensors);
            bar.set_message(name.to_string());
            return;
        }
        if let Ok(mut state) = self.total.lock() {
            state.1 += tensors;
            state.2 += bytes;
            let (total, done, written) = *state;
            let step = (total / 20).max(1);
            if done % step < tensors || done == total {
                tracing::info!(
                    "converted {done}/{total} tensors ({:.1} MiB), last: {name}",
                    written as f64 / 1048576.0
                );
            }
        }
    }

    fn note(&self, message: &str) {
        match &self.bar {
            Some(bar) => bar.println(format!("note: {message}")),
            None => tracing::info!("{message}"),
        }
    }

    fn cancelled(&self) -> bool {
        INTERRUPTED.load(Ordering::SeqCst)
    }
}

pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    install_interrupt_handler();
    let max_file_bytes = match args.max_file_gb {
        Some(gb) if gb.is_finite() && gb > 0.0 => Some((gb * 1e9) as u64),
        Some(gb) => anyhow::bail!("--max-file-gb must be a positive number, got {gb}"),
        None => None,
    };
    let options = ConvertOptions {
        input_dir: args.input_dir.clone(),
        output: args.output.clone(),
        experts_dtype: args.experts_dtype,
        dense_dtype: args.dense_dtype,
        max_file_bytes,
        reuse: args.reuse.clone(),
        skip_vision: args.skip_vision,
    };
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::new(0);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} tensors {msg}",
        ) {
            bar.set_style(style);
        }
        bar
    });
    let progress = CliProgress {
        bar,
        total: Mutex::new((0, 0, 0)),
    };
    let started = std::time::Instant::now();
    let result = ninfer_convert::convert_checkpoint(&options, &progress);
    if let Some(bar) = &progress.bar {
        bar.finish_and_clear();
    }
    let report = result.with_context(|| {
        format!(
            "converting {} into {}",
            args.input_dir.display(),
            args.output.display()
        )
    })?;
    println!(
        "wrote {} ({}, {} tensors converted, {} reused, {:.2} MiB in {} file(s)) in {:.1}s",
        args.output.display(),
        report.architecture,
        report.tensors_written,
        report.tensors_reused,
        report.bytes as f64 / 1048576.0,
        report.files.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
