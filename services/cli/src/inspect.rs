//! `ninfer inspect FILE [--verify]`: architecture, parameter counts and bytes per tensor class
//! and dtype; `--verify` recomputes every checksum.

use std::path::PathBuf;

use anyhow::Context;
use ninfer_artifact::summary::totals_by_class_and_dtype;
use ninfer_artifact::Artifact;

#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// The `.ninfer` artifact (part 0 of a split artifact).
    pub file: PathBuf,
    /// Recompute and compare the checksum of every tensor and embedded file.
    #[arg(long)]
    pub verify: bool,
    /// Also list every tensor.
    #[arg(long)]
    pub tensors: bool,
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let artifact =
        Artifact::open(&args.file).with_context(|| format!("opening {}", args.file.display()))?;
    let header = artifact.header();
    let common = artifact.config().common();
    println!("file:          {}", args.file.display());
    println!(
        "parts:         {} ({} in all)",
        artifact.part_paths().len(),
        human_bytes(artifact.total_length())
    );
    println!("architecture:  {}", artifact.config().architecture());
    println!(
        "source:        {} ({})",
        header.source.model_type, header.source.converter
    );
    println!(
        "layers:        {} (hidden {}, heads {}/{} of dim {}, vocab {})",
        common.num_hidden_layers,
        common.hidden_size,
        common.num_attention_heads,
        common.num_key_value_heads,
        common.head_dim,
        common.vocab_size
    );
    let moe_layers = common.moe_layers.iter().filter(|&&m| m).count();
    let dense_layers = common.num_hidden_layers - moe_layers;
    if moe_layers > 0 {
        println!(
            "experts:       {} per MoE layer, top-{}, intermediate {} ({} MoE layers)",
            common.num_experts,
            common.num_experts_per_tok,
            common.moe_intermediate_size,
            moe_layers
        );
    }
    if dense_layers > 0 {
        println!(
            "dense MLP:     intermediate {} ({dense_layers} dense-MLP layers)",
            common.intermediate_size
        );
    }
    if let Some(c) = artifact.config().hybrid() {
        let linear = c
            .layer_types
            .iter()
            .filter(|t| **t == ninfer_artifact::LayerType::LinearAttention)
            .count();
        println!(
            "hybrid:        {linear} linear-attention + {} full-attention layers, MTP layers {}",
            c.layer_types.len() - linear,
            c.mtp_num_layers
        );
    }
    if let Some(c) = artifact.config().qwen4_exp() {
        println!(
            "qwen4_exp:     {} residual streams (mixer rank {}), QSA budget {} in blocks of {} ({} index heads of {}), PLE on layers {:?} (0-based; {}-grams, {} hashed heads)",
            c.hyper_connection_streams,
            c.hyper_connection_rank,
            c.indexer_budget,
            c.indexer_compress_ratio,
            c.indexer_heads,
            c.indexer_head_dim,
            c.ple_layers,
            c.ngram_size,
            c.ngram_heads()
        );
    }
    let files: Vec<String> = header
        .files
        .iter()
        .map(|(name, f)| format!("{name} ({})", human_bytes(f.length)))
        .collect();
    println!(
        "files:         {}",
        if files.is_empty() {
            "none".into()
        } else {
            files.join(", ")
        }
    );
    println!();
    println!(
        "{:<15} {:<6} {:>8} {:>16} {:>12}",
        "class", "dtype", "tensors", "parameters", "bytes"
    );
    let mut total_parameters = 0;
    let mut total_bytes = 0;
    for ((class, dtype), totals) in totals_by_class_and_dtype(header) {
        println!(
            "{:<15} {:<6} {:>8} {:>16} {:>12}",
            class.name(),
            dtype.name(),
            totals.tensors,
            totals.parameters,
            human_bytes(totals.bytes)
        );
        total_parameters += totals.parameters;
        total_bytes += totals.bytes;
    }
    println!(
        "{:<15} {:<6} {:>8} {:>16} {:>12}",
        "total",
        "",
        header.tensors.len(),
        total_parameters,
        human_bytes(total_bytes)
    );
    if args.tensors {
        println!();
        for tensor in &header.tensors {
            println!(
                "{} {} {} {:?} @{} {}",
                tensor.name,
                tensor.class,
                tensor.dtype,
                tensor.shape,
                tensor.offset,
                tensor.checksum
            );
        }
    }
    if args.verify {
        let total: u64 = header.tensors.iter().map(|t| t.length).sum::<u64>()
            + header.files.values().map(|f| f.length).sum::<u64>();
        let started = std::time::Instant::now();
        let mut last_report = std::time::Instant::now();
        artifact
            .verify(|checked| {
                if last_report.elapsed().as_secs() >= 2 {
                    eprintln!(
                        "verified {} of {}",
                        human_bytes(checked),
                        human_bytes(total)
                    );
                    last_report = std::time::Instant::now();
                }
            })
            .with_context(|| format!("verifying {}", args.file.display()))?;
        println!();
        println!(
            "checksums:     all {} tensors and {} files verified in {:.1}s",
            header.tensors.len(),
            header.files.len(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
