//! `ninfer convert HF_DIR OUT.ninfer` and `ninfer convert --synthetic PRESET OUT.ninfer`: argument
//! checks, progress display and Ctrl-C handling around `ninfer_convert::convert_checkpoint` and
//! `ninfer_convert::write_synthetic`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use ninfer_artifact::DType;
use ninfer_convert::synthetic::{Preset, Routing, SyntheticOptions, DEFAULT_SEED};
use ninfer_convert::synthetic_tokenizer::SyntheticTokenizer;
use ninfer_convert::{ConvertOptions, ConvertProgress};

use crate::interrupt::{install_interrupt_handler, interrupted};

#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files), or
    /// `ORG/NAME`: found in the models directory, else converted while it streams from the
    /// hub (only the ranges of the next tensors on disk); left out with --synthetic.
    #[arg(value_name = "HF_DIR")]
    pub input_dir: Option<PathBuf>,
    /// Output artifact path, e.g. `model.ninfer`.
    #[arg(value_name = "OUT.ninfer")]
    pub output: Option<PathBuf>,
    /// Write random weights with the exact shapes of a released model instead of converting a
    /// checkpoint: qwen3-30b-a3b, qwen3.5-35b-a3b, qwen3-next-80b-a3b, qwen3-235b-a22b.
    #[arg(long, value_name = "PRESET", conflicts_with_all = ["reuse", "skip_vision"])]
    pub synthetic: Option<Preset>,
    /// With --synthetic: keep only the first N decoder layers (same layer-type pattern).
    #[arg(long, value_name = "N", requires = "synthetic")]
    pub layers: Option<usize>,
    /// With --synthetic: `zipf[:S]` (expert popularity per layer ~ 1/rank^S; S defaults to 1),
    /// `trained` (each layer's popularity by rank as measured on the trained test fixture, at the
    /// same relative depth) or `uniform` (plain random router weights).
    #[arg(long, default_value = "zipf:1", requires = "synthetic")]
    pub routing: Routing,
    /// With --synthetic: random seed (same seed and options, same artifact).
    #[arg(long, default_value_t = DEFAULT_SEED, requires = "synthetic")]
    pub seed: u64,
    /// With --synthetic on a Qwen4-Exp preset: the n-gram vocabulary base the hashed n-gram
    /// tables are sized from (the released 20000000 makes a table of about 102 GB in bf16). A
    /// token gathers a fixed number of rows whatever the table's size, so a smaller table keeps
    /// the per-token work and fits a smaller disk.
    #[arg(long, value_name = "N", requires = "synthetic")]
    pub ngram_vocab_base: Option<usize>,
    /// With --synthetic: toy dimensions with the preset's structure (for tests). With
    /// --tokenizer the vocabulary keeps the preset's size.
    #[arg(long, hide = true, requires = "synthetic")]
    pub scale_down: bool,
    /// With --synthetic: carry this directory's tokenizer (`tokenizer.json` or
    /// `tokenizer.json.gz`, `tokenizer_config.json`, chat template, `generation_config.json`)
    /// instead of the small built-in one, so speed measurements pay the real vocabulary's
    /// detokenisation and sampling costs. It must fit the preset's vocabulary.
    #[arg(long, value_name = "DIR", requires = "synthetic")]
    pub tokenizer: Option<PathBuf>,
    /// With --synthetic: every answer ends at once (the head always ranks `<|im_end|>` first),
    /// for tests of clients that need a finished turn.
    #[arg(long, requires = "synthetic")]
    pub ends_turns: bool,
    /// Storage type of routed experts: f32, bf16, int8 or int4 (group size 32, f16 scales).
    #[arg(long, default_value = "bf16")]
    pub experts_dtype: DType,
    /// Storage type of embeddings and dense matrices: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dense_dtype: DType,
    /// Split the artifact into files of at most this many GB (10^9 bytes; default 32, which
    /// every common file system takes).
    #[arg(long)]
    pub max_file_gb: Option<f64>,
    /// Copy tensors already converted in this artifact; convert only what is new.
    #[arg(long)]
    pub reuse: Option<PathBuf>,
    /// Drop vision-tower tensors (logged) instead of keeping them as class `vision`.
    #[arg(long)]
    pub skip_vision: bool,
    /// Where models named `ORG/NAME` live (default: `$NINFER_MODELS_DIR`, else
    /// `~/ninfer-models`).
    #[arg(long, value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    /// Where a model named `ORG/NAME` that is not in the models directory comes from: `auto`
    /// (the default, also from `$NINFER_SOURCE`: Hugging Face, else ModelScope),
    /// `huggingface` or `modelscope`.
    #[arg(long, value_enum)]
    pub source: Option<crate::hub::SourceChoice>,
    /// For `ORG/NAME`: most disk space, in GB, the byte ranges fetched ahead of the conversion
    /// may take (default 20).
    #[arg(long, value_name = "GB")]
    pub cache_gb: Option<f64>,
}

/// A bar on a terminal, plain log lines (every ~5%) otherwise.
struct CliProgress {
    bar: Option<ProgressBar>,
    total: Mutex<(u64, u64, u64)>,
}

impl CliProgress {
    fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(0);
            if let Ok(style) = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} tensors {msg}",
            ) {
                bar.set_style(style);
            }
            bar
        });
        CliProgress {
            bar,
            total: Mutex::new((0, 0, 0)),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
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
        interrupted()
    }
}

/// A usage error printed the way clap prints its own (with the usage line), exit status 2.
fn usage_error(message: String) -> ! {
    use clap::Args;
    let mut command = ConvertArgs::augment_args(clap::Command::new("ninfer convert"));
    command
        .error(clap::error::ErrorKind::ArgumentConflict, message)
        .exit()
}

/// `(input_dir, output)`: a checkpoint directory and an output, or (with --synthetic) only the
/// output.
fn paths(args: &ConvertArgs) -> (Option<PathBuf>, PathBuf) {
    match (&args.synthetic, &args.input_dir, &args.output) {
        (None, Some(input), Some(output)) => (Some(input.clone()), output.clone()),
        (Some(_), Some(output), None) => (None, output.clone()),
        (Some(preset), Some(input), Some(_)) => usage_error(format!(
            "--synthetic {} replaces the checkpoint directory: give only the output path, not `{}` as well",
            preset.name,
            input.display()
        )),
        (Some(_), None, _) => usage_error("--synthetic PRESET needs the output path".into()),
        (None, Some(_), None) => usage_error(
            "missing the output path: `ninfer convert HF_DIR OUT.ninfer`".into(),
        ),
        (None, None, _) => usage_error(
            "give a checkpoint directory and an output path (`ninfer convert HF_DIR OUT.ninfer`), or a preset and an output path (`ninfer convert --synthetic PRESET OUT.ninfer`)".into(),
        ),
    }
}

/// The file size `convert` splits at when not told: the seeds' 32 GB.
const DEFAULT_MAX_FILE_GB: f64 = 32.0;

/// `--max-file-gb` in bytes; a value that is not a positive number is refused by name.
pub(crate) fn max_file_bytes(gb: Option<f64>) -> anyhow::Result<Option<u64>> {
    match gb {
        Some(gb) if gb.is_finite() && gb > 0.0 => Ok(Some((gb * 1e9) as u64)),
        Some(gb) => anyhow::bail!("--max-file-gb must be a positive number, got {gb}"),
        None => Ok(None),
    }
}

pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let (input_dir, output) = paths(&args);
    install_interrupt_handler();
    let max_file_bytes = max_file_bytes(Some(args.max_file_gb.unwrap_or(DEFAULT_MAX_FILE_GB)))?;
    let progress = CliProgress::new();
    let started = std::time::Instant::now();
    let Some(input_dir) = input_dir else {
        let Some(preset) = args.synthetic.clone() else {
            anyhow::bail!("--synthetic PRESET is missing");
        };
        let name = preset.name;
        let tokenizer = match &args.tokenizer {
            Some(directory) => Some(
                SyntheticTokenizer::from_directory(directory, &progress)
                    .with_context(|| format!("--tokenizer {}", directory.display()))?,
            ),
            None => None,
        };
        let mut preset = if args.scale_down {
            let mut small = preset.scaled_down();
            if let Some(tokenizer) = &tokenizer {
                // Toy width, the real vocabulary: the head and sampling cost what they do.
                small.vocab_size = preset
                    .vocab_size
                    .max(tokenizer.token_count.next_multiple_of(64));
            }
            small
        } else {
            preset
        };
        if let (Some(tokenizer), Some(parts)) = (&tokenizer, preset.qwen4_exp.as_mut()) {
            parts.eos_token_id = tokenizer.end_of_text_id as usize;
        }
        if let Some(base) = args.ngram_vocab_base {
            let Some(parts) = preset.qwen4_exp.as_mut() else {
                anyhow::bail!(
                    "--ngram-vocab-base applies to Qwen4-Exp presets only; {name} has no n-gram tables"
                );
            };
            if base == 0 {
                anyhow::bail!("--ngram-vocab-base must be positive");
            }
            parts.ngram_vocab_size_base = base;
        }
        let options = SyntheticOptions {
            preset,
            output: output.clone(),
            experts_dtype: args.experts_dtype,
            dense_dtype: args.dense_dtype,
            layers: args.layers,
            routing: args.routing,
            seed: args.seed,
            max_file_bytes,
            threads: None,
            tokenizer,
            ends_turns: args.ends_turns,
        };
        let result = ninfer_convert::write_synthetic(&options, &progress);
        progress.finish();
        let report = result
            .with_context(|| format!("writing synthetic {name} into {}", output.display()))?;
        print_report(&output, &report, started);
        return Ok(());
    };
    let mut options = ConvertOptions {
        input_dir: input_dir.clone(),
        output: output.clone(),
        experts_dtype: args.experts_dtype,
        dense_dtype: args.dense_dtype,
        max_file_bytes,
        reuse: args.reuse.clone(),
        skip_vision: args.skip_vision,
    };
    if let Some(repository) = repository_to_stream(&input_dir, &args) {
        progress.finish();
        let cache_bound = crate::stream::cache_bytes(args.cache_gb)?;
        let report = crate::stream::convert_named(&repository, &options, args.source, cache_bound)?;
        print_report(&output, &report, started);
        return Ok(());
    }
    let input_dir = local_checkpoint(&input_dir, &args);
    options.input_dir = input_dir.clone();
    let result = ninfer_convert::convert_checkpoint(&options, &progress);
    progress.finish();
    let report = result.with_context(|| {
        format!(
            "converting {} into {}",
            input_dir.display(),
            output.display()
        )
    })?;
    print_report(&output, &report, started);
    Ok(())
}

/// The repository `ORG/NAME` HF_DIR names when it is not a path here and not (wholly) in the
/// models directory: it is converted while it streams from the hub.
fn repository_to_stream(input: &std::path::Path, args: &ConvertArgs) -> Option<String> {
    let models_dir = crate::model_facts::models_dir(args.models_dir.as_deref());
    crate::download::repository_to_download(input, &models_dir).map(|(repository, _)| repository)
}

/// The checkpoint directory HF_DIR names: itself, or for `ORG/NAME` its directory in the
/// models directory.
fn local_checkpoint(input: &std::path::Path, args: &ConvertArgs) -> PathBuf {
    if input.exists() {
        return input.to_path_buf();
    }
    let models_dir = crate::model_facts::models_dir(args.models_dir.as_deref());
    match crate::model_facts::repository_id(input) {
        Some((organisation, name)) => models_dir.join(organisation).join(name),
        None => input.to_path_buf(),
    }
}

fn print_report(
    output: &std::path::Path,
    report: &ninfer_convert::ConvertReport,
    started: std::time::Instant,
) {
    println!(
        "wrote {} ({}, {} tensors converted, {} reused, {:.2} MiB in {} file(s)) in {:.1}s",
        output.display(),
        report.architecture,
        report.tensors_written,
        report.tensors_reused,
        report.bytes as f64 / 1048576.0,
        report.files.len(),
        started.elapsed().as_secs_f64()
    );
}
